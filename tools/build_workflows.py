"""Build the bundled workflows from ComfyUI's official templates, with our preset node inserted.

    pip download --no-deps -d tpl comfyui-workflow-templates-media-image==0.3.17 \
        comfyui-workflow-templates-media-video==0.3.12      # the templates ComfyUI 0.3.75 pins (PyPI)
    python tools/build_workflows.py --templates DIR          # DIR: those wheels' templates/*.json
                                                             # writes workflows/*.json and *.jpg

The templates pinned by ComfyUI 0.3.75 are used (not the newest) so the workflows load there and on
every newer ComfyUI: newer templates use core nodes 0.3.75 lacks (e.g. ComfySwitchNode). Models that only
newer ComfyUI runs come from the templates that release pins (NEWER below, e.g. MiniMax H3 from ComfyUI
0.33.0's comfyui-workflow-templates 0.11.44); the workflow records that minimum in
``extra.sparse_attention_min_comfyui`` and the tests validate it only on trees at least that new:

    python tools/build_workflows.py --templates DIR033 --only video_minimax_h3_t2v   # DIR033: 0.33.0's templates

For each template below, every model loader's MODEL output (UNETLoader, CheckpointLoaderSimple,
ImageOnlyCheckpointLoader; top level and inside subgraphs) is re-routed through a "Sparse Attention
(Preset)" node with the preset chosen for that loader's model file (and, where the preset depends on the
step count, for the steps of the sampler the loader's model reaches: e.g. Wan 2.2's 4-step LoRA group and
its 20-step group), and a Note explaining the settings is added. The node takes its loader's mode (a
loader in a bypassed or muted group stays so) and is placed near the loader where it covers no other node
and no group title. Model file names and every other setting stay the template's, so users' files match.
"""

from __future__ import annotations

import argparse
import copy
import importlib.resources
import json
import logging
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOADERS = {"UNETLoader", "CheckpointLoaderSimple", "ImageOnlyCheckpointLoader"}
NODE = "SparseAttn_Preset"
log = logging.getLogger("build_workflows")

# output name: (template, title, {substring of the model file: preset}, expected speed-up note). A preset may be
# {sampler steps: preset, None: default}: the loader's preset then follows the steps of the sampler its model reaches
# (sampler_steps), so each sampler group of a template gets the preset made for its step count.
WORKFLOWS = {
    "image_flux1_dev_t2i": ("flux_dev_checkpoint_example", "Flux.1-dev text-to-image", {"": "flux"},
                            "At 1024² (4 608 tokens) attention is a small part of the step and min_tokens keeps it "
                            "dense; raise the resolution (2 MP and up) to see a speed-up."),
    "image_qwen_image_t2i": ("image_qwen_image", "Qwen-Image text-to-image", {"": "qwen_image"},
                             "At the template's 1328×1328 (83×83 = 6 889 image tokens plus the prompt's, about 7 000 "
                             "in all) every self-attention call is under min_tokens (8 192) and the node leaves "
                             "attention dense: below 8 192 tokens a sparse call is not faster than dense (the pack's "
                             "docs/benchmarks.md, \"Host overhead at 4 608 tokens\"). It starts to act once image "
                             "and prompt tokens reach 8 192, about 2 MP (e.g. 1472×1472: 8 464 image tokens); there "
                             "it runs block top-k at density 0.08 with three anchors and the residual weighted by the "
                             "mass (the lowest density that keeps >= 30 dB at 20-50 steps on the pack's quality "
                             "testbed)."),
    "video_wan2_1_t2v_1.3b": ("text_to_video_wan", "Wan 2.1 T2V 1.3B 480p", {"": "wan21_t2v_1.3b"},
                              "Block top-k at density 0.08 on every layer with the residual weighted by the mass, no "
                              "dense step, anchors at 0, 20 % and 53 % of the run: 31.4 dB at 30 steps on the pack's "
                              "quality testbed (docs/quality.md). A reuse call at 480p x 81 frames (32 760 tokens) "
                              "took about a fifth of a cuDNN dense call on an H200 (docs/benchmarks.md); the "
                              "template's 33 frames (14 040 tokens) gain less."),
    "video_wan2_2_14b_t2v": ("video_wan2_2_14B_t2v", "Wan 2.2 14B T2V (high- and low-noise models)",
                             {"high_noise": {4: "wan22_14b_4step", 8: "wan22_14b_8step", None: "wan22_14b_high_noise"},
                              "low_noise": {4: "wan22_14b_4step", 8: "wan22_14b_8step", None: "wan22_14b_low_noise"}},
                             "The enabled group (Lightx2v 4-step LoRA, 4 steps: high-noise sampler steps 0-2, "
                             "low-noise 2-4) patches both experts with **wan22_14b_4step**: anchors at step 0 and at "
                             "step 2 (the low-noise sampler's first step), reuse at steps 1 and 3 (37.4 dB on the "
                             "pack's quality testbed at 4 steps, projected 1.36x at Wan 14B 720p). The bypassed "
                             "20-step group (box-select it and press Ctrl+B to run it) patches the high-noise model "
                             "with **wan22_14b_high_noise** and the low-noise model with **wan22_14b_low_noise**: both "
                             "samplers count steps in the whole run, no dense step, anchors at steps 0, 4 and 10 "
                             "(10 is the low-noise sampler's first step; 32.9 dB on the testbed at 20 steps, "
                             "projected 2.09x). Changing a group's step count? Pick the matching preset "
                             "(wan22_14b_8step for a 4+4 split). At the template's 640×640×81 (33 600 tokens) every "
                             "self-attention call runs sparse except the first layer's (warmup_layers 1)."),
    "video_hunyuan_video_1.5_720p_t2v": ("video_hunyuan_video_1.5_720p_t2v", "HunyuanVideo 1.5 720p T2V",
                                         {"": "hunyuan_video_1.5"},
                                         "Block top-k at density 0.08 on both the 720p and the super-resolution "
                                         "model (the lowest density that keeps >= 30 dB at 20-50 steps on the pack's "
                                         "quality testbed); EasyCache stays in the chain."),
    "3d_hunyuan3d_2_image_to_model": ("3d_hunyuan3d_image_to_model", "Hunyuan3D 2.0 image-to-model",
                                      {"": "hunyuan3d_2"},
                                      "At the template's resolution 3072 the sequence is 3 072 latents plus 1 370 "
                                      "conditioning tokens = 4 442, under min_tokens (8 192): the node leaves "
                                      "attention dense, since below 8 192 tokens a sparse call is not faster than "
                                      "dense (the pack's docs/benchmarks.md, \"Host overhead at 4 608 tokens\"; "
                                      "sparse made the run 0.53-0.78x of dense at these sizes). It starts to act "
                                      "from resolution 6 822 (6 822 + 1 370 = 8 192 tokens), with one dense step and "
                                      "one anchor at step 1 (the 3-D setting of the MC-Sparse paper; not measured "
                                      "for quality)."),
    "video_minimax_h3_t2v": ("video_minimax_h3_t2v", "MiniMax H3 text-to-video with audio", {"": "minimax_h3"},
                             "The template samples 20 steps (preset minimax_h3); with its turbo_mode switch on "
                             "(8-step LoRA) pick minimax_h3_turbo_8step, with the 4-step LoRA "
                             "minimax_h3_turbo_4step. Video tokens take the density; text, audio rows and audio "
                             "keys of video queries follow the modality densities (docs/method.md). The preset "
                             "values are not yet measured on H3."),
}
# workflows whose template (and model) need a newer ComfyUI than 0.3.75: the minimum version
NEWER = {"video_minimax_h3_t2v": "0.33.0"}


def _graphs(doc):
    yield doc, False
    for sg in doc.get("definitions", {}).get("subgraphs", []):
        yield sg, True


def _max_ids(doc):
    nodes = links = 0
    for g, _ in _graphs(doc):
        nodes = max([nodes] + [int(n["id"]) for n in g.get("nodes", []) if str(n["id"]).lstrip("-").isdigit()])
        for ln in g.get("links", []):
            links = max(links, int(ln["id"] if isinstance(ln, dict) else ln[0]))
    return nodes, links


def _link_fields(ln):
    if isinstance(ln, dict):
        return ln["id"], ln["origin_id"], ln["origin_slot"], ln["target_id"], ln["target_slot"]
    return ln[0], ln[1], ln[2], ln[3], ln[4]


def _set_origin(ln, node_id, slot):
    if isinstance(ln, dict):
        ln["origin_id"], ln["origin_slot"] = node_id, slot
    else:
        ln[1], ln[2] = node_id, slot


# where a sampler (or scheduler) keeps its step count among its widget values
STEPS_WIDGET = {"KSampler": 2, "KSamplerAdvanced": 3, "BasicScheduler": 1}
TITLE_H = 30  # a node's title bar, drawn above its pos
GROUP_TITLE_H = 34  # a group's title bar, at the top of its bounding box
GAP = 10  # free space kept around an inserted node
NODE_SIZE = (320, 110)


def _xy(v, default=(0, 0)):
    v = default if v is None else v
    return list(v.values()) if isinstance(v, dict) else list(v)


def sampler_steps(g: dict, node_id) -> set[int]:
    """Step counts of the samplers (or schedulers) that node_id's MODEL output reaches, through any chain of
    MODEL-passing nodes (LoRAs, ModelSampling*, caches, reroutes), in graph g."""
    nodes = {n["id"]: n for n in g.get("nodes", [])}
    links = {_link_fields(ln)[0]: _link_fields(ln) for ln in g.get("links", [])}
    steps, seen, todo = set(), set(), [node_id]
    while todo:
        nid = todo.pop()
        if nid in seen or nid not in nodes:
            continue
        seen.add(nid)
        node = nodes[nid]
        if node["type"] in STEPS_WIDGET and nid != node_id:
            values = node.get("widgets_values") or []
            i = STEPS_WIDGET[node["type"]]
            if isinstance(values, list) and i < len(values) and isinstance(values[i], int):
                steps.add(values[i])
            continue
        for out in node.get("outputs", []):
            if out.get("type") in ("MODEL", "*"):
                todo += [links[lid][3] for lid in out.get("links") or [] if lid in links]
    return steps


def choose_preset(presets: dict, model_file: str, steps: set[int]) -> str | None:
    """The preset for a loader of model_file whose model reaches samplers of the given step counts."""
    preset = next((p for key, p in presets.items() if key and key in model_file), presets.get(""))
    if isinstance(preset, dict):
        preset = preset.get(next(iter(steps)) if len(steps) == 1 else None, preset.get(None))
    return preset


def _rect(pos, size, title=TITLE_H):
    x, y = _xy(pos)
    w, h = _xy(size, (200, 100))
    return x, y - title, x + w, y + h


def _hits(a, b):
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _inside(a, b):
    return b[0] <= a[0] and b[1] <= a[1] and a[2] <= b[2] and a[3] <= b[3]


def obstacles(g: dict, skip=()) -> list[tuple]:
    """Boxes (x0, y0, x1, y1) a new node must not cover in graph g: every node with its title bar, every group's
    title bar and a subgraph's input and output nodes."""
    boxes = [_rect(n.get("pos"), n.get("size")) for n in g.get("nodes", []) if n["id"] not in skip]
    for grp in g.get("groups", []):
        x, y, w, _ = grp["bounding"]
        boxes.append((x, y, x + w, y + GROUP_TITLE_H))
    for io in ("inputNode", "outputNode"):
        if isinstance(g.get(io), dict) and g[io].get("bounding"):
            x, y, w, h = g[io]["bounding"]
            boxes.append((x, y, x + w, y + h))
    return boxes


def free_position(g: dict, near: dict, size=NODE_SIZE, reach: int = 1600, step: int = 10) -> list[float]:
    """A position for a node of the given size near node ``near`` in graph g where it covers no node and no group
    title. Candidates on a grid around ``near`` are ranked: inside every group that holds ``near`` first (so that
    bypassing or moving the group takes the new node along), then inside its outermost group, then not straddling
    a group's border, then by distance to ``near`` (below, right, left, above on ties)."""
    boxes = obstacles(g)
    lo = _rect(near.get("pos"), near.get("size"))
    groups = [(gx, gy + GROUP_TITLE_H, gx + gw, gy + gh) for gx, gy, gw, gh in (grp["bounding"] for grp in
                                                                                g.get("groups", []))]
    holding = [b for b in groups if _inside(lo, b)]
    outer = max(holding, key=lambda b: (b[2] - b[0]) * (b[3] - b[1]), default=None)
    w, h = size
    x0, y0 = round(lo[0] / step) * step, round(lo[1] / step) * step
    cands = []
    for dx in range(-reach, reach + 1, step):
        for dy in range(-reach, reach + 1, step):
            x, y = x0 + dx, y0 + TITLE_H + dy
            r = (x, y - TITLE_H, x + w, y + h)
            gap_x = max(lo[0] - r[2], r[0] - lo[2], 0)
            gap_y = max(lo[1] - r[3], r[1] - lo[3], 0)
            side = 0 if r[1] >= lo[3] else 1 if r[0] >= lo[2] else 2 if r[2] <= lo[0] else 3
            key = (not all(_inside(r, b) for b in holding), outer is not None and not _inside(r, outer),
                   any(_hits(r, b) and not _inside(r, b) for b in groups if b not in holding),
                   round((gap_x ** 2 + gap_y ** 2) ** 0.5), side, abs(dx), abs(dy))
            cands.append((key, x, y, r))
    cands.sort(key=lambda c: c[0])
    for _, x, y, r in cands:
        padded = (r[0] - GAP, r[1] - GAP, r[2] + GAP, r[3] + GAP)
        if not any(_hits(padded, b) for b in boxes):
            return [x, y]
    raise SystemExit(f"no free place near node {near['id']}")


def insert_presets(doc: dict, presets: dict) -> list[str]:
    """Insert a preset node after every model loader; returns the presets used (in order)."""
    next_node, next_link = _max_ids(doc)
    used = []
    for g, is_sub in _graphs(doc):
        # top to bottom, so the upper loader takes the nearer free place
        for loader in sorted((n for n in g.get("nodes", []) if n["type"] in LOADERS),
                             key=lambda n: (_xy(n.get("pos"))[1], _xy(n.get("pos"))[0])):
            out_slot = next((i for i, o in enumerate(loader.get("outputs", [])) if o.get("type") == "MODEL"), None)
            if out_slot is None or not loader["outputs"][out_slot].get("links"):
                continue
            model_file = str((loader.get("widgets_values") or [""])[0]).lower()
            preset = choose_preset(presets, model_file, sampler_steps(g, loader["id"]))
            if preset is None:
                continue
            next_node += 1
            next_link += 1
            node_id, link_id = next_node, next_link
            old = list(loader["outputs"][out_slot]["links"])
            for ln in g["links"]:
                if _link_fields(ln)[0] in old:
                    _set_origin(ln, node_id, 0)
            node = {
                "id": node_id, "type": NODE, "pos": free_position(g, loader), "size": list(NODE_SIZE), "flags": {},
                "order": loader.get("order", 0) + 1, "mode": loader.get("mode", 0),
                "inputs": [{"name": "model", "type": "MODEL", "link": link_id}],
                "outputs": [{"name": "MODEL", "type": "MODEL", "links": old}],
                "properties": {"Node name for S&R": NODE, "cnr_id": "comfyui-sparse-attention", "ver": "0.1.0"},
                "widgets_values": [preset, 0.0],
            }
            g["nodes"].append(node)
            loader["outputs"][out_slot]["links"] = [link_id]
            new = ({"id": link_id, "origin_id": loader["id"], "origin_slot": out_slot, "target_id": node_id,
                    "target_slot": 0, "type": "MODEL"} if is_sub or (g["links"] and isinstance(g["links"][0], dict))
                   else [link_id, loader["id"], out_slot, node_id, 0, "MODEL"])
            g["links"].append(new)
            used.append(preset)
    doc["last_node_id"], doc["last_link_id"] = next_node, next_link
    for g, is_sub in _graphs(doc):
        if is_sub and isinstance(g.get("state"), dict):
            g["state"]["lastNodeId"], g["state"]["lastLinkId"] = next_node, next_link
    return used


def add_note(doc: dict, title: str, presets: list[str], expect: str) -> None:
    node_id = _max_ids(doc)[0] + 1
    doc["last_node_id"] = node_id
    text = (f"## Sparse Attention — {title}\n\n"
            f"The **Sparse Attention (Preset)** node after the model loader runs the model's long self-attention "
            f"sparsely with the preset{'s' if len(set(presets)) > 1 else ''} **{', '.join(dict.fromkeys(presets))}** "
            "(settings and their sources: the pack's `presets/` folder). Set `density_override` to trade speed "
            "for fidelity (0 keeps the preset), or replace the node by **Sparse Attention** to edit every "
            "setting. Add **Sparse Attention Report** after the sampler to see the density achieved and how close "
            f"anchor steps were to dense attention.\n\n**Expected:** {expect}\n\nWithout Triton (no NVIDIA GPU, or "
            "one older than Ampere) the same methods run on PyTorch: block_topk, the presets' method, still beats "
            "dense on long sequences (measured 4-4.6x on a CPU, 1.3-1.9x on a GPU); mc_sparse is slower than dense "
            "on a GPU there.")
    boxes = obstacles(doc)
    x = next(x for x in range(-700, -20000, -20)  # the usual place, or left of it until it covers nothing
             if not any(_hits((x - GAP, -700 - TITLE_H - GAP, x + 520 + GAP, -700 + 320 + GAP), b) for b in boxes))
    doc["nodes"].append({"id": node_id, "type": "MarkdownNote", "pos": [x, -700], "size": [520, 320], "flags": {},
                         "order": 0, "mode": 0, "inputs": [], "outputs": [], "title": "Sparse Attention",
                         "properties": {}, "widgets_values": [text]})


# A/B workflows: the template's sampler stays dense (image A); a copy of it runs the same seed on the patched model
# (image B); Sparse Attention Compare reports PSNR/SSIM and shows the difference. output name: (template, title,
# preset)
AB_WORKFLOWS = {
    "video_wan2_1_t2v_1.3b_ab_compare": ("text_to_video_wan", "Wan 2.1 T2V 1.3B: dense vs sparse (A/B)",
                                         "wan21_t2v_1.3b"),
}


class _Graph:
    """Editing helper for a top-level graph whose links are lists [id, origin, slot, target, slot, type]."""

    def __init__(self, doc):
        self.doc = doc
        self.nodes = {n["id"]: n for n in doc["nodes"]}
        self.next_node, self.next_link = _max_ids(doc)

    def origin(self, node, input_name):
        link = next(i["link"] for i in node["inputs"] if i["name"] == input_name)
        ln = next(x for x in self.doc["links"] if _link_fields(x)[0] == link)
        return _link_fields(ln)[1], _link_fields(ln)[2], ln[5]

    def connect(self, origin_id, origin_slot, target, target_slot, kind):
        self.next_link += 1
        self.doc["links"].append([self.next_link, origin_id, origin_slot, target["id"], target_slot, kind])
        self.nodes[origin_id]["outputs"][origin_slot].setdefault("links", []).append(self.next_link)
        target["inputs"][target_slot]["link"] = self.next_link

    def add(self, node):
        self.next_node += 1
        node["id"] = self.next_node
        self.doc["nodes"].append(node)
        self.nodes[node["id"]] = node
        return node


def build_ab(doc: dict, preset: str) -> None:
    """Turn a one-sampler template into a dense-vs-sparse A/B with a Sparse Attention Compare node."""
    g = _Graph(doc)
    sampler = next(n for n in doc["nodes"] if n["type"] == "KSampler")
    decode = next(n for n in doc["nodes"] if n["type"] == "VAEDecode"
                  and g.origin(n, "samples")[0] == sampler["id"])
    sampler["widgets_values"][1] = "fixed"  # the same seed for both runs
    model_from = g.origin(sampler, "model")
    x, y = sampler.get("pos", [0, 0]) if isinstance(sampler.get("pos"), list) else (0, 0)
    patch = g.add({"type": NODE, "pos": [x, y + 560], "size": [320, 110], "flags": {}, "order": 90, "mode": 0,
                   "inputs": [{"name": "model", "type": "MODEL", "link": None}],
                   "outputs": [{"name": "MODEL", "type": "MODEL", "links": []}],
                   "properties": {"Node name for S&R": NODE, "cnr_id": "comfyui-sparse-attention", "ver": "0.1.0"},
                   "widgets_values": [preset, 0.0], "title": "B: Sparse Attention (Preset)"})
    g.connect(model_from[0], model_from[1], patch, 0, "MODEL")
    twin = g.add(copy.deepcopy(sampler))
    twin.update(pos=[x + 360, y + 560], order=91, title="B: KSampler (sparse)")
    twin["outputs"][0]["links"] = []
    g.connect(patch["id"], 0, twin, 0, "MODEL")
    for slot, name in ((1, "positive"), (2, "negative"), (3, "latent_image")):
        o = g.origin(sampler, name)
        g.connect(o[0], o[1], twin, slot, o[2])
    sampler["title"] = "A: KSampler (dense)"
    dec2 = g.add(copy.deepcopy(decode))
    dec2.update(pos=[x + 720, y + 560], order=92, title="B: VAE Decode")
    dec2["outputs"][0]["links"] = []
    g.connect(twin["id"], 0, dec2, 0, "LATENT")
    vae = g.origin(decode, "vae")
    g.connect(vae[0], vae[1], dec2, 1, "VAE")
    cmp = g.add({"type": "SparseAttn_Compare", "pos": [x + 1060, y + 560], "size": [360, 120], "flags": {},
                 "order": 93, "mode": 0,
                 "inputs": [{"name": "image_a", "type": "IMAGE", "link": None},
                            {"name": "image_b", "type": "IMAGE", "link": None}],
                 "outputs": [{"name": "report", "type": "STRING", "links": []},
                             {"name": "difference", "type": "IMAGE", "links": []}],
                 "properties": {"Node name for S&R": "SparseAttn_Compare", "cnr_id": "comfyui-sparse-attention",
                                "ver": "0.1.0"},
                 "widgets_values": [4.0]})
    g.connect(decode["id"], 0, cmp, 0, "IMAGE")
    g.connect(dec2["id"], 0, cmp, 1, "IMAGE")
    preview = g.add({"type": "PreviewImage", "pos": [x + 1460, y + 560], "size": [320, 280], "flags": {},
                     "order": 94, "mode": 0, "inputs": [{"name": "images", "type": "IMAGE", "link": None}],
                     "outputs": [], "properties": {"Node name for S&R": "PreviewImage"}, "widgets_values": []})
    g.connect(cmp["id"], 1, preview, 0, "IMAGE")
    doc["last_node_id"], doc["last_link_id"] = g.next_node, g.next_link
    node_id = g.next_node + 1
    doc["last_node_id"] = node_id
    doc["nodes"].append({
        "id": node_id, "type": "MarkdownNote", "pos": [-700, -700], "size": [520, 300], "flags": {}, "order": 0,
        "mode": 0, "inputs": [], "outputs": [], "title": "Sparse Attention A/B", "properties": {},
        "widgets_values": [
            "## Dense vs sparse on your own model\n\nSampler **A** runs the model as it is; sampler **B** runs the "
            f"same seed with **Sparse Attention (Preset)** ({preset}). **Sparse Attention Compare** reports PSNR and "
            "SSIM of B against A (mean and worst frame) and shows |A - B|. Above ~35 dB differences are hard to "
            "see; below ~30 dB try a higher density, more anchors or the preset's quality variant. The quality "
            "testbed's numbers for each preset are in the pack's docs/quality.md."]})


def thumbnail(path: Path, title: str) -> None:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (512, 384), (22, 26, 38))
    draw = ImageDraw.Draw(img)
    for i in range(0, 512, 16):  # a block-sparse pattern as the motif
        for j in range(0, 256, 16):
            if abs(i - 2 * j) < 48 or (i // 16) % 11 == 0 or (j // 16) % 9 == 0:
                draw.rectangle([i, 96 + j // 2, i + 13, 96 + j // 2 + 5], fill=(70, 130, 230))
    draw.text((20, 24), "Sparse Attention", fill=(240, 240, 240))
    draw.text((20, 48), title, fill=(180, 200, 255))
    img.save(path, "JPEG", quality=85)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--templates", help="folder of template JSONs (default: the installed package)")
    ap.add_argument("--out", default=str(ROOT / "workflows"))
    ap.add_argument("--only", nargs="*", help="build only these workflows (names as in WORKFLOWS)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    src = (Path(args.templates) if args.templates
           else Path(str(importlib.resources.files("comfyui_workflow_templates_json") / "templates")))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    skipped = []
    for name, (template, title, presets, expect) in WORKFLOWS.items():
        if args.only and name not in args.only:
            continue
        if not (src / f"{template}.json").is_file():  # a template of a newer release: build it from its templates
            log.warning("%s: no template %s.json in %s (it needs ComfyUI %s's templates: run again with --templates "
                        "of that release and --only %s)", name, template, src, NEWER.get(name, "another"), name)
            skipped.append(name)
            continue
        doc = copy.deepcopy(json.loads((src / f"{template}.json").read_text(encoding="utf-8")))
        if name in NEWER:
            doc.setdefault("extra", {})["sparse_attention_min_comfyui"] = NEWER[name]
        used = insert_presets(doc, presets)
        if not used:
            raise SystemExit(f"{template}: no model loader found to patch")
        add_note(doc, title, used, expect)
        (out / f"{name}.json").write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        thumbnail(out / f"{name}.jpg", title)
        log.info("%s <- %s: presets %s", name, template, used)
    for name, (template, title, preset) in AB_WORKFLOWS.items():
        if args.only and name not in args.only:
            continue
        doc = copy.deepcopy(json.loads((src / f"{template}.json").read_text(encoding="utf-8")))
        build_ab(doc, preset)
        (out / f"{name}.json").write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        thumbnail(out / f"{name}.jpg", title)
        log.info("%s <- %s: A/B with preset %s", name, template, preset)
    if skipped:
        raise SystemExit(f"not built (no template here): {', '.join(skipped)}")


if __name__ == "__main__":
    main()
