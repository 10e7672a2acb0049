"""The nodes and the patch inside a real ComfyUI (needs COMFYUI_PATH): tiny random-weight models of each
family built through ComfyUI's classes (Wan, Flux, SD3, Qwen-Image, HunyuanVideo, LTX-Video, Hunyuan3D 2.0
and 2.1), sampled with comfy.sample.sample (euler, CFG 3)."""

import pytest
from comfy_subprocess import run_in_comfyui
from conftest import ROOT, comfyui_path

pytestmark = pytest.mark.comfyui
FAMILIES = ("wan", "flux", "sd3", "qwen_image", "hunyuan_video", "ltxv", "hunyuan3d", "hunyuan3d_2_1")

BODY = """
import sys, torch
sys.path.insert(0, {tests!r})
import comfy_child as C
pack = C.load_pack()
from comfyui_sparse_attention.nodes.patch import install, find_patch
from comfyui_sparse_attention.engine import SparseConfig
results = {{}}
for family in {families!r}:
    model, latent, pos, neg = C.build(family)
    base = C.sample(model, latent, pos, neg)
    r = {{}}
    # density 1 through the full machinery: equals the unpatched model
    full, patch = install(model, SparseConfig(method="mc_sparse", density=1.0, min_tokens=0, group_size=64,
                                              block_q=64, block_k=64, backend="torch"))
    out1 = C.sample(full, latent, pos, neg)
    t = patch.last_stats.totals()
    r["dense_equal_rel"] = C.rel(out1, base)
    r["calls"] = t["calls"]; r["anchors"] = t["anchors"]; r["reuses"] = t["reuses"]
    r["fallbacks"] = dict(patch.fallbacks)
    r["layers"] = sorted(patch.last_stats.layers)
    # low density: finite, statistics report the configured density
    low, lp = install(model, SparseConfig(method="mc_sparse", density=0.25, min_tokens=0, group_size=64,
                                          block_q=64, block_k=64, backend="torch"))
    o = C.sample(low, latent, pos, neg)
    r["low_finite"] = bool(torch.isfinite(o).all())
    r["low_rel"] = C.rel(o, base)
    r["low_density"] = sum(x.density for x in lp.last_stats.layers.values()) / len(lp.last_stats.layers)
    # a second run gives identical results and leaves no cache memory behind
    o2 = C.sample(low, latent, pos, neg)
    r["repeat_equal"] = bool(torch.equal(o, o2))
    r["cache_after"] = lp.cache_bytes()
    r["runs"] = lp.runs
    # chaining: a recording override installed first handles every dense call
    seen = []
    chained = model.clone()
    chained_opts = chained.model_options.setdefault("transformer_options", {{}})
    chained_opts["optimized_attention_override"] = C.recording_override(seen)
    ch, cp = install(chained, SparseConfig(method="block_topk", density=0.5, min_tokens=0, block_q=64, block_k=64,
                                           warmup_steps=1, backend="torch"))
    oc = C.sample(ch, latent, pos, neg)
    r["chain_calls"] = len(seen)
    r["chain_dense_calls"] = cp.last_stats.totals()["dense"] + sum(cp.fallbacks.values())
    r["chain_finite"] = bool(torch.isfinite(oc).all())
    # removing our node restores the model: the unpatched patcher is untouched
    r["original_untouched"] = find_patch(model) is None
    r["original_equal"] = bool(torch.equal(C.sample(model, latent, pos, neg), base))
    # the nodes themselves
    from comfyui_sparse_attention.nodes.nodes_sparse import (SparseAttention, SparseAttentionPreset,
                                                             SparseAttentionReport)
    node_out = SparseAttention.execute(model, "mc_sparse", 0.3, "64", "64", 1, 0, "", "2", True, True, 0, "torch")
    nm = node_out.result[0] if hasattr(node_out, "result") else node_out[0]
    samples = C.sample(nm, latent, pos, neg)
    rep = SparseAttentionReport.execute(nm, {{"samples": samples}}, -1)
    rep = rep.result if hasattr(rep, "result") else rep
    r["report_text"] = rep[0][:300]
    r["report_image"] = list(rep[1].shape)
    r["validate_bad"] = SparseAttention.validate_inputs(anchor_steps="ten")
    r["preset_ok"] = SparseAttentionPreset.validate_inputs(preset="wan21_t2v_1.3b")
    # ComfyUI leaves the named inputs to the node's check: a name is a preset of the list, never a path
    # (density_override's range is ComfyUI's own check: tests/test_comfyui_loader.py)
    r["preset_refused"] = [SparseAttentionPreset.validate_inputs(preset=p) for p in (
        "../presets/flux", {tests!r} + "/../presets/flux")]
    results[family] = r
emit(results)
"""


@pytest.fixture(scope="module")
def results():
    return run_in_comfyui(comfyui_path(), BODY.format(tests=str(ROOT / "tests"), families=FAMILIES), timeout=900)


@pytest.mark.parametrize("family", FAMILIES)
def test_density_one_matches_unpatched_model(results, family):
    r = results[family]
    assert r["dense_equal_rel"] <= 1e-3, r
    assert r["anchors"] > 0 and r["reuses"] > 0, r   # the override really ran sparse calls


def test_override_runs_on_self_attention_and_falls_back_on_cross(results):
    wan = results["wan"]
    # Wan: 2 blocks x (self + cross) per forward; cross-attention always falls back to dense
    assert wan["fallbacks"].get("cross-attention", 0) > 0, wan
    assert wan["layers"] == [0, 1]
    flux = results["flux"]
    assert flux["layers"] == [0, 1, 2, 3]  # double blocks 0-1, then single blocks 0-1 (model order)
    assert "cross-attention" not in flux["fallbacks"]
    assert results["sd3"]["layers"] == [0, 1]            # no block_index: counted per forward
    assert results["qwen_image"]["layers"] == [0, 1]
    assert results["hunyuan3d"]["layers"] == [0, 1, 2]   # no block_index: 1 double + 2 single blocks
    assert results["ltxv"]["layers"] == [0, 1] and results["ltxv"]["fallbacks"].get("calls with an attention mask")
    # Hunyuan3D 2.1 passes no transformer_options: reached by routing its module's attention per forward
    assert results["hunyuan3d_2_1"]["layers"] == [0, 1]
    assert results["hunyuan3d_2_1"]["fallbacks"].get("cross-attention", 0) > 0
    assert results["hunyuan_video"]["layers"] == [0, 1]  # 1 double + 1 single block, model order


@pytest.mark.parametrize("family", FAMILIES)
def test_low_density_is_finite_and_reported(results, family):
    r = results[family]
    assert r["low_finite"]
    assert 0.0 < r["low_density"] < 0.75, r
    if family in ("wan", "ltxv", "hunyuan3d_2_1"):  # no text in the self-attention: exactly the configured 0.25
        assert abs(r["low_density"] - 0.25) < 0.02, r
    assert r["repeat_equal"] and r["cache_after"] == 0 and r["runs"] == 2, r


@pytest.mark.parametrize("family", FAMILIES)
def test_chaining_and_removal(results, family):
    r = results[family]
    assert r["chain_finite"]
    assert r["chain_calls"] >= r["chain_dense_calls"] > 0, r  # every dense call went through the earlier override
    assert r["original_untouched"] and r["original_equal"]


@pytest.mark.parametrize("family", FAMILIES)
def test_nodes_execute_validate_and_report(results, family):
    r = results[family]
    assert "calls" in r["report_text"] and r["report_image"] == [1, 256, 512, 3]
    assert isinstance(r["validate_bad"], str) and "anchor_steps" in r["validate_bad"]
    assert r["preset_ok"] is True
    path, absolute = r["preset_refused"]
    assert "not one of the" in path and "not one of the" in absolute


def test_family_layouts_steps_and_layer_numbers():
    r = run_in_comfyui(comfyui_path(), f"""
        import sys, torch
        sys.path.insert(0, {str(ROOT / "tests")!r})
        import comfy_child as C
        C.load_pack()
        from comfyui_sparse_attention.nodes.families import BY_NAME
        from comfyui_sparse_attention.nodes.forward import Forward, step_index
        flux = BY_NAME["flux"]
        lay = flux.layout(7 + 16 * 24, (2, 16, 32, 48), {{}})
        h3d = BY_NAME["hunyuan3d"].layout(600, (2, 64, 512), {{}})
        wan = BY_NAME["wan"].layout(48 + 5, None, {{"grid_sizes": torch.Size([3, 4, 4])}})
        sched = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
        steps = [step_index({{"sigmas": torch.tensor([s]), "sample_sigmas": sched}})[0]
                 for s in (1.0, 0.75, 0.6, 0.5, 0.25)]
        fwd = Forward(flux, (2, 16, 32, 48), {{}}, {{"single": 19}})
        single = fwd.next_layer({{"block_index": 3, "block_type": "single"}})
        counted = [fwd.next_layer({{}}) for _ in range(2)]  # no block_index: position in the forward
        emit(dict(flux=[lay.text_len, list(lay.grid), lay.text_first], h3d=[h3d.text_len, h3d.grid],
                  wan=[wan.text_len, list(wan.grid), wan.extra_len], steps=steps, single=single,
                  counted=counted))
    """)
    assert r["flux"] == [7, [1, 16, 24], True]
    assert r["h3d"] == [88, None]
    assert r["wan"] == [0, [3, 4, 4], 5]
    assert r["steps"] == [0, 1, 1, 2, 3]  # 0.6 lies inside step 1 (a multi-evaluation sampler's midpoint)
    assert r["single"] == 22  # single-stream block 3 after 19 double-stream blocks: model order
    assert r["counted"] == [1, 2]


def test_engine_errors_never_fail_sampling():
    r = run_in_comfyui(comfyui_path(), f"""
        import sys, torch
        sys.path.insert(0, {str(ROOT / "tests")!r})
        import comfy_child as C
        C.load_pack()
        from comfyui_sparse_attention.nodes.patch import install
        from comfyui_sparse_attention.engine import SparseConfig
        model, latent, pos, neg = C.build("wan")
        base = C.sample(model, latent, pos, neg)
        # backend="triton" on CPU tensors: every sparse call raises inside the engine
        m, p = install(model, SparseConfig(method="mc_sparse", density=0.25, min_tokens=0, group_size=64,
                                           block_q=64, block_k=64, backend="triton"))
        out = C.sample(m, latent, pos, neg)
        emit(dict(equal=C.rel(out, base), fallbacks=dict(p.fallbacks)))
    """)
    assert r["equal"] <= 1e-5  # every sparse call went dense instead
    assert any(k.startswith("an engine error (ValueError") for k in r["fallbacks"]), r


def test_each_report_shows_the_run_of_its_own_samples():
    """One patched model, two samplers (4 and 7 steps), a Report on each: ComfyUI may re-run one Report alone
    (its `layer` changed) while both samplers stay cached; it must show its own sampler's run, not the patch's last.
    Samples no run produced get the last run, said so. The text is also the node's UI output."""
    r = run_in_comfyui(comfyui_path(), f"""
        import sys, torch
        sys.path.insert(0, {str(ROOT / "tests")!r})
        import comfy_child as C
        C.load_pack()
        from comfyui_sparse_attention.nodes.nodes_sparse import SparseAttention, SparseAttentionReport
        from comfyui_sparse_attention.nodes.patch import latent_distance, latent_fingerprint
        model, latent, pos, neg = C.build("wan")
        out = SparseAttention.execute(model, "block_topk", 0.3, "64", "64", "0", 0, "", "every 2", True, True, 0,
                                      "torch")
        patched = out.result[0] if hasattr(out, "result") else out[0]
        four = C.sample(patched, latent, pos, neg, steps=4)
        seven = C.sample(patched, latent, pos, neg, steps=7)

        def report(samples):
            rep = SparseAttentionReport.execute(patched, {{"samples": samples}}, -1)
            text = (rep.result if hasattr(rep, "result") else rep)[0]
            ui = getattr(rep, "ui", None)
            return text, (ui or {{}}).get("text", [None])[0] == text

        class Nested:  # ComfyUI 0.33.0's NestedTensor: several latents, the same values in another shape
            def __init__(self, tensors):
                self.tensors = tensors
        a, b = torch.randn(2, 3), torch.randn(5)
        flat = torch.cat([a.flatten(), b])
        emit(dict(four=report(four), seven=report(seven), other=report(four + 1.0),
                  half=report(four.to(torch.float16))[0], bf16=report(four.to(torch.bfloat16))[0],
                  nested=latent_distance(latent_fingerprint(Nested([a, b])), latent_fingerprint(flat)) <= 1,
                  differ=latent_distance(latent_fingerprint(flat), latent_fingerprint(flat * 1.0001)) <= 1))
    """)
    (four, ui4), (seven, ui7), (other, _) = r["four"], r["seven"], r["other"]
    assert ui4 and ui7, r
    assert "run: 4 steps" in four and "not the output" not in four, four
    assert "run: 7 steps" in seven, seven
    assert "run: 7 steps" in other and "not the output of a run of this patched model" in other, other
    assert r["nested"] and not r["differ"], r
    for cast in ("half", "bf16"):  # ComfyUI's fp16 / bf16 intermediates: the node's copy is cast after sampling
        assert "run: 4 steps" in r[cast] and "not the output" not in r[cast], r[cast]


def test_auto_takes_the_few_step_preset_on_a_short_run():
    """`auto` on a Wan 14B-class model: the many-step preset on a 20-step run, the 4-step preset on a 4-step run
    (lightx2v, Lightning 2+2), the 8-step one on 8 steps; the density override reaches each."""
    r = run_in_comfyui(comfyui_path(), f"""
        import sys, torch
        sys.path.insert(0, {str(ROOT / "tests")!r})
        import comfy_child as C
        C.load_pack()
        from comfyui_sparse_attention.nodes.nodes_sparse import AUTO_PRESET, SparseAttentionPreset
        from comfyui_sparse_attention.nodes.patch import find_patch
        from comfyui_sparse_attention.nodes.report import render_report
        model, latent, pos, neg = C.build("wan")
        out = {{}}
        for override in (0.0, 0.2):
            node = SparseAttentionPreset.execute(model, AUTO_PRESET, override)
            patched = node.result[0] if hasattr(node, "result") else node[0]
            p = find_patch(patched)
            for steps in (20, 4, 8):
                C.sample(patched, latent, pos, neg, steps=steps)
                cfg = p.last_run.cfg
                out[f"{{override}}-{{steps}}"] = [cfg.anchor_steps.text(), cfg.warmup_layers, cfg.density]
            out[f"{{override}}-report"] = next(line for line in render_report(p, -1)[0].splitlines()
                                               if line.startswith("model family"))
        emit(out)
    """)
    assert r["0.0-20"] == ["20%,53%", 0, 0.08], r
    assert r["0.0-4"] == ["", 1, 0.08], r
    assert r["0.0-8"] == ["50%", 1, 0.08], r
    assert [v[2] for k, v in r.items() if k.startswith("0.2-") and k[4:].isdigit()] == [0.2, 0.2, 0.2], r
    assert "anchors" in r["0.0-report"] and "50%" in r["0.0-report"], r  # the report shows the run's own settings
