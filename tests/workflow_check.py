"""Offline validation of ComfyUI workflow JSON (UI format 0.4, subgraphs included) against node definitions
in /object_info form: node types exist, widget values fit their inputs, links are consistent."""

from __future__ import annotations

FRONTEND_ONLY = {"Note", "MarkdownNote", "Reroute", "PrimitiveNode"}
CONTROL_VALUES = {"fixed", "increment", "decrement", "randomize"}
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
DYNAMIC_COMBO = "COMFY_DYNAMICCOMBO_V3"
# model files are the user's: a loader's options list what is installed, so names are not checked
MODEL_FILE_EXT = (".safetensors", ".ckpt", ".pt", ".pth", ".bin", ".gguf", ".sft", ".onnx")
IO_NODES = {-10, -20}  # a subgraph's input and output nodes


def graphs(doc):
    yield "top", doc
    for sg in doc.get("definitions", {}).get("subgraphs", []):
        yield sg.get("name", sg.get("id")), sg


def _link(ln):
    if isinstance(ln, dict):
        return ln["id"], ln["origin_id"], ln["origin_slot"], ln["target_id"], ln["target_slot"]
    return tuple(ln[:5])


def widget_inputs(inputs: dict):
    """[(name, type, options)] of the inputs shown as widgets, in order (``inputs``: an /object_info
    node's "input" mapping)."""
    out = []
    for section in ("required", "optional"):
        for name, spec in (inputs.get(section) or {}).items():
            kind, opts = spec[0], (spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {})
            if isinstance(kind, list):
                out.append((name, "COMBO", dict(opts, options=kind)))
            elif (kind in WIDGET_TYPES or kind == DYNAMIC_COMBO) and not opts.get("forceInput"):
                out.append((name, kind, opts))
    return out


def check_value(name, kind, opts, value) -> str | None:
    if kind == "COMBO":
        options = opts.get("options") or []
        if isinstance(value, str) and value.lower().endswith(MODEL_FILE_EXT):
            return None
        if options and value not in options:
            return f"{name}={value!r} not in options {options[:8]}"
        return None
    if kind == "BOOLEAN":
        return None if isinstance(value, bool) else f"{name}={value!r} is not a boolean"
    if kind == "STRING":
        return None if isinstance(value, str) else f"{name}={value!r} is not a string"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{name}={value!r} is not a number"
    if kind == "INT" and int(value) != value:
        return f"{name}={value!r} is not an integer"
    if "min" in opts and value < opts["min"]:
        return f"{name}={value} < min {opts['min']}"
    if "max" in opts and value > opts["max"]:
        return f"{name}={value} > max {opts['max']}"
    return None


def check_widgets(node, node_def, strict: bool) -> list[str]:
    """Widget values against the node's inputs. Lenient (other packs' and core nodes, whose definitions
    move between versions): trailing values may be missing (the frontend fills defaults) and trailing
    empty strings (frontend-only widget state) may follow. Strict (our nodes): exactly one value each."""
    values = node.get("widgets_values")
    if values is None:
        return []
    if isinstance(values, dict):
        values = list(values.values())
    errors: list[str] = []
    i = _check_inputs(node_def.get("input", {}), values, 0, errors)
    if not strict:
        errors = [e for e in errors if not e.startswith("missing widget value")]
        while i < len(values) and values[i] in ("", None):
            i += 1
    if i < len(values):
        errors.append(f"{len(values) - i} extra widget value(s): {values[i:]!r}")
    return errors


def _check_inputs(inputs: dict, values: list, i: int, errors: list) -> int:
    """Check widget values from position i on; returns the position after the last one consumed."""
    for name, kind, opts in widget_inputs(inputs):
        if i >= len(values):
            errors.append(f"missing widget value for {name}")
            return i
        value = values[i]
        i += 1
        if kind == DYNAMIC_COMBO:  # a choice whose option brings widgets of its own
            chosen = next((o for o in opts.get("options", []) if o.get("key") == value), None)
            if chosen is None:
                errors.append(f"{name}={value!r} not among {[o.get('key') for o in opts.get('options', [])]}")
                return i
            i = _check_inputs(chosen.get("inputs", {}), values, i, errors)
            continue
        upload = next((u for u in ("image", "video", "audio") if opts.get(f"{u}_upload")), None)
        if upload:  # the user's own file; the frontend's upload button stores one more value after it
            if i < len(values) and values[i] == upload:
                i += 1
            continue
        err = check_value(name, kind, opts, value)
        if err:
            errors.append(err)
        if opts.get("control_after_generate") and i < len(values) and values[i] in CONTROL_VALUES:
            i += 1
    return i


def check_workflow(doc, node_defs: dict, strict_types=frozenset()) -> list[str]:
    """All problems found (empty when the workflow is valid); ``strict_types``: node types whose widget
    values must match their inputs one to one (our own nodes)."""
    errors = []
    sub_ids = {sg.get("id") for _, sg in graphs(doc) if sg is not doc}
    for gname, g in graphs(doc):
        nodes = {n["id"]: n for n in g.get("nodes", [])}
        for n in nodes.values():
            t = n["type"]
            where = f"{gname}/{t}#{n['id']}"
            if t in FRONTEND_ONLY or t in sub_ids:
                continue
            if t not in node_defs:
                errors.append(f"{where}: unknown node type")
                continue
            errors += [f"{where}: {e}" for e in check_widgets(n, node_defs[t], strict=t in strict_types)]
        for ln in g.get("links", []):
            lid, o, oslot, t, tslot = _link(ln)
            if o not in nodes and o not in IO_NODES:
                errors.append(f"{gname}: link {lid} from missing node {o}")
            elif o in nodes and lid not in (nodes[o]["outputs"][oslot].get("links") or []):
                errors.append(f"{gname}: link {lid} not listed on its origin {nodes[o]['type']}#{o}")
            if t not in nodes and t not in IO_NODES:
                errors.append(f"{gname}: link {lid} to missing node {t}")
            elif t in nodes and nodes[t]["inputs"][tslot].get("link") != lid:
                errors.append(f"{gname}: link {lid} not set on its target {nodes[t]['type']}#{t}")
    return errors
