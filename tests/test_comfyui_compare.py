"""The Compare node inside ComfyUI: schema, validation, execution on IMAGE batches."""

import pytest
from comfy_subprocess import run_in_comfyui
from conftest import ROOT, comfyui_path

pytestmark = pytest.mark.comfyui


def test_compare_node_reports_psnr_and_the_difference():
    r = run_in_comfyui(comfyui_path(), f"""
        import sys, torch
        sys.path.insert(0, {str(ROOT / "tests")!r})
        import comfy_child as C
        C.load_pack()
        from comfyui_sparse_attention.nodes.nodes_compare import SparseAttentionCompare as N
        a = torch.rand(4, 24, 32, 3, generator=torch.Generator().manual_seed(0))
        b = (a + 0.05).clamp(0, 1)
        out = N.execute(a, b, 4.0)
        text, diff = out.result
        schema = N.GET_SCHEMA()
        try:
            N.execute(a, b[:2], 4.0)
            err = None
        except ValueError as exc:
            err = str(exc)
        emit(dict(text=text, diff=list(diff.shape), dmax=float(diff.max()), ui=bool(out.ui),
                  inputs=[i.id for i in schema.inputs], bad=N.validate_inputs(amplify=0.0),
                  big=N.validate_inputs(amplify=500.0), ok=N.validate_inputs(amplify=4.0), err=err))
    """)
    assert r["text"].startswith("PSNR") and "SSIM" in r["text"] and r["ui"]
    assert r["diff"] == [4, 24, 32, 3] and 0.1 < r["dmax"] <= 1.0
    assert r["inputs"] == ["image_a", "image_b", "amplify"]
    assert "amplify" in r["bad"] and "amplify" in r["big"] and r["ok"] is True and "differ in shape" in r["err"]
