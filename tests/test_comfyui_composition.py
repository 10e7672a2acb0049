"""What users combine the patch with, inside a real ComfyUI (needs COMFYUI_PATH): LoRAs applied before and after the
node, ComfyUI's EasyCache (skipped model calls), another attention override installed after ours, CFG 1 and
CFG > 1 with cond/uncond batched and in separate calls, two samplers on clones of one patched model, engine
errors and an interruption inside an anchor; and (ComfyUI 0.33.0) the MultiGPU CFG Split node, run on CPU with
two device keys. Tiny random-weight Wan (comfy_child.py), euler."""

import pytest
from comfy_subprocess import run_in_comfyui
from conftest import ROOT, comfyui_path

pytestmark = pytest.mark.comfyui

PRELUDE = """
import sys, threading, torch
sys.path.insert(0, {tests!r})
import comfy_child as C
C.load_pack()
import comfy.model_management as mm
import comfy.sd
from comfyui_sparse_attention.nodes.patch import install
from comfyui_sparse_attention.engine import SparseConfig
from comfyui_sparse_attention.engine.policy_mc_sparse import McSparsePolicy

def cfg(**kw):
    base = dict(method="mc_sparse", density=0.5, min_tokens=0, group_size=64, block_q=64, block_k=64, backend="torch")
    base.update(kw)
    return SparseConfig(**base)

def node_model(out):
    return out.result[0] if hasattr(out, "result") else out[0]

model, latent, pos, neg = C.build("wan")
base = C.sample(model, latent, pos, neg)
r = {{}}
"""

BODY = PRELUDE + """
# LoRA before and after the node: density 1 equals the LoRA'd unpatched model
g = torch.Generator().manual_seed(5)
lora = {{}}
for name in ("blocks.0.self_attn.q", "blocks.1.self_attn.k", "blocks.0.ffn.0"):
    w = model.model.diffusion_model.get_submodule(name).weight
    lora[f"diffusion_model.{{name}}.lora_up.weight"] = torch.randn(w.shape[0], 4, generator=g) * 0.5
    lora[f"diffusion_model.{{name}}.lora_down.weight"] = torch.randn(4, w.shape[1], generator=g) * 0.5
lora_model, _ = comfy.sd.load_lora_for_models(model, None, lora, 1.0, 0.0)
lora_base = C.sample(lora_model, latent, pos, neg)
r["lora_effect"] = C.rel(lora_base, base)
first, p1 = install(lora_model, cfg(density=1.0))
r["lora_then_ours"] = [C.rel(C.sample(first, latent, pos, neg), lora_base), p1.last_stats.totals()["reuses"]]
ours, p2 = install(model, cfg(density=1.0))
after, _ = comfy.sd.load_lora_for_models(ours, None, lora, 1.0, 0.0)
r["ours_then_lora"] = [C.rel(C.sample(after, latent, pos, neg), lora_base), p2.last_stats.totals()["reuses"]]
low, p3 = install(lora_model, cfg(density=0.25))
r["lora_low_finite"] = bool(torch.isfinite(C.sample(low, latent, pos, neg)).all())

# EasyCache skips model calls; an anchor step it skips moves to the next computed step (both node orders)
from comfy_extras.nodes_easycache import EasyCacheNode
schedule = cfg(anchor_steps="every 2")
for order in ("ours_first", "easycache_first"):
    if order == "ours_first":
        m, p = install(model, schedule)
        m = node_model(EasyCacheNode.execute(m, 0.5, 0.0, 1.0, False))
    else:
        m, p = install(node_model(EasyCacheNode.execute(model, 0.5, 0.0, 1.0, False)), schedule)
    out = C.sample(m, latent, pos, neg, steps=12)
    r["easycache_" + order] = dict(kinds={{str(s): k for s, k in p.last_stats.step_kinds().items()}},
                                   finite=bool(torch.isfinite(out).all()), cache_after=p.cache_bytes())

# an override installed after ours (on a clone) runs our dense calls there, and only there
seen = []
ours, p4 = install(model, cfg(density=1.0, warmup_steps=1))
later = ours.clone()
later.model_options["transformer_options"]["optimized_attention_override"] = C.recording_override(seen)
out = C.sample(later, latent, pos, neg)
t = p4.last_stats.totals()
r["after_override"] = dict(rel=C.rel(out, base), recorded=len(seen), dense=t["dense"] + sum(p4.fallbacks.values()),
                           reuses=t["reuses"])
before = len(seen)
C.sample(ours, latent, pos, neg)
r["after_override_other_clone"] = len(seen) - before

# CFG 1 (cond only), CFG 3 with cond/uncond batched, and CFG 3 in separate calls (memory "low")
real_free = mm.get_free_memory
cfg_runs = {{}}
for name, scale, split in (("cfg1", 1.0, False), ("batched", 3.0, False), ("separate", 3.0, True)):
    m, p = install(model, cfg(anchor_steps="every 2"))
    if split:
        mm.get_free_memory = lambda dev=None, torch_free_too=False: (1, 1) if torch_free_too else 1
    try:
        out = C.sample(m, latent, pos, neg, steps=4, cfg=scale)
    finally:
        mm.get_free_memory = real_free
    full, pf = install(model, cfg(density=1.0))
    dense_equal = C.rel(C.sample(full, latent, pos, neg, steps=4, cfg=scale),
                        C.sample(model, latent, pos, neg, steps=4, cfg=scale))
    cfg_runs[name] = out
    r[name] = dict(anchors=p.last_stats.totals()["anchors"], finite=bool(torch.isfinite(out).all()),
                   dense_equal=dense_equal)
r["batched_vs_separate"] = C.rel(cfg_runs["separate"], cfg_runs["batched"])

# a node that replaces the model's forward and does not pass transformer_options on (TeaCache, MagCache): no
# attention call reaches the pack; the run is dense and the report says why instead of showing an empty run
from comfyui_sparse_attention.nodes.report import render_report
m, p = install(model, cfg())
dm = m.get_model_object("diffusion_model")
orig_forward = dm.forward
m.add_object_patch("diffusion_model.forward",
                   lambda *a, **kw: orig_forward(*a, **{{**kw, "transformer_options": {{}}}}))
out = C.sample(m, latent, pos, neg)
r["unreached"] = dict(report=render_report(p, -1)[0], calls=p.last_stats.totals()["calls"], rel=C.rel(out, base))
m2, p2 = install(model, cfg())
C.sample(m2, latent, pos, neg)
r["reached_report"] = render_report(p2, -1)[0]

# memory near ComfyUI's threshold: split at the anchor steps (0 and 2), batched in between; calc_cond_batch asks
# for the free memory once per batch it builds (twice in a split step; 0.33.0 through its patcher)
plan, state = [True, False, True, False], dict(step=0, left=0, split=False)

def flipping(dev=None, torch_free_too=False):
    callers = sys._getframe(1).f_code.co_name, sys._getframe(2).f_code.co_name
    if "_calc_cond_batch" not in callers:  # model loading and attention ask too
        return real_free(dev, torch_free_too)
    if state["left"] == 0:
        state["split"] = plan[state["step"]]
        state["left"], state["step"] = (2 if state["split"] else 1), state["step"] + 1
    state["left"] -= 1
    return real_free(dev, torch_free_too) if not state["split"] else ((1, 1) if torch_free_too else 1)

m, p = install(model, cfg(anchor_steps="every 2"))
mm.get_free_memory = flipping
try:
    out = C.sample(m, latent, pos, neg, steps=4, cfg=3.0)
finally:
    mm.get_free_memory = real_free
t = p.last_stats.totals()
r["flipping"] = dict(anchors=t["anchors"], reuses=t["reuses"], steps=state["step"],
                     vs_separate=C.rel(out, cfg_runs["separate"]))

# two samplers on clones of one patched model (the patch object is shared): neither run sees the other's state
# (runs overlapping in time are tested at the patch level: tests/test_patch_runs.py; ComfyUI itself keeps one
# current patcher per loaded model, so two samplers of one model cannot run at once in it)
shared, p5 = install(model, cfg(density=0.25))
one, two = shared.clone(), comfy.sd.load_lora_for_models(shared, None, lora, 1.0, 0.0)[0]
first_a = C.sample(one, latent, pos, neg, steps=4)
first_b = C.sample(two, latent, pos, neg, steps=5)
again_a = C.sample(one, latent, pos, neg, steps=4)
fresh_b = C.sample(install(lora_model, cfg(density=0.25))[0], latent, pos, neg, steps=5)
r["clones"] = dict(a_repeat=bool(torch.equal(first_a, again_a)), b_fresh=C.rel(first_b, fresh_b), runs=p5.runs,
                   cache_after=p5.cache_bytes())

# an engine error of any kind sends the call and its layer dense, counted; an interruption reaches the sampler
real_select = McSparsePolicy.select
def broken(self, *a, **k):
    raise IndexError("simulated")
McSparsePolicy.select = broken
m, p6 = install(model, cfg())
out = C.sample(m, latent, pos, neg)
r["index_error"] = dict(rel=C.rel(out, base), fallbacks=dict(p6.fallbacks),
                        engine_fallbacks=p6.last_stats.totals()["fallbacks"])
calls = []
def interrupted(self, *a, **k):
    calls.append(1)
    if len(calls) == 3:  # inside the anchor of the third step's first layer (a run with no reuse step is dense)
        raise mm.InterruptProcessingException()
    return real_select(self, *a, **k)
McSparsePolicy.select = interrupted
m, p7 = install(model, cfg(anchor_steps="every 2"))
try:
    C.sample(m, latent, pos, neg)
    r["interrupt_raised"] = False
except mm.InterruptProcessingException:
    r["interrupt_raised"] = True
McSparsePolicy.select = real_select
r["interrupt_cache_after"] = p7.cache_bytes()
clean, _ = install(model, cfg(anchor_steps="every 2"))
r["interrupt_next_run"] = bool(torch.equal(C.sample(m, latent, pos, neg), C.sample(clean, latent, pos, neg)))
r["interrupt_fallbacks"] = dict(p7.fallbacks)
emit(r)
"""

MULTIGPU = PRELUDE + """
# ComfyUI 0.33.0's MultiGPU CFG Split on CPU: a second device key ("cpu:1") stands for a second GPU
import comfyui_sparse_attention.nodes.patch as patch_mod
from comfy_extras.nodes_multigpu import MultiGPUCFGSplitNode
mm.get_all_torch_devices = lambda exclude_current=False: [torch.device("cpu"), torch.device("cpu", 1)]
model.cached_patcher_init = (lambda: C.build("wan")[0], ())
patched, p = install(model, cfg(anchor_steps="every 2"))
single = C.sample(patched, latent, pos, neg, steps=4)
single_anchors = p.last_stats.totals()["anchors"]
seen = set()
real = patch_mod.SamplingRun.engine_for
def spy(self, q, to):
    seen.add((threading.current_thread().name, str(to.get("multigpu_thread_device")), str(to.get("cond_or_uncond"))))
    return real(self, q, to)
patch_mod.SamplingRun.engine_for = spy
split = node_model(MultiGPUCFGSplitNode.execute(patched, 2))
r["extra_devices"] = [str(m.load_device) for m in split.get_additional_models_with_key("multigpu")]
out = C.sample(split, latent, pos, neg, steps=4)
r["rel_single"] = C.rel(out, single)
r["calls"] = sorted(seen)
r["engines"] = sorted(p.last_run.engines.engines())
r["anchors"] = [single_anchors, p.last_stats.totals()["anchors"]]
r["devices"] = p.last_stats.cache.get("devices")
r["cache_after"] = p.cache_bytes()
emit(r)
"""


@pytest.fixture(scope="module")
def results():
    return run_in_comfyui(comfyui_path(), BODY.format(tests=str(ROOT / "tests")), timeout=600)


def test_loras_before_and_after_the_node(results):
    r = results
    assert r["lora_effect"] > 0.05, r  # the LoRA changes the model ...
    for key in ("lora_then_ours", "ours_then_lora"):
        rel, reuses = r[key]
        assert rel < 1e-4 and reuses > 0, (key, r[key])  # ... and density 1 reproduces the LoRA'd model
    assert r["lora_low_finite"]


def _expected_kinds(steps: list[int], every: int) -> dict[str, str]:
    """Anchor at the first computed step and wherever an anchor step (every ``every``) lies since the last one."""
    out, last = {}, None
    for s in steps:
        due = last is None or any(a % every == 0 for a in range(last + 1, s + 1))
        out[str(s)] = "anchor" if due else "reuse"
        if due:
            last = s
    return out


@pytest.mark.parametrize("order", ["ours_first", "easycache_first"])
def test_easycache_skipped_anchor_moves_to_the_next_computed_step(results, order):
    r = results["easycache_" + order]
    steps = sorted(int(s) for s in r["kinds"])
    assert len(steps) < 12, r  # EasyCache skipped some model calls
    assert any(s % 2 == 0 for s in range(12) if s not in steps), r  # ... including an anchor step
    assert r["kinds"] == _expected_kinds(steps, 2), r
    assert r["finite"] and r["cache_after"] == 0, r


def test_an_override_installed_after_ours_runs_our_dense_calls(results):
    r = results["after_override"]
    assert r["rel"] < 1e-4 and r["reuses"] > 0, r
    assert r["recorded"] >= r["dense"] > 0, r
    assert results["after_override_other_clone"] == 0, results  # the clone without it never calls it


def test_cfg_one_and_cond_uncond_batched_or_separate(results):
    r = results
    for name in ("cfg1", "batched", "separate"):
        assert r[name]["finite"] and r[name]["dense_equal"] < 1e-4, (name, r[name])
    # separate calls keep a selection per cond (twice the anchors of one batched call), with the same result
    assert r["separate"]["anchors"] == 2 * r["batched"]["anchors"] == 2 * r["cfg1"]["anchors"] > 0, r
    assert r["batched_vs_separate"] < 1e-4, r
    # split at the anchors, batched in between: the batched calls reuse the split calls' entries (no extra anchor)
    f = r["flipping"]
    assert f["steps"] == 4 and f["anchors"] == r["separate"]["anchors"] and f["reuses"] > 0, f
    assert f["vs_separate"] < 1e-4, f


def test_a_forward_that_drops_transformer_options_is_reported(results):
    r = results["unreached"]
    assert r["calls"] == 0 and r["rel"] < 1e-6, r
    assert "NOTHING RAN SPARSE" in r["report"] and "TeaCache" in r["report"], r["report"]
    assert "NOTHING RAN SPARSE" not in results["reached_report"], results["reached_report"]


def test_two_samplers_on_clones_share_nothing(results):
    r = results["clones"]
    assert r["a_repeat"] and r["b_fresh"] < 1e-6, r
    assert r["runs"] == 3 and r["cache_after"] == 0, r


def test_any_engine_error_goes_dense_and_an_interruption_does_not(results):
    r = results["index_error"]
    assert r["rel"] < 1e-5, r  # every sparse call went dense
    assert r["fallbacks"].get("an engine error (IndexError)", 0) > 0 and r["engine_fallbacks"] > 0, r
    assert results["interrupt_raised"], results
    errors = [k for k in results["interrupt_fallbacks"] if "error" in k]
    assert not errors, results  # the interruption was not swallowed as a fallback
    assert results["interrupt_cache_after"] == 0 and results["interrupt_next_run"], results


def test_multigpu_cfg_split_runs_an_engine_per_device():
    if not (comfyui_path() / "comfy" / "multigpu.py").is_file():
        pytest.skip("this ComfyUI has no MultiGPU CFG Split (added after 0.3.75)")
    r = run_in_comfyui(comfyui_path(), MULTIGPU.format(tests=str(ROOT / "tests")), timeout=600)
    assert r["extra_devices"] == ["cpu:1"], r
    assert r["rel_single"] < 1e-4, r  # the split run equals the single-device run
    threads = {t for t, _, _ in r["calls"]}
    devices = {d for _, d, _ in r["calls"]}
    assert len(threads) == 2 and devices == {"cpu", "cpu:1"}, r  # cond and uncond on two workers ...
    assert r["engines"] == ["cpu", "cpu:1"] and r["devices"] == 2, r  # ... each with its own engine
    assert r["anchors"][1] == 2 * r["anchors"][0], r  # one selection per cond instead of one batched
    assert r["cache_after"] == 0, r
