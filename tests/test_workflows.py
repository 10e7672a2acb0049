"""Bundled workflows: parse, every node exists in ComfyUI 0.33.0's node definitions (shared/comfyui/
object_info.json) plus ours, widget values fit, links are consistent, our node is on every model."""

import json
import os
from pathlib import Path

import pytest
from comfy_subprocess import run_in_comfyui
from conftest import ROOT, comfyui_path
from workflow_check import check_workflow

WORKFLOWS = sorted((ROOT / "workflows").glob("*.json"))
OURS = frozenset({"SparseAttn_Patch", "SparseAttn_Preset", "SparseAttn_Report"})
OBJECT_INFO = Path(os.environ.get("COMFYUI_OBJECT_INFO", ROOT.parent / "shared" / "comfyui" / "object_info.json"))


@pytest.fixture(scope="module")
def node_defs():
    if not OBJECT_INFO.is_file():
        pytest.skip(f"!!! no ComfyUI node definitions at {OBJECT_INFO} (set COMFYUI_OBJECT_INFO) !!!")
    if comfyui_path() is None:
        pytest.skip("!!! COMFYUI_PATH is not set: our nodes' definitions come from ComfyUI's V3 schema !!!")
    defs = json.loads(OBJECT_INFO.read_text())
    ours = run_in_comfyui(comfyui_path(), f"""
        import sys
        sys.path.insert(0, {str(ROOT / "tests")!r})
        import comfy_child as C
        C.load_pack()
        from comfyui_sparse_attention.nodes.registry import NODE_CLASS_MAPPINGS
        emit({{k: v.GET_NODE_INFO_V1() for k, v in NODE_CLASS_MAPPINGS.items()}})
    """)
    defs.update(ours)
    return defs


def test_the_required_workflows_are_bundled():
    names = {p.stem for p in WORKFLOWS}
    assert {"image_flux1_dev_t2i", "image_qwen_image_t2i", "video_wan2_1_t2v_1.3b", "video_wan2_2_14b_t2v",
            "video_hunyuan_video_1.5_720p_t2v", "3d_hunyuan3d_2_image_to_model"} <= names
    for p in WORKFLOWS:
        assert p.with_suffix(".jpg").is_file(), f"{p.name} has no thumbnail"
        assert p.with_suffix(".jpg").read_bytes()[:2] == b"\xff\xd8"


@pytest.mark.comfyui
@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_workflow_is_valid(path, node_defs):
    doc = json.loads(path.read_text())
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
