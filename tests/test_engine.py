"""Engine (CPU): configuration, schedule decisions, density accounting, quality ordering, residual,
cache offload round trips, budget fallbacks and memory release."""

import gc
import weakref
from pathlib import Path

import pytest
import torch

from comfyui_sparse_attention import kernels
from comfyui_sparse_attention.engine import CallContext, SparseConfig, SparseEngine, TokenLayout
from comfyui_sparse_attention.engine.cache import Entry, SelectionCache, host_memory
from comfyui_sparse_attention.engine.policy_static import build_static
from comfyui_sparse_attention.engine.residual import Residual
from comfyui_sparse_attention.engine.selection import TokenSelection, block_pairs_fraction
from comfyui_sparse_attention.engine.synthetic import SyntheticVideoAttention, rel_l2


# configuration -------------------------------------------------------------------------------------
def test_config_validation_names_the_field(tmp_path):
    with pytest.raises(ValueError, match="density"):
        SparseConfig(density=0.0)
    with pytest.raises(ValueError, match="method"):
        SparseConfig(method="magic")
    with pytest.raises(ValueError, match="block_q"):
        SparseConfig(block_q=32)
    with pytest.raises(ValueError, match="group_size"):
        SparseConfig(group_size=100)
    with pytest.raises(ValueError, match="anchor_steps"):
        SparseConfig.from_dict({"anchor_steps": "ten"})
    with pytest.raises(ValueError, match="densities.image_to_text"):
        SparseConfig.from_dict({"densities": {"image_to_text": 2}})
    with pytest.raises(ValueError, match="unknown field"):
        SparseConfig.from_dict({"dnesity": 0.2})
    with pytest.raises(ValueError, match="dense_layers"):
        SparseConfig.from_dict({"dense_layers": "0,x"})
    preset = tmp_path / "bad.yaml"
    preset.write_text("sparse:\n  method: mc_sparse\n  warmup_steps: -1\n")
    with pytest.raises(ValueError, match=r"bad\.yaml: warmup_steps"):
        SparseConfig.from_yaml(preset)


def test_config_from_yaml_and_dict(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("# source: test\nsparse:\n  method: block_topk\n  density: 0.2\n  anchor_steps: '10, 26'\n"
                      "  dense_layers: '0,2-3'\n  densities: {image_to_text: 0.5}\n")
    cfg = SparseConfig.from_yaml(preset, overrides={"density": 0.1})
    assert cfg.method == "block_topk" and cfg.density == 0.1
    assert cfg.anchor_steps.steps == (10, 26)
    assert cfg.dense_layers == (0, 2, 3)
    assert cfg.densities.image_to_text == 0.5
    assert SparseConfig.from_dict({"anchor_steps": "every 4"}).anchor_steps.every == 4


# schedule ------------------------------------------------------------------------------------------
def test_schedule_decisions():
    cfg = SparseConfig(method="mc_sparse", warmup_steps=2, warmup_layers=1, dense_layers=(5,),
                       anchor_steps="6", min_tokens=100)
    eng = SparseEngine(cfg)
    n = 1000

    def ctx(layer, step, **kw):
        return CallContext(layer=layer, step=step, **kw)
    assert eng.decide(ctx(3, 0), n) == "dense"          # warm-up step
    assert eng.decide(ctx(0, 4), n) == "dense"          # warm-up layer
    assert eng.decide(ctx(5, 4), n) == "dense"          # explicit dense layer
    assert eng.decide(ctx(3, 4), 50) == "dense"         # too few tokens
    assert eng.decide(ctx(3, 4, is_self=False), n) == "dense"
    assert eng.decide(ctx(3, 2), n) == "anchor"         # nothing cached yet
    eng.cache.on_device[ctx(3, 2).key(n)] = object()
    assert eng.decide(ctx(3, 3), n) == "reuse"
    assert eng.decide(ctx(3, 6), n) == "anchor"         # listed anchor
    eng._anchored_at[ctx(3, 6).key(n)] = 6
    assert eng.decide(ctx(3, 6), n) == "reuse"          # second evaluation of the same step
    every = SparseEngine(SparseConfig(warmup_steps=2, anchor_steps="every 3", min_tokens=0))
    every.cache.on_device[ctx(1, 0).key(n)] = object()
    assert [every.decide(ctx(1, s), n) for s in range(2, 9)] == ["anchor", "reuse", "reuse", "anchor", "reuse",
                                                                 "reuse", "anchor"]


def test_a_later_samplers_first_anchor_stands_in_for_the_next_scheduled_one(problem):
    """Wan 2.2's low-noise expert under a whole-run preset (anchors 0, 20 %, 53 %) on a 10 + 10 split: its first step
    (10) anchors, off the schedule, and serves the 53 % anchor (11) too; a scheduled anchor past 5 % of the run still
    anchors, and a whole run keeps every scheduled anchor after an off-schedule first one (warm-up)."""
    def schedule_of(anchors, first, count, total, warmup=0):
        eng = SparseEngine(SparseConfig(**{**BASE, "warmup_steps": warmup, "anchor_steps": anchors}))
        eng.begin_run()
        for s in range(first, first + count):
            q, k, v = problem.qkv(min(s - first, problem.steps - 1))
            eng.attend(q, k, v, CallContext(layer=0, step=s, total_steps=total, layout=problem.layout))
        return eng.end_run(log_summary=False).schedule_line()
    assert schedule_of("0, 20%, 53%", 10, 10, 20) == "A" + "r" * 9
    assert schedule_of("0, 20%, 53%, 60%", 10, 10, 20) == "Ar" + "A" + "r" * 7
    assert schedule_of("0, 20%, 53%", 0, 10, 20) == "ArrrArrrrr"      # the first expert: 0 and 4 (20 %)
    assert schedule_of("4", 0, 8, 8, warmup=3) == "DDDAArrr"        # a whole run: warm-up 3, then 3 and 4
    assert schedule_of("every 2", 47, 6, 100) == "AArArA"             # periodic anchors keep their period


def run_engine(cfg, problem, steps, layers=(0,)):
    """Per-step rel-L2 of the engine output vs dense, and the run statistics."""
    eng = SparseEngine(cfg)
    eng.begin_run()
    errs = []
    for s in range(steps):
        q, k, v = problem.qkv(s)
        dense = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        outs = [eng.attend(q, k, v, CallContext(layer=layer, step=s, layout=problem.layout)) for layer in layers]
        errs.append(max(rel_l2(o, dense) for o in outs))
    return errs, eng.end_run()


@pytest.fixture(scope="module")
def problem():
    return SyntheticVideoAttention(frames=4, height=16, width=16, text=32, heads=2, head_dim=64, steps=8, seed=3)


BASE = dict(density=0.15, warmup_steps=1, anchor_steps="", min_tokens=0, backend="torch", block_q=64, block_k=64,
            group_size=64)


def test_stats_keep_each_steps_phase_seconds(problem):
    """Timed work is booked to the run step it ran in as well as to its layer: per step, selection only at the
    anchor, attention at every step; the steps' seconds add up to the layers'; merged statistics keep them."""
    from comfyui_sparse_attention.engine.stats import PHASES, RunStats
    _, stats = run_engine(SparseConfig(method="mc_sparse", **BASE), problem, 4, layers=(0, 1))
    per_step = stats.step_totals()
    assert sorted(per_step) == [0, 1, 2, 3] and stats.schedule_line() == "DArr"
    assert per_step[1]["selection"] > 0 and per_step[2]["selection"] == per_step[3]["selection"] == 0
    assert all(per_step[s]["attention"] > 0 for s in range(4))
    for phase in PHASES:
        assert sum(per_step[s][phase] for s in per_step) == pytest.approx(stats.totals()["seconds"][phase])
    assert sorted(stats.step_seconds[2]) == [0, 1]  # both layers' reuse calls
    merged = RunStats.merged([stats, stats])
    assert merged.step_totals()[1]["selection"] == pytest.approx(2 * per_step[1]["selection"])
    assert stats.as_dict()["step_seconds"] == per_step


@pytest.mark.parametrize("method", ["mc_sparse", "block_topk"])
def test_split_cond_batch_reuses_the_batched_anchor(problem, method):
    """ComfyUI may batch cond+uncond at the anchor and split them later (memory ran low): the split calls
    reuse the batched entry's rows, with the same result, instead of anchoring again."""
    eng = SparseEngine(SparseConfig(method=method, **BASE))
    eng.begin_run()
    q0, k0, v0 = problem.qkv(0)
    both = [torch.cat([t, t.flip(1)]) for t in (q0, k0, v0)]  # two different batch rows
    eng.attend(*both, CallContext(layer=0, step=1, chunk=(1, 0), layout=problem.layout))
    q, k, v = (torch.cat([t, t.flip(1)]) for t in problem.qkv(2))
    batched = eng.attend(q, k, v, CallContext(layer=0, step=2, chunk=(1, 0), layout=problem.layout))
    assert eng.decide(CallContext(layer=0, step=3, chunk=(0,), layout=problem.layout), q.shape[2]) == "reuse"
    first = eng.attend(q[:1], k[:1], v[:1], CallContext(layer=0, step=3, chunk=(1,), layout=problem.layout))
    second = eng.attend(q[1:], k[1:], v[1:], CallContext(layer=0, step=3, chunk=(0,), layout=problem.layout))
    assert torch.allclose(torch.cat([first, second]), batched, atol=1e-5)
    t = eng.end_run().totals()
    assert t["anchors"] == 1 and t["reuses"] == 3
    # an anchor of the split chunk replaces the batched entry (no stale copy is kept)
    eng.begin_run()
    eng.attend(*both, CallContext(layer=0, step=1, chunk=(1, 0), layout=problem.layout))
    eng.attend(q0, k0, v0, CallContext(layer=0, step=2, chunk=(7,), layout=problem.layout))  # unrelated: anchors
    eng.cfg = eng.cfg.replace(anchor_steps="3")
    eng.attend(q[:1], k[:1], v[:1], CallContext(layer=0, step=3, chunk=(1,), layout=problem.layout))
    chunks = sorted(key[2] for key in eng.cache.on_device)
    assert chunks == [(1,), (7,)]
    eng.end_run()


@pytest.mark.parametrize("method", ["mc_sparse", "block_topk"])
def test_a_batched_call_reuses_the_split_anchors_entries(problem, method):
    """The other way round: split at the anchor (memory ran low), batched again later. The batched call reuses
    the split calls' entries row by row, with their result, instead of anchoring again; a later batched anchor
    replaces the split entries, whose calls then read its rows."""
    eng = SparseEngine(SparseConfig(method=method, **{**BASE, "anchor_steps": "1, 3"}))
    eng.begin_run()
    ctx = lambda step, chunk: CallContext(layer=0, step=step, chunk=chunk, layout=problem.layout)  # noqa: E731
    q0, k0, v0 = problem.qkv(1)
    eng.attend(q0, k0, v0, ctx(1, (1,)))
    eng.attend(q0.flip(1), k0.flip(1), v0.flip(1), ctx(1, (0,)))
    q, k, v = (torch.cat([t, t.flip(1)]) for t in problem.qkv(2))
    assert eng.decide(ctx(2, (1, 0)), q.shape[2]) == "anchor"  # no entry under the batched key itself ...
    batched = eng.attend(q, k, v, ctx(2, (1, 0)))  # ... but its rows are stored: reused
    split = [eng.attend(q[i:i + 1], k[i:i + 1], v[i:i + 1], ctx(2, (c,))) for i, c in enumerate((1, 0))]
    assert torch.equal(batched, torch.cat(split))
    t = eng.end_run().totals()
    assert t["anchors"] == 2 and t["reuses"] == 3 and t["calls"] == 5  # the batched call is one call
    # three conds split as (2, 1) and (0): the batch of all three is served by both entries
    eng.begin_run()
    three = [torch.cat([t, t.flip(1), t.flip(2)]) for t in problem.qkv(1)]
    eng.attend(*(t[:2] for t in three), ctx(1, (2, 1)))
    eng.attend(*(t[2:] for t in three), ctx(1, (0,)))
    eng.attend(*three, ctx(2, (2, 1, 0)))
    assert eng.end_run().totals()["anchors"] == 2
    # a batched anchor replaces the split entries; the split calls read its rows
    eng.begin_run()
    eng.attend(q0, k0, v0, ctx(1, (1,)))
    eng.attend(q0.flip(1), k0.flip(1), v0.flip(1), ctx(1, (0,)))
    eng.attend(q, k, v, ctx(3, (1, 0)))
    assert [key[2] for key in eng.cache.on_device] == [(1, 0)]
    assert eng.decide(ctx(4, (0,)), q.shape[2]) == "reuse"
    # one missing part, or a part due to anchor: the batch anchors as a whole
    eng.begin_run()
    eng.attend(q0, k0, v0, ctx(1, (1,)))
    eng.attend(q, k, v, ctx(2, (1, 0)))
    eng.attend(q0, k0, v0, ctx(3, (1,)))
    eng.attend(q0.flip(1), k0.flip(1), v0.flip(1), ctx(3, (0,)))
    eng.cfg = eng.cfg.replace(anchor_steps="1, 3, 4")
    eng.attend(q, k, v, ctx(4, (1, 0)))
    t = eng.end_run().totals()
    assert t["anchors"] == 5 and t["reuses"] == 0


@pytest.mark.parametrize("method", ["mc_sparse", "block_topk"])
def test_a_run_under_inference_mode_matches_one_without(problem, method):
    """ComfyUI executes its nodes under torch.inference_mode: every tensor the engine caches is then an inference
    tensor (no version counter, no autograd). A run there gives the run's outputs exactly."""
    cfg = SparseConfig(method=method, **BASE)
    plain, stats = run_engine(cfg, problem, 4)
    with torch.inference_mode():
        frozen, frozen_stats = run_engine(cfg, problem, 4)
    assert frozen == pytest.approx(plain, abs=1e-6)
    assert frozen_stats.totals()["reuses"] == stats.totals()["reuses"] > 0


def test_mc_sparse_with_residual_beats_block_topk_at_equal_density(problem):
    block_err, block_stats = run_engine(SparseConfig(method="block_topk", residual=False, **BASE), problem, 6)
    mc_err, mc_stats = run_engine(SparseConfig(method="mc_sparse", residual=True, **BASE), problem, 6)
    # equal density (the token method may not spend more)
    assert mc_stats.totals()["density"] <= block_stats.totals()["density"] + 0.01
    assert sum(mc_err[2:]) < 0.5 * sum(block_err[2:])


def test_residual_lowers_reuse_step_error(problem):
    without, _ = run_engine(SparseConfig(method="mc_sparse", residual=False, **BASE), problem, 6)
    with_r, stats = run_engine(SparseConfig(method="mc_sparse", residual=True, **BASE), problem, 6)
    assert stats.totals()["reuses"] == 4 and stats.totals()["anchors"] == 1
    assert with_r[1] < 1e-5 and without[1] < 1e-5   # the anchor returns dense output
    assert all(a < b for a, b in zip(with_r[2:], without[2:]))


def test_fp8_residual_is_half_the_bytes_and_bounded_by_its_rounding():
    g = torch.Generator().manual_seed(0)
    diff = torch.randn(2, 3, 500, 64, generator=g) * torch.logspace(-4, 0, 500).view(1, 1, -1, 1)  # rows of any size
    r = Residual.encode(diff.to(torch.bfloat16), "fp8")
    assert r.data.dtype == torch.float8_e4m3fn and r.scale.shape == (2, 3, 500, 1)
    assert r.nbytes == diff.numel() + diff.numel() // 64 * 4  # 1 byte per value + an fp32 scale per row
    ref = diff.to(torch.bfloat16).float()
    err = (r.decode(torch.float32) - ref).abs()
    assert bool((err <= 2**-4 * ref.abs().amax(-1, keepdim=True) + 1e-12).all())  # within e4m3's rounding
    out = torch.zeros(2, 3, 500, 64, dtype=torch.bfloat16)
    r.add_to(out)
    assert torch.allclose(out.float(), r.decode(torch.float32), rtol=1e-2, atol=1e-6)
    assert torch.equal(r.batch_slice(1, 2).data.view(torch.uint8), r.data[1:2].view(torch.uint8))
    model = Residual.encode(diff, "model")
    assert model.scale is None and model.data is diff
    with pytest.raises(ValueError, match="precision"):
        Residual.encode(diff, "fp4")
    with pytest.raises(ValueError, match="residual_precision"):
        SparseConfig(residual_precision="int8")


def test_fp8_residual_keeps_the_reuse_error(problem):
    full, _ = run_engine(SparseConfig(method="mc_sparse", residual_precision="model", **BASE), problem, 6)
    fp8, stats = run_engine(SparseConfig(method="mc_sparse", **BASE), problem, 6)
    without, _ = run_engine(SparseConfig(method="mc_sparse", residual=False, **BASE), problem, 6)
    assert stats.totals()["reuses"] == 4
    for a, b, c in zip(full[2:], fp8[2:], without[2:]):
        assert b < c and abs(b - a) < 0.05 * a  # fp8 storage moves the reuse error by under 5 %


def test_density_accounting_is_exact(problem):
    n = problem.n
    cfg = SparseConfig(method="static", **BASE)
    sel = build_static(1, 2, n, problem.layout, cfg, "cpu")
    allow = torch.zeros(n, n, dtype=torch.bool)
    for r in range(sel.kv_counts.shape[-1]):
        for j in sel.kv_indices[0, 0, r, :sel.kv_counts[0, 0, r]].tolist():
            allow[r * 64:(r + 1) * 64, j * 64:(j + 1) * 64] = True
    assert abs(sel.density - float(allow.double().mean())) < 1e-12
    assert abs(block_pairs_fraction(sel.kv_indices, sel.kv_counts, n, n, 64, 64) - sel.density) < 1e-12
    _, stats = run_engine(cfg, problem, 3)
    layer = stats.layers[0]
    assert layer.calls == 3 and layer.dense == 1
    assert abs(layer.density - (1.0 + 2 * sel.density) / 3) < 1e-9


@pytest.mark.parametrize("method", ["mc_sparse", "block_topk"])
def test_densities_stay_on_the_device_until_the_statistics_are_read(problem, method):
    """An anchor's selection keeps its exact density as a 0-d tensor (counting its pairs never waits for the
    device); its reuse calls share that tensor; the statistics read each one once, after the run, to the float the
    selection's lists give. A block selection also carries the plan's density, a float, which picks its anchor's
    path."""
    eng = SparseEngine(SparseConfig(method=method, **BASE))
    eng.begin_run()
    for s in range(4):
        q, k, v = problem.qkv(s)
        eng.attend(q, k, v, CallContext(layer=0, step=s, layout=problem.layout))
    pending = eng.stats.layers[0].density_pending
    assert len(pending) == 3 and all(isinstance(d, torch.Tensor) and d.dim() == 0 for d in pending)
    assert pending[1] is pending[0] and pending[2] is pending[0]  # the anchor's and its two reuse calls'
    (entry,) = eng.cache.on_device.values()
    sel = entry.selection
    if method == "block_topk":
        assert isinstance(sel.planned, float) and abs(sel.planned - float(sel.density)) < 0.05
        exact = block_pairs_fraction(sel.kv_indices, sel.kv_counts, problem.n, problem.n, 64, 64)
    else:
        groups = (sel.q_groups >= 0).sum(-1).double()
        rows = 0 if sel.dense_rows is None else sel.dense_rows.numel()
        exact = (float((groups * sel.kv_counts.double()).sum()) + 2 * rows * problem.n) / (2 * problem.n ** 2)
    stats = eng.end_run()
    layer = stats.layers[0]
    assert layer.density_pending == [] and layer.density == pytest.approx((1.0 + 3 * exact) / 4, rel=1e-12)
    assert stats.totals()["density"] == pytest.approx(layer.density, rel=1e-12)


def test_the_block_plan_reads_its_widths_once(problem):
    """The plan's host facts equal what the device would give, and top-k with them keeps exactly what it keeps
    reading the counts back (two key segments: text and video)."""
    from comfyui_sparse_attention.engine.block_geometry import block_plan, rows_topk_by_segment
    cfg = SparseConfig(method="block_topk", **BASE)
    plan = block_plan(problem.n, problem.layout, cfg, "cpu")
    assert len(plan.seg_cols) == plan.counts.shape[-1] == 2
    assert list(plan.seg_widths) == plan.counts.amax(0).tolist() and plan.width == int(plan.counts.sum(-1).max())
    for s, cols in enumerate(plan.seg_cols):
        assert torch.equal(cols, torch.nonzero(plan.owner == s).view(-1))
    scores = torch.rand(1, 2, *plan.near.shape, generator=torch.Generator().manual_seed(1))
    counts = plan.counts.expand(1, 2, -1, -1)
    with_plan = rows_topk_by_segment(scores, plan.owner, counts, plan)
    read_back = rows_topk_by_segment(scores, plan.owner, counts)
    assert all(torch.equal(a, b) for a, b in zip(with_plan, read_back))
    exact = block_pairs_fraction(*with_plan, problem.n, problem.n, 64, 64)
    assert plan.density == pytest.approx(exact, rel=0.02)  # each block counted at its segment's mean size


@pytest.mark.parametrize("density", [0.4, 0.2])
def test_the_hybrid_plan_is_kept_and_selects_what_the_window_and_top_k_select(density):
    """The hybrid policy's plan (the block plan with the static half's windows forced, kept like the plan): its
    counts and host facts equal what the device gives, and the selection equals the one made without it (forced
    window blocks set from the window's lists, counts raised to them, widths read back). The windows, at half the
    density and counting the plan's forced blocks, never need more than the plan's counts, so the counts stay the
    plan's (``with_forced`` raises counts only for a superset that would not fit)."""
    from comfyui_sparse_attention.engine.block_geometry import block_plan, rows_topk_by_segment
    from comfyui_sparse_attention.engine.policy_block_topk import build_block_topk, hybrid_plan, size_weighted
    from comfyui_sparse_attention.engine.policy_static import static_window
    problem = SyntheticVideoAttention(frames=8, height=16, width=16, text=32, heads=2, head_dim=32, steps=2, seed=5)
    cfg = SparseConfig(method="hybrid", **{**BASE, "density": density})
    n = problem.n
    hp = hybrid_plan(n, problem.layout, cfg, "cpu")
    assert hybrid_plan(n, problem.layout, cfg, torch.device("cpu")) is hp
    plan = block_plan(n, problem.layout, cfg, "cpu")
    win_idx, win_cnt = static_window(n, problem.layout, cfg, "cpu", scale=0.5)
    forced = plan.forced.clone()
    for r in range(win_idx.shape[0]):
        forced[r, win_idx[r, :win_cnt[r]].long()] = True
    assert torch.equal(hp.forced, forced) and not torch.equal(forced, plan.forced)
    onehot = torch.nn.functional.one_hot(plan.owner, plan.counts.shape[-1]).float()
    counts = torch.maximum(plan.counts, (forced.float() @ onehot).long())
    assert torch.equal(hp.counts, counts)
    assert torch.equal(counts, plan.counts)
    assert list(hp.seg_widths) == counts.amax(0).tolist() and hp.width == int(counts.sum(-1).max())
    q, k, _ = problem.qkv(0)
    sel = build_block_topk(q, k, problem.layout, cfg, hybrid=True)
    pooled = size_weighted(kernels.pooled_block_scores(q, k, block_q=64, block_k=64), n, 64)
    scores = torch.where(forced, torch.full_like(pooled, float("inf")), pooled)
    idx, cnt = rows_topk_by_segment(scores, plan.owner, counts.expand(*q.shape[:2], -1, -1).contiguous())
    assert torch.equal(sel.kv_indices, idx) and torch.equal(sel.kv_counts, cnt)
    assert sel.planned == hp.density == pytest.approx(float(sel.density), rel=0.02)


def test_mc_sparse_lists_are_as_wide_as_their_bound(problem):
    """The lists' width is known without reading the counts back. Short key segments keep exactly their budget
    (keep_top's bisection): video keys 0.15 x 1024 plus the 32 text keys (a dense pair), rounded up to 16. A key
    segment longer than 4 x 4096 tokens keeps a sampled threshold's count, capped at keep_bound (docs/kernel_notes.md,
    "v27"): its lists are keep_bound wide, also where the sample misleads every row (keys at the sampled columns that
    hold no mass: every row over the cap keeps exactly its keep_bound largest keys, a subset of what it kept uncapped);
    without the cap (cap=False) the width is the widest row's, read back."""
    from comfyui_sparse_attention.engine.block_geometry import SAMPLE, keep_bound
    from comfyui_sparse_attention.engine.policy_mc_sparse import build_mc_sparse
    from comfyui_sparse_attention.kernels.compact_torch import decode_lists
    cfg = SparseConfig(method="mc_sparse", **BASE)
    q, k, v = problem.qkv(0)
    lse = kernels.attention_dense(q, k, v, return_lse=True, backend="torch")[1]
    sel = build_mc_sparse(q, k, lse, problem.layout, cfg, backend="torch")
    assert sel.kv_low.shape[-1] == 192 and int(sel.kv_counts.max()) <= 154 + 32
    n = 4 * 4096 + 64
    g = torch.Generator().manual_seed(2)
    q, k = (torch.randn(1, 1, n, 64, generator=g) for _ in range(2))
    lse = torch.logsumexp(q[0, 0] @ k[0, 0].T / 8.0, -1).view(1, 1, n)
    bound = keep_bound(round(0.15 * n), n)
    assert round(0.15 * n) < bound < 1.2 * round(0.15 * n)
    sel = build_mc_sparse(q, k, lse, TokenLayout(), cfg, backend="torch")
    assert sel.kv_low.shape[-1] == -(-bound // 16) * 16 and int(sel.kv_counts.max()) <= bound
    free = build_mc_sparse(q, k, lse, TokenLayout(), cfg, backend="torch", cap=False)
    assert free.kv_low.shape[-1] == -(-int(free.kv_counts.max()) // 16) * 16
    assert torch.equal(sel.kv_counts, free.kv_counts.clamp(max=bound))  # random keys: few rows, if any, over it
    # a misleading sample: the keys at the sampled columns point away from every query, so the sampled threshold
    # lies below nearly every other key's mass and every row goes over the cap
    step = n / SAMPLE
    sampled = (torch.arange(SAMPLE, dtype=torch.float64) * step + step / 2).long()
    q = q.abs() + 1.0
    k = k.clone()
    k[..., sampled, :] = -k[..., sampled, :].abs() - 1.0
    lse = torch.logsumexp(q[0, 0] @ k[0, 0].T / 8.0, -1).view(1, 1, n)
    sel = build_mc_sparse(q, k, lse, TokenLayout(), cfg, backend="torch")
    free = build_mc_sparse(q, k, lse, TokenLayout(), cfg, backend="torch", cap=False)
    assert bool((free.kv_counts > 2 * bound).all()) and bool((sel.kv_counts == bound).all())
    assert sel.kv_low.shape[-1] == -(-bound // 16) * 16
    capped, loose = (decode_lists(s.kv_low, s.seg_ends)[0, 0] for s in (sel, free))
    for r in (0, capped.shape[0] - 1):  # each capped row's keys are among the uncapped row's
        kept = set(capped[r, :bound].tolist())
        assert len(kept) == bound and kept <= set(loose[r, :int(free.kv_counts[0, 0, r])].tolist())


def test_token_selection_compaction_round_trips():
    g = torch.Generator().manual_seed(0)
    n = 150_000  # spans three 65536-token segments
    lists = torch.sort(torch.stack([torch.randperm(n, generator=g)[:500] for _ in range(6)]), -1).values
    tokens = lists.view(1, 2, 3, 500).to(torch.int32)
    counts = torch.tensor([[[500, 480, 0], [1, 500, 250]]], dtype=torch.int32)
    tokens = torch.where(torch.arange(500) < counts.unsqueeze(-1), tokens, torch.full_like(tokens, -1))
    sel = TokenSelection(torch.zeros(1, 2, 3, 64, dtype=torch.int32), *TokenSelection.compact(tokens, counts), counts,
                         None, 0.1)
    decoded = sel.kv_tokens()
    assert decoded.shape[-1] == 512  # the width rounded up to a multiple of 16: one kernel specialisation
    decoded = decoded[..., :500]
    valid = torch.arange(500) < counts.unsqueeze(-1)
    assert torch.equal(decoded[valid], tokens[valid])
    assert sel.kv_low.element_size() == 2
    one = sel.head(0, 1)  # one head alone decodes to the same lists
    assert one.kv_low.shape[:2] == (1, 1) and one.kv_low.data_ptr() == sel.kv_low[0, 1].data_ptr()
    assert torch.equal(one.kv_tokens()[0, 0, :, :500][valid[0, 1]], tokens[0, 1][valid[0, 1]])


def _entry(seed, n=4096):
    g = torch.Generator().manual_seed(seed)
    sel = build_static(1, 2, n, TokenLayout(grid=(4, 32, 32)), SparseConfig(block_q=64, block_k=64), "cpu")
    return Entry(sel, Residual(torch.randn(1, 2, n, 64, generator=g)))


def test_cpu_side_leaves_the_host_its_reserve(monkeypatch):
    import comfyui_sparse_attention.engine.cache as cache_mod
    e = _entry(0)
    gib = 2**30
    cache = SelectionCache(device_budget=0, cpu_budget=10**12, offload=True)
    monkeypatch.setattr(cache_mod, "host_memory", lambda: (40 * gib, 128 * gib))  # reserve: 32 GiB of 128
    assert cache.put(("a",), e) == "cpu"
    monkeypatch.setattr(cache_mod, "host_memory", lambda: (32 * gib + e.host_nbytes - 1, 128 * gib))
    # pinning it would eat into the reserve: its selection alone goes (a few KB), its residual is dropped
    assert cache.put(("b",), _entry(1)) == "cpu-no-residual" and cache.on_cpu[("b",)].residual is None
    monkeypatch.setattr(cache_mod, "host_memory", lambda: (9 * gib, 16 * gib))  # small host: the 8 GiB floor
    assert cache.put(("c",), _entry(2)) == "cpu"
    monkeypatch.setattr(cache_mod, "host_memory", lambda: None)  # unknown: only cpu_budget limits
    assert cache.put(("d",), _entry(3)) == "cpu"
    # pinned blocks torch's host allocator caches (freed by earlier entries) count as available
    monkeypatch.setattr(cache_mod, "host_memory", lambda: (32 * gib + e.nbytes - 1, 128 * gib))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "host_memory_stats", lambda: {"allocated_bytes.current": 5 * gib,
                                                                  "active_bytes.current": 4 * gib}, raising=False)
    assert cache_mod.cached_pinned_bytes() == gib
    assert cache._cpu_fits(e.nbytes)
    real = host_memory()  # this machine's own reading (Linux: /proc/meminfo)
    assert real is None or 0 < real[0] <= real[1]


def test_cache_offload_round_trips_exactly_and_falls_back(monkeypatch):
    import comfyui_sparse_attention.engine.cache as cache_mod
    monkeypatch.setattr(cache_mod, "host_memory", lambda: None)  # whatever this machine has free

    def entry(seed, n=4096):
        g = torch.Generator().manual_seed(seed)
        sel = build_static(1, 2, n, TokenLayout(grid=(4, 32, 32)), SparseConfig(block_q=64, block_k=64), "cpu")
        return Entry(sel, Residual(torch.randn(1, 2, n, 64, generator=g)))
    e0, e1, e2 = entry(0), entry(1), entry(2)
    size = e0.nbytes
    cache = SelectionCache(device_budget=size + 10, cpu_budget=size + 10, offload=True)
    assert cache.put(("a",), e0) == "device"
    assert cache.put(("b",), e1) == "cpu"
    assert cache.put(("c",), e2) == "cpu-no-residual"  # the selection alone, within SELECTION_SLACK of the budget
    back = cache.get(("b",), "cpu")
    assert torch.equal(back.residual.data, e1.residual.data)
    assert torch.equal(back.selection.kv_indices, e1.selection.kv_indices)
    assert back.residual.data.data_ptr() != e1.residual.data.data_ptr()  # a real copy was stored
    tiny = SelectionCache(device_budget=10, cpu_budget=10, offload=True)
    assert tiny.put(("d",), entry(3)) == "none"
    assert ("d",) in tiny.fallback_keys and tiny.counters["fallbacks"] == 1


def test_auto_budget_off_cuda_and_config_forms(monkeypatch):
    import comfyui_sparse_attention.engine.cache as cache_mod
    assert SparseConfig().cache_budget_mb == "auto"
    assert SparseEngine(SparseConfig()).cache.device_budget is None
    assert SparseEngine(SparseConfig(cache_budget_mb=1)).cache.device_budget == 2**20
    for bad in ("lots", -1, True):
        with pytest.raises(ValueError, match="cache_budget_mb"):
            SparseConfig(cache_budget_mb=bad)
    sel = build_static(1, 2, 4096, TokenLayout(grid=(4, 32, 32)), SparseConfig(block_q=64, block_k=64), "cpu")
    e = Entry(sel, Residual(torch.zeros(1, 2, 4096, 64)))
    monkeypatch.setattr(cache_mod, "AUTO_NON_CUDA_BYTES", int(1.5 * e.nbytes))
    cache = SelectionCache(device_budget=None, cpu_budget=0, offload=True)
    assert cache.put(("a",), e) == "device"
    assert cache.put(("b",), Entry(sel, Residual(e.residual.data.clone()))) == "device-no-residual"  # the cap holds


def _oom_for(eng, monkeypatch, failures: int):
    """Make the engine's next ``failures`` anchor attempts run out of memory; returns the attempt log."""
    real, calls = eng._anchor, []

    def tight(*args):
        calls.append(1)
        if len(calls) <= failures:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(*args)
    monkeypatch.setattr(eng, "_anchor", tight)
    return calls


def test_out_of_memory_at_an_anchor_spills_the_cache_and_retries(problem, monkeypatch):
    eng = SparseEngine(SparseConfig(method="mc_sparse", **BASE))
    eng.begin_run()
    q, k, v = problem.qkv(1)
    key = lambda layer: (layer, True, (), q.shape[2])  # noqa: E731
    for layer in (0, 1):
        eng.attend(q, k, v, CallContext(layer=layer, step=1, layout=problem.layout))
    assert len(eng.cache.on_device) == 2
    calls = _oom_for(eng, monkeypatch, 1)
    out = eng.attend(q, k, v, CallContext(layer=2, step=1, layout=problem.layout))
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert rel_l2(out, dense) < 1e-5 and len(calls) == 2  # retried once, anchors return the dense output
    info = eng.cache.info()
    # the first out-of-memory moves half the cache, least recently used first: layer 0 goes, layer 1 stays
    assert info["spills"] == 1 and key(0) in eng.cache.on_cpu and key(1) in eng.cache.on_device
    assert eng.cache.auto_limit == eng.cache.on_device[key(1)].nbytes  # the device cache may not grow back
    out = eng.attend(q, k, v, CallContext(layer=0, step=2, layout=problem.layout))  # reuse from the CPU side
    assert rel_l2(out, dense) < 0.05
    eng.end_run()
    assert eng.cache.auto_limit is None  # the next run starts with the full auto budget


def test_an_anchor_lets_its_keys_old_entry_go_before_it_runs(problem, monkeypatch):
    """A later anchor replaces its layer's entry: the old one is dropped before the anchor computes (it would sit
    beside the anchor's scratch), and an out-of-memory spill during that anchor moves another layer's entry, never
    the one about to be replaced; the other layer's entry is still reused from host memory at the next step."""
    eng = SparseEngine(SparseConfig(method="mc_sparse", **{**BASE, "warmup_steps": 0, "anchor_steps": "0,2"}))
    eng.begin_run()
    layers = (0, 1)
    for step in (0, 1):
        q, k, v = problem.qkv(step)
        for layer in layers:
            eng.attend(q, k, v, CallContext(layer=layer, step=step, layout=problem.layout))
    q, k, v = problem.qkv(2)
    key = lambda layer: (layer, True, (), q.shape[2])  # noqa: E731
    old = {layer: eng.cache.on_device[key(layer)] for layer in layers}
    real, stored_at_anchor = eng._anchor, []

    def watched(q_, k_, v_, ctx, key_, *rest):
        stored_at_anchor.append(key_ in eng.cache)
        return real(q_, k_, v_, ctx, key_, *rest)
    monkeypatch.setattr(eng, "_anchor", watched)
    moved = []
    to_host = eng.cache._to_host
    monkeypatch.setattr(eng.cache, "_to_host", lambda entry: moved.append(entry) or to_host(entry))
    calls = _oom_for(eng, monkeypatch, 1)  # layer 0's anchor at step 2 runs out of memory once
    eng.attend(q, k, v, CallContext(layer=0, step=2, layout=problem.layout))
    assert len(calls) == 2 and eng.cache.info()["spills"] == 1
    assert stored_at_anchor == [False]  # the retried call: the first attempt failed before reaching it
    # the spill moved layer 1's entry to host memory, never layer 0's old one (after the spill the cache may keep no
    # more on the device than stayed there, so layer 0's new entry follows it)
    assert moved[0] is old[1] and all(m is not old[0] for m in moved)
    assert key(1) in eng.cache.on_cpu and key(0) in eng.cache and eng.cache.peek(key(0)) is not old[0]
    eng.attend(q, k, v, CallContext(layer=1, step=2, layout=problem.layout))  # its host entry is dropped first too
    assert stored_at_anchor == [False, False] and eng.cache.peek(key(1)) is not old[1]
    eng.end_run()


def test_out_of_memory_twice_spills_everything_then_reports(problem, monkeypatch):
    eng = SparseEngine(SparseConfig(method="mc_sparse", **BASE))
    eng.begin_run()
    q, k, v = problem.qkv(1)
    for layer in (0, 1):
        eng.attend(q, k, v, CallContext(layer=layer, step=1, layout=problem.layout))
    calls = _oom_for(eng, monkeypatch, 2)
    eng.attend(q, k, v, CallContext(layer=2, step=1, layout=problem.layout))
    assert len(calls) == 3 and eng.cache.info()["spills"] == 2
    # everything left the GPU and the run's cache stays on the CPU side from here on
    assert not eng.cache.on_device and len(eng.cache.on_cpu) == 3 and eng.cache.auto_limit == 0
    calls = _oom_for(eng, monkeypatch, 10)  # nothing left to move: the error reaches the caller
    with pytest.raises(torch.OutOfMemoryError):
        eng.attend(q, k, v, CallContext(layer=3, step=1, layout=problem.layout))


def test_budget_fallback_never_fails_the_run(problem):
    cfg = SparseConfig(method="mc_sparse", cache_budget_mb=0.0001, cpu_budget_mb=0.0001, **BASE)
    errs, stats = run_engine(cfg, problem, 4)
    t = stats.totals()
    assert t["fallbacks"] == 2 and t["anchors"] == 1   # anchor at step 1, dense fallback afterwards
    assert max(errs) < 1e-5  # fallback calls are dense
    assert stats.cache["fallbacks"] == 1


def test_memory_is_released_after_a_run(problem):
    cfg = SparseConfig(method="mc_sparse", **BASE)
    eng = SparseEngine(cfg)
    eng.begin_run()
    for s in range(3):
        q, k, v = problem.qkv(s)
        eng.attend(q, k, v, CallContext(layer=0, step=s, layout=problem.layout))
    entry = next(iter(eng.cache.on_device.values()))
    refs = [weakref.ref(t) for t in entry.selection.tensors()] + [weakref.ref(t) for t in entry.residual.tensors()]
    del entry
    assert eng.cache.device_bytes > 0
    stats = eng.end_run()
    gc.collect()
    assert eng.cache.device_bytes == 0 and eng.cache.cpu_bytes == 0
    assert all(r() is None for r in refs)
    assert stats.cache["peak_device_bytes"] > 0
    assert "calls" in stats.summary_line() and stats.as_dict()["totals"]["anchors"] == 1


def test_every_method_runs_and_reports(problem):
    for method in ("static", "block_topk", "hybrid", "mc_sparse", "dense"):
        errs, stats = run_engine(SparseConfig(method=method, **BASE), problem, 3, layers=(0, 1))
        assert all(e == e and e < 1.0 for e in errs), method  # finite, not NaN
        assert stats.totals()["calls"] == 6


def test_demo_runs_on_cpu():
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "tools" / "demo.py"), "--cpu", "--steps", "4", "--layers", "1",
                           "--warmup", "1", "--anchors", ""], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("| mc_sparse |")]
    assert lines and float(lines[0].split("|")[4]) < 0.2


def _offload_entry(seed, n=4096):
    g = torch.Generator().manual_seed(seed)
    sel = build_static(1, 1, n, TokenLayout(grid=(4, 32, 32)), SparseConfig(block_q=64, block_k=64), "cpu")
    return Entry(sel, Residual(torch.randn(1, 1, n, 64, generator=g)))


def test_the_step_after_an_anchor_step_prefetches_in_the_order_it_stored():
    """An anchor step only stores; its stores stand for its accesses, so the first reuse step after it prefetches
    (docs/benchmarks.md, "A second anchor": 10 on-demand fetches and no prefetch in that step before)."""
    cache = SelectionCache(device_budget=0, cpu_budget=1 << 30, offload=True)
    for i, k in enumerate(["l0", "l1", "l2"]):  # the anchor step
        assert cache.put((k,), _offload_entry(i)) == "cpu"
    cache.new_step()
    cache.get(("l0",), "cpu")  # the reuse step: l0 on demand, l1 on its way
    assert cache.counters["fetched"] == 1 and ("l1",) in cache.prefetched
    cache.get(("l1",), "cpu")
    assert cache.counters["fetched"] == 1 and cache.counters["prefetched"] == 2
    assert cache.info()["cpu_layers"] == ["l0", "l1", "l2"]  # where each layer's entry lives (docs/benchmarks.md)


def test_offloaded_entries_are_prefetched_in_the_previous_steps_order():
    def entry(seed, n=4096):
        g = torch.Generator().manual_seed(seed)
        sel = build_static(1, 1, n, TokenLayout(grid=(4, 32, 32)), SparseConfig(block_q=64, block_k=64), "cpu")
        return Entry(sel, Residual(torch.randn(1, 1, n, 64, generator=g)))
    entries = {k: entry(i) for i, k in enumerate(["l0", "l1", "l2"])}
    cache = SelectionCache(device_budget=0, cpu_budget=1 << 30, offload=True)  # everything lives on the CPU side
    for k, e in entries.items():
        assert cache.put((k,), e) == "cpu"
    for k in entries:                      # step 1: fetched on demand, the order is recorded
        cache.get((k,), "cpu")
    assert cache.counters["fetched"] == 3 and cache.counters["prefetched"] == 0
    cache.new_step()
    got = cache.get(("l0",), "cpu")        # step 2: using l0 starts the copy of l1 (next in step 1's order)
    assert ("l1",) in cache.prefetched and cache.counters["prefetched"] == 1
    assert cache.counters["fetched"] == 4  # l0 itself had to be fetched on demand
    got1 = cache.get(("l1",), "cpu")       # served from the prefetch, which in turn starts l2
    assert cache.counters["fetched"] == 4 and ("l2",) in cache.prefetched
    assert torch.equal(got1.residual.data, entries["l1"].residual.data)
    assert torch.equal(got.residual.data, entries["l0"].residual.data)


def test_reuse_calls_of_a_stored_entry_go_through_its_replay(monkeypatch):
    """The engine hands a stored device entry's reuse calls to that entry's kernels.CallReplay (kernels/replay.py),
    keyed on the scale and backend; an anchor's new entry gets a new one; the output is the replay's."""
    from comfyui_sparse_attention import kernels
    seen = []

    class Spy(kernels.CallReplay):
        def run(self, fn, q, k, v, key=()):
            seen.append((self, key))
            return super().run(fn, q, k, v, key)
    monkeypatch.setattr(kernels, "CallReplay", Spy)
    layout = TokenLayout(text_len=0, grid=(2, 16, 16))
    eng = SparseEngine(SparseConfig(method="block_topk", density=0.3, block_q=64, block_k=64, min_tokens=0,
                                    anchor_steps="0,3"))
    q, k, v = (torch.randn(1, 2, 512, 32) for _ in range(3))
    eng.begin_run()
    outs = []
    for step in range(5):
        outs.append(eng.attend(q, k, v, CallContext(layer=0, step=step, total_steps=5, layout=layout), scale=0.2))
    entry = eng.cache.on_device[CallContext(layer=0, step=0, layout=layout).key(512)]
    eng.end_run()
    assert [key for _, key in seen] == [(0.2, "auto")] * 3
    assert seen[0][0] is seen[1][0] and seen[2][0] is not seen[0][0] and seen[2][0] is entry.replay
    ref = entry.selection.run(q, k, v, scale=0.2, residual=entry.residual)
    assert torch.equal(outs[4], ref)


def test_a_policy_that_selects_at_every_step_is_never_replayed(monkeypatch):
    """select_every_step makes a new selection at each reuse call: replaying the anchor's would reuse a stale one."""
    from comfyui_sparse_attention import kernels
    made = []

    class Spy(kernels.CallReplay):
        def __init__(self):
            made.append(self)
            super().__init__()
    monkeypatch.setattr(kernels, "CallReplay", Spy)
    layout = TokenLayout(text_len=0, grid=(2, 16, 16))
    eng = SparseEngine(SparseConfig(method="block_topk", density=0.3, block_q=64, block_k=64, min_tokens=0,
                                    anchor_steps="0", select_every_step=True))
    eng.begin_run()
    for step in range(4):
        q, k, v = (torch.randn(1, 2, 512, 32) for _ in range(3))
        eng.attend(q, k, v, CallContext(layer=0, step=step, total_steps=4, layout=layout))
    eng.end_run()
    assert not made


def test_the_block_plan_is_built_once_per_geometry_and_configuration():
    """engine/block_geometry.block_plan keeps its plans: the same arguments give the same plan object (equal to one
    built afresh); another density, layout, block size or token count gives another."""
    from comfyui_sparse_attention.engine import block_geometry as bg
    layout = TokenLayout(text_len=16, grid=(4, 16, 16))
    cfg = SparseConfig(method="block_topk", density=0.3, block_q=64, block_k=64)
    plan = bg.block_plan(1040, layout, cfg, "cpu")
    assert bg.block_plan(1040, layout, cfg, torch.device("cpu")) is plan
    fresh = bg._build_plan(1040, layout, cfg, "cpu", 1.0)
    for name in ("forced", "near", "owner", "counts", "dense_pair"):
        assert torch.equal(getattr(plan, name), getattr(fresh, name)), name
    others = [bg.block_plan(1040, layout, cfg.replace(density=0.1), "cpu"),
              bg.block_plan(1040, TokenLayout(text_len=16, grid=(4, 32, 8)), cfg, "cpu"),
              bg.block_plan(1040, layout, cfg.replace(block_k=128), "cpu"),
              bg.block_plan(1040, layout, cfg, "cpu", scale=0.5),
              bg.block_plan(2064, TokenLayout(text_len=16, grid=(8, 16, 16)), cfg, "cpu")]
    assert all(o is not plan for o in others)
    assert not torch.equal(others[0].counts, plan.counts)


def test_the_kept_block_plans_are_bounded(monkeypatch):
    from comfyui_sparse_attention.engine import block_geometry as bg
    monkeypatch.setattr(bg, "PLANS_KEPT", 2)
    monkeypatch.setattr(bg, "_plans", bg.OrderedDict())
    cfg = SparseConfig(method="block_topk", density=0.3, block_q=64, block_k=64)
    layouts = [TokenLayout(text_len=0, grid=(1, 8, 8 * i)) for i in (1, 2, 3)]
    first = bg.block_plan(64, layouts[0], cfg, "cpu")
    bg.block_plan(128, layouts[1], cfg, "cpu")
    bg.block_plan(192, layouts[2], cfg, "cpu")
    assert len(bg._plans) == 2 and bg.block_plan(64, layouts[0], cfg, "cpu") is not first


def test_the_kept_block_plans_are_bounded_in_bytes(monkeypatch):
    """Plans hold device memory between runs: beyond PLAN_BYTES_KEPT besides the newest, the oldest go."""
    from comfyui_sparse_attention.engine import block_geometry as bg
    monkeypatch.setattr(bg, "_plans", bg.OrderedDict())
    cfg = SparseConfig(method="block_topk", density=0.3, block_q=64, block_k=64)
    layouts = [TokenLayout(text_len=0, grid=(1, 64, 8 * i)) for i in (1, 2, 3)]
    plans = [bg.block_plan(512 * i, layouts[i - 1], cfg, "cpu") for i in (1, 2)]
    monkeypatch.setattr(bg, "PLAN_BYTES_KEPT", bg._plan_bytes(plans[1]))
    newest = bg.block_plan(1536, layouts[2], cfg, "cpu")
    assert [id(p) for p in bg._plans.values()] == [id(plans[1]), id(newest)]
    monkeypatch.setattr(bg, "PLAN_BYTES_KEPT", 0)
    bg.block_plan(512, layouts[0], cfg, "cpu")
    assert len(bg._plans) == 1  # the newest alone, whatever its size


@pytest.mark.parametrize("method", ["mc_sparse", "block_topk"])
def test_grouped_query_kv_stay_grouped_for_dense_calls_and_are_repeated_for_sparse_ones(problem, method):
    """OmniGen2 / Boogu pass k/v with fewer heads: a dense call (warm-up) hands them to the model's own attention as
    they are (no copy), the sparse path repeats them to the query heads, exactly as torch's enable_gqa reads them."""
    q, k, v = problem.qkv(1)  # 2 heads
    kg, vg = k[:, :1], v[:, :1]  # one k/v head shared by both query heads
    seen = []

    def dense_fn(dq, dk, dv):
        seen.append(dk.shape[1])
        return torch.nn.functional.scaled_dot_product_attention(dq, dk, dv, enable_gqa=True)
    eng = SparseEngine(SparseConfig(method=method, **{**BASE, "density": 1.0, "warmup_steps": 1}))
    eng.begin_run()
    want = torch.nn.functional.scaled_dot_product_attention(q, kg, vg, enable_gqa=True)
    for step in (0, 1, 2):  # warm-up (dense), anchor, reuse
        out = eng.attend(q, kg, vg, CallContext(layer=0, step=step, layout=problem.layout), dense_fn=dense_fn)
        assert torch.allclose(out, want, atol=1e-4), step
    assert seen and set(seen) == {1}  # the dense calls got the grouped k/v as they are
    assert eng.end_run(log_summary=False).totals()["anchors"] == 1


@pytest.mark.parametrize("method", ["block_topk", "mc_sparse"])
def test_a_run_outside_inference_mode_after_one_inside(problem, method):
    """ComfyUI samples under torch.inference_mode; a later run outside it (another tool in the process) must work: the
    CPU twins' reused gather buffers (kernels/_gather.py, Scratch), made inside, were inference tensors, which PyTorch
    lets no one write outside that mode; they are now made outside it. Both runs give the same outputs."""
    from comfyui_sparse_attention.kernels._gather import Scratch
    cfg = SparseConfig(method=method, **{**BASE, "anchor_steps": "0"})
    q, k, v = problem.qkv(0)
    ctx = [CallContext(layer=0, step=s, total_steps=4, layout=problem.layout) for s in (0, 1)]

    def run():
        eng = SparseEngine(cfg)
        eng.begin_run()
        outs = [eng.attend(q, k, v, c) for c in ctx]
        eng.end_run(log_summary=False)
        return outs

    with torch.inference_mode():
        inside = run()
    outside = run()
    assert all(torch.equal(a, b) for a, b in zip(inside, outside))
    src, idx = torch.randn(6, 3), torch.tensor([5, 0, 2])
    with torch.inference_mode():
        Scratch.get(torch.float32, torch.device("cpu")).take("t", src, idx)
    got = Scratch.get(torch.float32, torch.device("cpu")).take("t", src, idx)
    assert not got.is_inference() and torch.equal(got, src[idx])
