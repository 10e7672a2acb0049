"""Bundled workflows: parse, every node exists in the node definitions of the ComfyUI tree under test
(generated from that tree by tests/node_defs.py, our pack included), widget values fit, links are
consistent, our node is on every model."""

import json

import pytest
from conftest import ROOT, comfyui_path, comfyui_version, workflow_needs
from node_defs import generate
from workflow_check import check_workflow

WORKFLOWS = sorted((ROOT / "workflows").glob("*.json"))
OURS = frozenset({"SparseAttn_Patch", "SparseAttn_Preset", "SparseAttn_Report", "SparseAttn_Compare"})


@pytest.fixture(scope="module")
def node_defs(tmp_path_factory):
    defs, report = generate(comfyui_path(), tmp_path_factory.mktemp("object-info"))
    assert OURS <= set(defs), f"our nodes are missing from /object_info: {report}"
    assert "KSampler" in defs and "UNETLoader" in defs, report
    return defs


def test_the_required_workflows_are_bundled():
    names = {p.stem for p in WORKFLOWS}
    assert {"image_flux1_dev_t2i", "image_qwen_image_t2i", "video_wan2_1_t2v_1.3b", "video_wan2_2_14b_t2v",
            "video_wan2_1_t2v_1.3b_ab_compare",
            "video_hunyuan_video_1.5_720p_t2v", "3d_hunyuan3d_2_image_to_model", "video_minimax_h3_t2v"} <= names
    for p in WORKFLOWS:
        assert p.with_suffix(".jpg").is_file(), f"{p.name} has no thumbnail"
        assert p.with_suffix(".jpg").read_bytes()[:2] == b"\xff\xd8"


@pytest.mark.comfyui
@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_workflow_is_valid(path, node_defs):
    doc = json.loads(path.read_text())
    if comfyui_version() < workflow_needs(doc):
        pytest.skip(f"{path.name} needs ComfyUI {'.'.join(map(str, workflow_needs(doc)))} (its model's nodes)")
    assert doc.get("version") == 0.4
    assert check_workflow(doc, node_defs, OURS) == []
    all_nodes = [n for g in [doc] + doc.get("definitions", {}).get("subgraphs", []) for n in g["nodes"]]
    ours = [n for n in all_nodes if n["type"] == "SparseAttn_Preset"]
    loader_types = ("UNETLoader", "CheckpointLoaderSimple", "ImageOnlyCheckpointLoader")
    loaders = [n for n in all_nodes if n["type"] in loader_types]
    assert ours and len(ours) == len(loaders)
    assert any(n["type"] == "MarkdownNote" and "Sparse Attention" in n["widgets_values"][0] for n in all_nodes)


@pytest.mark.comfyui
def test_checker_catches_broken_workflows(node_defs):
    doc = json.loads((ROOT / "workflows" / "video_wan2_1_t2v_1.3b.json").read_text())
    bad = json.loads(json.dumps(doc))
    ours = next(n for n in bad["nodes"] if n["type"] == "SparseAttn_Preset")
    ours["widgets_values"] = ["no_such_preset", 5.0]
    bad["nodes"].append({"id": 999, "type": "NoSuchNodeXYZ", "inputs": [], "outputs": []})
    bad["links"][0][1] = 12345
    errors = check_workflow(bad, node_defs, OURS)
    ours["widgets_values"] = ["flux"]
    assert any("missing widget value for density_override" in e for e in check_workflow(bad, node_defs, OURS))
    assert any("no_such_preset" in e for e in errors)
    assert any("density_override=5.0 > max" in e for e in errors)
    assert any("NoSuchNodeXYZ" in e for e in errors)
    assert any("missing node 12345" in e for e in errors)


def test_the_ab_workflow_compares_a_dense_and_a_sparse_run_of_one_seed():
    doc = json.loads((ROOT / "workflows" / "video_wan2_1_t2v_1.3b_ab_compare.json").read_text())
    nodes = {n["id"]: n for n in doc["nodes"]}
    links = {ln[0]: ln for ln in doc["links"]}

    def source(node, name):
        link = next(i["link"] for i in node["inputs"] if i["name"] == name)
        return nodes[links[link][1]]
    cmp = next(n for n in doc["nodes"] if n["type"] == "SparseAttn_Compare")
    a, b = source(source(cmp, "image_a"), "samples"), source(source(cmp, "image_b"), "samples")
    assert a["type"] == b["type"] == "KSampler" and a["id"] != b["id"]
    assert a["widgets_values"][:3] == b["widgets_values"][:3] and a["widgets_values"][1] == "fixed"  # same seed
    assert source(b, "model")["type"] == "SparseAttn_Preset" and source(a, "model")["type"] != "SparseAttn_Preset"
    assert source(source(b, "model"), "model")["id"] == source(a, "model")["id"]  # B = A's model, patched
    for name in ("positive", "negative", "latent_image"):
        assert source(a, name)["id"] == source(b, name)["id"]


TITLE_H, GROUP_TITLE_H = 30, 34  # litegraph: a node's title bar above its pos; a group's title bar at its top
LOADER_TYPES = ("UNETLoader", "CheckpointLoaderSimple", "ImageOnlyCheckpointLoader")


def _graphs(doc):
    return [doc] + doc.get("definitions", {}).get("subgraphs", [])


def _xy(v):
    return list(v.values()) if isinstance(v, dict) else list(v)


def _box(node):
    (x, y), (w, h) = _xy(node["pos"]), _xy(node.get("size", [200, 100]))
    return x, y - TITLE_H, x + w, y + h


def _hits(a, b):
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _inserted(node):
    return node["type"] in OURS or (node["type"] == "MarkdownNote" and node.get("title", "").startswith(
        "Sparse Attention"))


def _links(g):
    return {(ln["id"] if isinstance(ln, dict) else ln[0]):
            ((ln["origin_id"], ln["target_id"]) if isinstance(ln, dict) else (ln[1], ln[3])) for ln in g["links"]}


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_inserted_nodes_cover_no_other_node_and_no_group_title(path):
    doc = json.loads(path.read_text())
    for g in _graphs(doc):
        ours = [n for n in g["nodes"] if _inserted(n)]
        for n in ours:
            for m in g["nodes"]:
                assert m is n or not _hits(_box(n), _box(m)), f"{path.name}: {n['type']} #{n['id']} covers " \
                                                              f"{m['type']} #{m['id']}"
            for grp in g.get("groups", []):
                x, y, w, _ = grp["bounding"]
                assert not _hits(_box(n), (x, y, x + w, y + GROUP_TITLE_H)), \
                    f"{path.name}: {n['type']} #{n['id']} covers the title of group {grp['title']!r}"
        if path.stem != "video_wan2_1_t2v_1.3b_ab_compare":  # a preset node sits next to the loader it follows
            nodes, links = {n["id"]: n for n in g["nodes"]}, _links(g)
            for n in ours:
                if n["type"] == "SparseAttn_Preset":
                    a, b = _box(n), _box(nodes[links[n["inputs"][0]["link"]][0]])
                    assert max(a[0] - b[2], b[0] - a[2], a[1] - b[3], b[1] - a[3]) < 1200


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_preset_nodes_take_the_mode_of_the_node_they_follow(path):
    doc = json.loads(path.read_text())
    for g in _graphs(doc):
        nodes, links = {n["id"]: n for n in g["nodes"]}, _links(g)
        for n in g["nodes"]:
            if n["type"] == "SparseAttn_Preset":
                source = nodes[links[n["inputs"][0]["link"]][0]]
                assert n.get("mode", 0) == source.get("mode", 0), f"{path.name}: #{n['id']} after #{source['id']}"


def test_bypassed_groups_keep_their_preset_nodes_bypassed():
    for name, bypassed in (("video_wan2_2_14b_t2v", 2), ("video_hunyuan_video_1.5_720p_t2v", 1)):
        doc = json.loads((ROOT / "workflows" / f"{name}.json").read_text())
        modes = [n.get("mode", 0) for n in doc["nodes"] if n["type"] == "SparseAttn_Preset"]
        assert modes.count(4) == bypassed and modes.count(0) == len(modes) - bypassed, (name, modes)


def test_wan22_presets_fit_the_step_count_of_each_sampler_group():
    """The 4-step LoRA group gets the 4-step preset, the 20-step group the experts' presets, and in both every
    sampler has a reuse step (a 20-step preset at 4 steps anchors steps 0, 1 and 2: the high-noise sampler never
    reuses)."""
    from comfyui_sparse_attention.engine.presets import load_preset
    from comfyui_sparse_attention.engine.schedule import resolve_warmup

    doc = json.loads((ROOT / "workflows" / "video_wan2_2_14b_t2v.json").read_text())
    nodes, links = {n["id"]: n for n in doc["nodes"]}, _links(doc)

    def samplers(node_id, seen=()):
        node = nodes[node_id]
        if node["type"] == "KSamplerAdvanced":
            return [node]
        return [s for o in node.get("outputs", []) if o["type"] == "MODEL" for lid in o.get("links") or []
                for s in samplers(links[lid][1], seen + (node_id,))]

    seen = {}
    for n in (n for n in doc["nodes"] if n["type"] == "SparseAttn_Preset"):
        preset = n["widgets_values"][0]
        model = nodes[links[n["inputs"][0]["link"]][0]]["widgets_values"][0]
        (sampler,) = samplers(n["id"])
        total, start, end = (sampler["widgets_values"][i] for i in (3, 7, 8))
        expert = "high_noise" if "high_noise" in model else "low_noise"
        assert preset == {4: "wan22_14b_4step", 20: f"wan22_14b_{expert}"}[total], (model, total, preset)
        cfg = load_preset(preset)
        warmup = resolve_warmup(cfg.warmup_steps, total)
        steps = range(max(start, warmup), min(end, total))
        reuse = [s for s in steps if s != steps[0] and not cfg.anchor_steps.is_anchor(s, warmup, total)]
        assert reuse, f"{preset} on the {expert} expert at steps {start}-{end} of {total} never reuses"
        seen[(total, expert)] = (n.get("mode", 0), reuse)
    assert seen == {(4, "high_noise"): (0, [1]), (4, "low_noise"): (0, [3]),
                    (20, "high_noise"): (4, [1, 2, 3, 5, 6, 7, 8, 9]),
                    (20, "low_noise"): (4, [11, 12, 13, 14, 15, 16, 17, 18, 19])}


@pytest.mark.parametrize("name, template_tokens", [("image_qwen_image_t2i", "6 889 image tokens"),
                                                   ("3d_hunyuan3d_2_image_to_model", "4 442")])
def test_notes_say_when_the_template_size_stays_dense(name, template_tokens):
    doc = json.loads((ROOT / "workflows" / f"{name}.json").read_text())
    note = next(n["widgets_values"][0] for n in doc["nodes"] if _inserted(n) and n["type"] == "MarkdownNote")
    assert template_tokens in note and "leaves attention dense" in note and "starts to act" in note
