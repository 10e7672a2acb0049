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
