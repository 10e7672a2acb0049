"""The Record and Calibrate nodes inside a real ComfyUI (needs COMFYUI_PATH): a tiny Wan sampled with
comfy.sample.sample (euler, CFG 3) while recording, the file read back and calibrated, the calibrated densities
run by the Sparse Attention node; the size cap, a sparse-patched model and another model's recording refused."""

import pytest
from comfy_subprocess import run_in_comfyui
from conftest import ROOT, comfyui_path

pytestmark = pytest.mark.comfyui

BODY = """
import os, sys, torch
sys.path.insert(0, {tests!r})
import comfy_child as C
pack = C.load_pack()
import folder_paths
folder_paths.set_output_directory({out!r})
from comfyui_sparse_attention.nodes.nodes_calibrate import SparseAttentionRecord, SparseAttentionCalibrate
from comfyui_sparse_attention.nodes.nodes_sparse import SparseAttention
from comfyui_sparse_attention.nodes.patch import install, find_patch
from comfyui_sparse_attention.engine import SparseConfig
from comfyui_sparse_attention.engine.recording import load_recording
from safetensors import safe_open
r = {{}}

def result(node_out):
    return node_out.result if hasattr(node_out, "result") else node_out

model, _, pos, neg = C.build("wan")
latent = torch.randn(1, 16, 3, 32, 32, generator=torch.Generator().manual_seed(5))  # 3 x 16 x 16 = 768 tokens
base = C.sample(model, latent, pos, neg, steps=4)
rec_model, path = result(SparseAttentionRecord.execute(model, "", "0, 1, 3", 64.0, "calib/qkv"))
r["path_before"] = os.path.exists(path)
out = C.sample(rec_model, latent, pos, neg, steps=4)
r["recording_is_dense"] = C.rel(out, base)
r["path"] = os.path.relpath(path, {out!r})
rec = load_recording(path)
r["layers"], r["steps"], r["heads"] = list(rec.layers), list(rec.steps), rec.heads
r["tokens"] = rec.tokens
r["family"], r["total_steps"] = rec.family, rec.total_steps
r["grid"] = list(rec.layouts[0].grid)
with safe_open(path, framework="pt") as f:
    t = f.get_tensor("layer01.step03.k")
    r["dtype"], r["shape"] = str(t.dtype), list(t.shape)
    meta = f.metadata()
r["meta_keys"] = sorted(meta)
# the recorded q/k/v are what the attention received: recompute layer 0's attention output at step 0 through
# a recording override of the model's own call and compare
from comfyui_sparse_attention.nodes.call import translate
seen = {{}}
def spy(func, *args, **kwargs):
    if "q" not in seen:
        seen["q"] = translate(args, kwargs).q[0].detach().clone()  # (H, N, D) of the first call: layer 0, step 0
    return func(*args, **kwargs)
spied = model.clone()
spied.model_options.setdefault("transformer_options", {{}})["optimized_attention_override"] = spy
C.sample(spied, latent, pos, neg, steps=4)
q0 = seen["q"]
rq = rec.qkv(0, 0)[0][0].float()
r["q_match"] = C.rel(rq, q0)

# calibrate the recording for this model, then run the densities with the Sparse Attention node
dens, preset, report, plot = result(SparseAttentionCalibrate.execute(r["path"], "mc_sparse", 0.3, "64", True, "",
                                                                     "calib/cal", None, rec_model))
r["layer_densities"] = dens
r["preset_exists"] = os.path.exists(preset)
r["report_head"] = report.splitlines()[0]
r["plot_shape"] = list(plot.shape)
cfg = SparseConfig.from_yaml(preset)
r["preset_method"], r["preset_density"] = cfg.method, cfg.density
r["preset_factors"] = [list(f) if isinstance(f, tuple) else f for _, f in cfg.layer_densities]
# the written preset keeps its base preset's schedule (default "balanced"), or the engine's with "none"
from comfyui_sparse_attention.engine.presets import load_preset
r["preset_anchors"] = cfg.anchor_steps.text()
r["balanced_anchors"] = load_preset("balanced").anchor_steps.text()
_, preset_n, _, _ = result(SparseAttentionCalibrate.execute(r["path"], "mc_sparse", 0.3, "64", True, "",
                                                            "calib/none", None, rec_model,
                                                            base_preset="none (engine defaults)"))
r["none_anchors"] = SparseConfig.from_yaml(preset_n).anchor_steps.text()
r["default_anchors"] = SparseConfig().anchor_steps.text()
def calibrate_error(prefix, **kw):
    try:
        SparseAttentionCalibrate.execute(r["path"], "mc_sparse", 0.3, "64", True, "", prefix, None, rec_model, **kw)
        return "no error"
    except ValueError as exc:
        return str(exc)
r["bad_base"] = calibrate_error("calib/b", base_preset="../secret")
# scope "layer": every layer keeps its share, only its heads trade density (at 0.25: whether two heads of this
# random model gain from a trade depends on the density; at 0.3 and 0.15 neither layer's heads do)
_, preset_l, report_l, _ = result(SparseAttentionCalibrate.execute(r["path"], "mc_sparse", 0.25, "64", True, "",
                                                                   "calib/layer", None, rec_model, scope="layer"))
r["layer_scope_factors"] = [list(f) if isinstance(f, tuple) else f
                            for _, f in SparseConfig.from_yaml(preset_l).layer_densities]
r["layer_scope_in_report"] = "scope layer" in report_l
r["bad_scope"] = calibrate_error("calib/bad", scope="everywhere")
node = result(SparseAttention.execute(model, "mc_sparse", 0.3, "64", "64", 0, 0, "", "", True, True, 0, "torch",
                                      dens))[0]
o = C.sample(node, latent, pos, neg, steps=4)
p = find_patch(node)
r["sparse_finite"] = bool(torch.isfinite(o).all())
r["sparse_layer_densities"] = [list(f) if isinstance(f, tuple) else f for _, f in p.cfg.layer_densities]
r["sparse_stats_layers"] = sorted(p.last_stats.layers)
r["sparse_layer_density"] = {{str(i): s.density for i, s in p.last_stats.layers.items()}}

# the size cap: a plan past max_mb stops sampling before anything is written
small, small_path = result(SparseAttentionRecord.execute(model, "", "0, 1, 3", 1.5, "calib/small"))
try:
    C.sample(small, latent, pos, neg, steps=4)
    r["cap"] = "no error"
except Exception as exc:
    r["cap"] = f"{{type(exc).__name__}}: {{exc}}"
r["cap_file"] = os.path.exists(small_path) or os.path.exists(small_path + ".partial")

# a recording under a Sparse Attention patch is refused, in either order
sparse, _ = install(model, SparseConfig(method="block_topk", min_tokens=0, block_q=64, block_k=64, backend="torch"))
try:
    SparseAttentionRecord.execute(sparse, "", "0", 64.0, "calib/x")
    r["refuse_after"] = "no error"
except ValueError as exc:
    r["refuse_after"] = str(exc)
late, _ = result(SparseAttentionRecord.execute(model, "", "0", 64.0, "calib/y"))
late_sparse, _ = install(late, SparseConfig(method="block_topk", min_tokens=0, block_q=64, block_k=64,
                                            backend="torch"))
try:
    C.sample(late_sparse, latent, pos, neg, steps=4)
    r["refuse_before"] = "no error"
except Exception as exc:
    r["refuse_before"] = str(exc)

# a recording of another model is refused when the model is connected
other, *_ = C.build("flux")
try:
    SparseAttentionCalibrate.execute(path, "mc_sparse", 0.3, "64", True, "", "calib/z", None, other)
    r["other_model"] = "no error"
except ValueError as exc:
    r["other_model"] = str(exc)
r["validate_bad"] = SparseAttentionRecord.validate_inputs(layers="x-y", steps="0")
r["validate_bad_steps"] = SparseAttentionRecord.validate_inputs(layers="", steps="")
r["calibrate_validate"] = [SparseAttentionCalibrate.validate_inputs(anchor_steps=a) for a in ("10%", "3, 10", "")]
emit(r)
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("comfy-output")
    return run_in_comfyui(comfyui_path(), BODY.format(tests=str(ROOT / "tests"), out=str(out)), timeout=900)


def test_record_round_trip(results):
    r = results
    assert r["path_before"] is False  # written when sampling ends
    assert r["recording_is_dense"] == 0.0  # recording changes nothing
    assert r["path"].startswith("calib/qkv_") and r["path"].endswith("_.safetensors")
    assert r["layers"] == [0, 1] and r["steps"] == [0, 1, 3] and r["heads"] == 2
    assert r["tokens"] == {"0": 768, "1": 768}
    assert r["family"] == "wan" and r["total_steps"] == 4 and r["grid"] == [3, 16, 16]
    assert r["dtype"] == "torch.float16" and r["shape"] == [2, 768, 64]
    assert {"format", "layouts", "family", "model", "model_signature", "steps", "total_steps", "dtype"} <= set(
        r["meta_keys"])
    assert r["q_match"] < 1e-3  # fp16 of exactly what the override received


def test_calibrate_node_scope_layer_keeps_each_layers_share(results):
    r = results
    assert r["layer_scope_in_report"]
    factors = r["layer_scope_factors"]
    assert any(isinstance(f, list) for f in factors), factors  # some layer's heads traded density
    for f in factors:  # per layer: the heads' mean is the layer's unchanged share
        f = f if isinstance(f, list) else [f]
        assert abs(sum(f) / len(f) - 1.0) < 0.05, factors
    assert "scope" in r["bad_scope"] and "everywhere" in r["bad_scope"]


def test_calibrate_node_feeds_the_sparse_attention_node(results):
    r = results
    assert r["preset_exists"] and r["report_head"] == "# Density calibration"
    assert r["plot_shape"][0] == 1 and r["plot_shape"][-1] == 3
    assert r["preset_method"] == "mc_sparse" and r["preset_density"] == 0.3
    # the base preset's schedule, so the preset copied into presets/ runs as measured
    assert r["preset_anchors"] == r["balanced_anchors"] != r["default_anchors"]
    assert r["none_anchors"] == r["default_anchors"]
    assert "base_preset" in r["bad_base"] and "../secret" in r["bad_base"]
    flat = [x for f in r["preset_factors"] for x in (f if isinstance(f, list) else [f, f])]
    # the density set stays the average (the allocation holds the computed pairs equal, so up to group rounding)
    assert sum(flat) / len(flat) == pytest.approx(1.0, abs=0.02)
    assert r["sparse_layer_densities"] == r["preset_factors"]
    assert r["sparse_finite"] and r["sparse_stats_layers"] == [0, 1]
    mean = lambda f: sum(f) / len(f) if isinstance(f, list) else f  # noqa: E731
    d0, d1 = (r["sparse_layer_density"][str(i)] for i in (0, 1))
    if mean(r["preset_factors"][0]) != mean(r["preset_factors"][1]):  # the denser layer computes more pairs
        assert (d0 > d1) == (mean(r["preset_factors"][0]) > mean(r["preset_factors"][1]))


def test_size_cap_and_refusals(results):
    r = results
    # one layer and step fits (0.59 MB), the plan (2 layers x 3 steps) does not: refused after the first forward
    assert "RecordingTooLarge" in r["cap"] and "2 layer(s) x 3 step(s)" in r["cap"] and "max_mb" in r["cap"], r["cap"]
    assert r["cap_file"] is False
    assert "Sparse Attention patch" in r["refuse_after"]
    assert "Sparse Attention patch" in r["refuse_before"]
    assert "qkv_" in r["other_model"] and "another model" in r["other_model"]
    assert "layers" in r["validate_bad"]
    assert "steps" in r["validate_bad_steps"]
    bad, ok, empty = r["calibrate_validate"]
    assert "anchor_steps" in bad and "10%" in bad and ok is True and empty is True
