"""Per-layer and per-head densities (engine/layer_density.py): the configuration form, concatenating selections
along heads, exact density accounting, and the engine honouring the densities for every method. CPU only."""

import dataclasses

import pytest
import torch

from comfyui_sparse_attention import kernels
from comfyui_sparse_attention.engine import CallContext, SparseConfig, SparseEngine
from comfyui_sparse_attention.engine.layer_density import (anchor_factor, config_at, head_densities,
                                                           layer_densities_dict, layer_densities_text,
                                                           parse_anchor_factors, parse_layer_densities)
from comfyui_sparse_attention.engine.policy import policy_for
from comfyui_sparse_attention.engine.selection import BlockSelection, TokenSelection, block_pairs_fraction
from comfyui_sparse_attention.engine.synthetic import SyntheticVideoAttention
from comfyui_sparse_attention.engine.widgets import config_from_widgets

METHODS = ("block_topk", "mc_sparse", "static", "hybrid")


@pytest.fixture(scope="module")
def problem():
    """2 112 tokens (64 text + 8x16x16 grid): 32 image blocks of 64, so density steps of 1/32 are visible."""
    return SyntheticVideoAttention(frames=8, height=16, width=16, text=64, heads=4, head_dim=32, steps=4, seed=3)


def base_cfg(method, **kw):
    return SparseConfig(method=method, density=0.2, min_tokens=0, block_q=64, block_k=64, group_size=64,
                        backend="torch", **kw)


def head_density(sel, h: int, n: int) -> float:
    """Exact fraction of (query, key) pairs head h of batch row 0 computes."""
    if isinstance(sel, BlockSelection):
        return block_pairs_fraction(sel.kv_indices[:1, h:h + 1], sel.kv_counts[:1, h:h + 1], n, n, sel.block_q,
                                    sel.block_k)
    real_q = (sel.q_groups[0, h] >= 0).sum(-1).double()
    text = 0 if sel.dense_rows is None else sel.dense_rows.numel()
    return float((real_q * sel.kv_counts[0, h].double()).sum() + text * n) / (n * n)


def lists(sel, h: int) -> tuple:
    """Head h of batch row 0: (query groups or None, per row / group the selected blocks or tokens)."""
    if isinstance(sel, BlockSelection):
        idx, cnt = sel.kv_indices[0, h], sel.kv_counts[0, h]
        return None, [idx[r, :c].tolist() for r, c in enumerate(cnt.tolist())]
    toks, cnt = sel.head(0, h).kv_tokens()[0, 0], sel.kv_counts[0, h]
    return sel.q_groups[0, h].tolist(), [toks[g, :c].tolist() for g, c in enumerate(cnt.tolist())]


def same_head(a, ha: int, b, hb: int) -> bool:
    """Head ha of selection a selects exactly what head hb of selection b selects (batch row 0)."""
    return lists(a, ha) == lists(b, hb)


# configuration ------------------------------------------------------------------------------------------------
def test_forms_round_trip_and_errors_name_the_field(tmp_path):
    value = {0: 0.5, "2-3": [0.4, 1.6], "5,7": 2}
    parsed = parse_layer_densities(value)
    assert parsed == ((0, 0.5), (2, (0.4, 1.6)), (3, (0.4, 1.6)), (5, 2.0), (7, 2.0))
    assert parse_layer_densities(layer_densities_text(value)) == parsed
    assert parse_layer_densities("{0: 0.5, 2: [0.4, 1.6], 3: [0.4, 1.6], 5: 2, 7: 2}") == parsed
    assert parse_layer_densities(layer_densities_dict(parsed)) == parsed
    assert parse_layer_densities("") == () and layer_densities_text(()) == ""
    cfg = config_from_widgets({"layer_densities": "{1: [0.5, 1.5]}"})
    assert cfg.layer_densities == ((1, (0.5, 1.5)),)
    assert config_from_widgets({}).layer_densities == ()
    for bad in ({0: 0}, {0: -1.0}, {0: [1.0, "x"]}, {0: []}, {"a": 1.0}, {0: 1.0, "0-1": 2.0}, "[1, 2]",
                {True: 1.0}, "{0: [1, 2"):
        with pytest.raises(ValueError, match="layer_densities"):
            SparseConfig(layer_densities=bad)
    with pytest.raises(ValueError, match="layer_densities: cannot be combined with mass"):
        SparseConfig(method="block_topk", mass=0.9, layer_densities={0: 2.0})
    preset = tmp_path / "cal.yaml"
    preset.write_text("sparse:\n  method: block_topk\n  density: 0.1\n  layer_densities:\n    0: [0.5, 1.5]\n"
                      "    1: 1.25\n")
    assert SparseConfig.from_yaml(preset).layer_densities == ((0, (0.5, 1.5)), (1, 1.25))
    preset.write_text("sparse:\n  layer_densities: {0: [0.5, oops]}\n")
    with pytest.raises(ValueError, match=r"cal\.yaml: layer_densities: layer 0"):
        SparseConfig.from_yaml(preset)


def test_head_densities_scale_the_image_density_and_check_the_head_count():
    cfg = base_cfg("block_topk", layer_densities={0: [0.5, 2.0], 1: 3.0, 2: 10.0})
    assert head_densities(cfg, 0, 2) == pytest.approx((0.1, 0.4))
    assert head_densities(cfg, 1, 3) == pytest.approx((0.6,) * 3)
    assert head_densities(cfg, 2, 2) == (1.0, 1.0)  # capped at dense
    assert head_densities(cfg, 4, 2) is None
    cfg_i2i = cfg.replace(densities={"image_to_image": 0.3})
    assert head_densities(cfg_i2i, 0, 2) == pytest.approx((0.15, 0.6))
    with pytest.raises(ValueError, match="layer 0 lists 2 head densities but its attention has 4 heads"):
        head_densities(cfg, 0, 4)
    one = config_at(cfg_i2i, 0.25)
    assert one.image_density == 0.25 and one.layer_densities == ()


def test_anchor_factors_forms_and_errors_name_the_field(tmp_path):
    assert parse_anchor_factors([1.5, 1]) == (1.5, 1.0) == parse_anchor_factors("1.5, 1")
    assert parse_anchor_factors("[2, 0.5]") == (2.0, 0.5)
    assert parse_anchor_factors("") == () == parse_anchor_factors(None) == parse_anchor_factors("  ")
    assert parse_anchor_factors(" [ ] ") == ()
    assert SparseConfig(anchor_density_factors="1.5,0.8").anchor_density_factors == (1.5, 0.8)
    for bad in ("x", [0], [-1.0], [1.0, float("nan")], [True], "1,,2", [], {"a": 1}, [1.0] * 65, 2.0, [10 ** 400]):
        with pytest.raises(ValueError, match="anchor_density_factors"):
            SparseConfig(anchor_density_factors=bad)
    with pytest.raises(ValueError, match="anchor_density_factors: cannot be combined with mass"):
        SparseConfig(method="block_topk", mass=0.9, anchor_density_factors=[2.0, 0.5])
    preset = tmp_path / "anchors.yaml"
    preset.write_text("sparse:\n  method: mc_sparse\n  density: 0.1\n  anchor_density_factors: [1.5, 0.8]\n")
    assert SparseConfig.from_yaml(preset).anchor_density_factors == (1.5, 0.8)
    cfg = base_cfg("block_topk", anchor_density_factors=(2.0, 0.5), layer_densities={0: [0.5, 2.0]})
    assert [anchor_factor(cfg, i) for i in range(4)] == [2.0, 0.5, 0.5, 0.5]  # past the list: the last factor
    assert anchor_factor(base_cfg("block_topk"), 3) == 1.0
    assert head_densities(cfg, 0, 2, 2.0) == pytest.approx((0.2, 0.8))  # times the head's factor
    assert head_densities(cfg, 1, 3, 0.5) == pytest.approx((0.1,) * 3)  # an unlisted layer gets the anchor's
    assert head_densities(cfg, 0, 2, 10.0) == (1.0, 1.0)  # capped at dense
    assert head_densities(cfg, 1, 3) is None and config_at(cfg, 0.3).anchor_density_factors == ()


def test_anchor_spans_follow_the_schedule():
    """span_index: 0 from the first sparse step to the next anchor step, then 1, ...; -1 in the warm-up; listed
    steps, fractions and periodic anchors alike; an off-schedule step takes the span it lies in."""
    from comfyui_sparse_attention.engine.schedule import AnchorSchedule

    listed = AnchorSchedule.parse([2, 10])
    assert [listed.span_index(s, 2, 30) for s in (0, 1, 2, 3, 9, 10, 29)] == [-1, -1, 0, 0, 0, 1, 1]
    assert [listed.span_index(s, 0, 30) for s in (0, 1, 2, 10)] == [0, 0, 1, 2]  # step 0 anchors first
    assert [AnchorSchedule.parse("every 5").span_index(s, 1, 30) for s in (1, 5, 6, 11, 29)] == [0, 0, 1, 2, 5]
    fractions = AnchorSchedule.parse("20%, 50%")
    assert [fractions.span_index(s, 0, 20) for s in (0, 3, 4, 9, 10, 19)] == [0, 0, 1, 1, 2, 2]
    assert fractions.span_index(10, 0, None) == 0  # fractions of an unknown run resolve to nothing


@pytest.mark.parametrize("method", METHODS)
def test_each_anchor_selects_at_its_factor_and_a_new_run_starts_again(problem, method):
    """Anchors at steps 0, 2 and 3 with factors (1.5, 0.5): the first anchor's selection is the configuration's at
    density 0.3, the second's at 0.1, and the reuse steps report their anchor's density; the third span keeps the
    last factor; a second run starts from the first factor again. Layer 1 lists per-head factors on top."""
    cfg = base_cfg(method, anchor_steps=[0, 2, 3], anchor_density_factors=[1.5, 0.5],
                   layer_densities={1: [0.5, 2.0, 1.0, 1.0]})
    policy = policy_for(method)
    n = problem.qkv(0)[0].shape[2]
    eng = SparseEngine(cfg)
    for _ in range(2):
        eng.begin_run()
        sels = {}
        for step in range(4):
            q, k, v = problem.qkv(step)
            for layer in range(2):
                eng.attend(q, k, v, CallContext(layer=layer, step=step, layout=problem.layout))
                sels[step, layer] = eng.cache.peek(CallContext(layer=layer, step=step).key(n)).selection
        stats = eng.end_run()
        for step, factor in ((0, 1.5), (2, 0.5), (3, 0.5)):
            q, k, v = problem.qkv(step)
            lse = kernels.attention_dense(q, k, v, return_lse=True, backend="torch")[1] if policy.needs_lse else None
            for layer, heads in ((0, (1.0,) * 4), (1, (0.5, 2.0, 1.0, 1.0))):
                for h, f in enumerate(heads):
                    sl = slice(h, h + 1)
                    alone = policy.select(q[:, sl], k[:, sl], None if lse is None else lse[:, sl], problem.layout,
                                          config_at(cfg, min(1.0, 0.2 * factor * f)), scale=None, backend="torch")
                    assert same_head(sels[step, layer], h, alone, 0), (method, step, layer, h)
        d = [sum(head_density(sels[s, 0], h, n) for h in range(4)) / 4 for s in (0, 2)]
        assert d[0] > 2 * d[1]
        assert sels[1, 0] is sels[0, 0]  # step 1 reused the first anchor's selection
        assert stats.layers[0].density == pytest.approx((2 * d[0] + 2 * d[1]) / 4, rel=1e-9)


# concatenation along heads -------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["block_topk", "mc_sparse"])
def test_concat_heads_is_exact(problem, method):
    """Selections of head subsets at different densities, concatenated in a permuted order: every head selects and
    computes exactly what its part did, and the density is the exact pair count of the union."""
    q, k, v = problem.qkv(1)
    n = q.shape[2]
    policy = policy_for(method)
    lse = kernels.attention_dense(q, k, v, return_lse=True, backend="torch")[1] if policy.needs_lse else None
    heads = [[2, 0], [3], [1]]
    dens = [0.1, 0.45, 0.2]
    cfg = base_cfg(method)
    parts = []
    for hs, d in zip(heads, dens):
        idx = torch.tensor(hs)
        parts.append(policy.select(q[:, idx], k[:, idx], None if lse is None else lse[:, idx], problem.layout,
                                   config_at(cfg, d), scale=None, backend="torch"))
    whole = type(parts[0]).concat_heads(parts, heads)
    out = whole.run(q, k, v, backend="torch")
    for hs, part in zip(heads, parts):
        idx = torch.tensor(hs)
        ref = part.run(q[:, idx], k[:, idx], v[:, idx], backend="torch")
        torch.testing.assert_close(out[:, idx], ref, rtol=0, atol=1e-5)  # padded lists: other summation order
        for j, h in enumerate(hs):
            assert same_head(whole, h, part, j)
    per_head = [head_density(whole, h, n) for h in range(4)]
    assert whole.density == pytest.approx(sum(per_head) / 4, rel=1e-12)
    assert per_head[3] > per_head[1] > per_head[0]  # 0.45 > 0.2 > 0.1
    if isinstance(whole, BlockSelection):
        assert whole.density == pytest.approx(block_pairs_fraction(whole.kv_indices, whole.kv_counts, n, n, 64, 64),
                                               rel=1e-12)
    plain = type(parts[0]).concat_heads([parts[1], parts[2]])  # no head list: parts in head order
    assert plain.kv_counts.shape[1] == 2 and torch.equal(plain.kv_counts[:, 0], parts[1].kv_counts[:, 0])
    with pytest.raises(ValueError, match="permutation"):
        type(parts[0]).concat_heads(parts, [[0, 1], [1], [3]])


def test_concat_heads_refuses_parts_of_different_calls(problem):
    q, k, _ = problem.qkv(0)
    a = policy_for("block_topk").select(q[:, :1], k[:, :1], None, problem.layout, base_cfg("block_topk"),
                                        scale=None, backend="torch")
    b = policy_for("block_topk").select(q[:, 1:2], k[:, 1:2], None, problem.layout,
                                        base_cfg("block_topk").replace(block_q=128, block_k=128), scale=None,
                                        backend="torch")
    with pytest.raises(ValueError, match="block_q"):
        BlockSelection.concat_heads([a, b])
    with pytest.raises(ValueError, match="no parts"):
        TokenSelection.concat_heads([])
    # mc_sparse parts with text rows: another count of rows, or (off CUDA, where comparing costs no wait) other rows
    lse = kernels.attention_dense(q, k, q, return_lse=True, backend="torch")[1]
    c, d = (policy_for("mc_sparse").select(q[:, i:i + 1], k[:, i:i + 1], lse[:, i:i + 1], problem.layout,
                                           base_cfg("mc_sparse"), scale=None, backend="torch") for i in (0, 1))
    assert c.dense_rows is not None and c.dense_rows.numel() == 64
    assert TokenSelection.concat_heads([c, d]).dense_rows.numel() == 64
    for rows in (d.dense_rows[:-1], d.dense_rows + 1):
        with pytest.raises(ValueError, match="dense"):
            TokenSelection.concat_heads([c, dataclasses.replace(d, dense_rows=rows)])


# the engine ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_engine_honours_per_layer_and_per_head_densities(problem, method):
    """Layer 0: one factor per head; layer 2: one factor for the layer; layer 1: unlisted (the configured density).
    Each head's cached selection is exactly the policy's selection of that head alone at its own density, and the
    layer's reported density is the exact pair count of its heads."""
    factors = [0.5, 2.0, 1.0, 0.75]
    cfg = base_cfg(method, layer_densities={0: factors, 2: 0.5})
    eng = SparseEngine(cfg)
    q, k, v = problem.qkv(0)
    n = q.shape[2]
    eng.begin_run()
    for layer in range(3):
        eng.attend(q, k, v, CallContext(layer=layer, step=0, layout=problem.layout))
    sels = {layer: eng.cache.peek(CallContext(layer=layer, step=0).key(n)).selection for layer in range(3)}
    policy = policy_for(method)
    lse = kernels.attention_dense(q, k, v, return_lse=True, backend="torch")[1] if policy.needs_lse else None

    def alone(h, density):
        sl = slice(h, h + 1)
        return policy.select(q[:, sl], k[:, sl], None if lse is None else lse[:, sl], problem.layout,
                             config_at(cfg, density), scale=None, backend="torch")

    for h, f in enumerate(factors):
        assert same_head(sels[0], h, alone(h, 0.2 * f), 0), (method, h)
        assert same_head(sels[1], h, alone(h, 0.2), 0), (method, h)
        assert same_head(sels[2], h, alone(h, 0.1), 0), (method, h)
    d0 = [head_density(sels[0], h, n) for h in range(4)]
    assert d0[1] > d0[2] > d0[3] > d0[0]  # factors 2.0 > 1.0 > 0.75 > 0.5
    assert head_density(sels[2], 0, n) < head_density(sels[1], 0, n)
    # reuse steps run the per-head selection and report each layer's exact density
    for layer in range(3):
        out = eng.attend(*problem.qkv(1), CallContext(layer=layer, step=1, layout=problem.layout))
        assert torch.isfinite(out).all()
    stats = eng.end_run()
    for layer in range(3):
        exact = sum(head_density(sels[layer], h, n) for h in range(4)) / 4
        assert stats.layers[layer].density == pytest.approx(exact, rel=1e-9), (method, layer)


def test_engine_with_per_head_list_of_the_wrong_length_names_the_layer(problem):
    eng = SparseEngine(base_cfg("block_topk", layer_densities={0: [1.0, 1.0]}))
    q, k, v = problem.qkv(0)
    eng.begin_run()
    with pytest.raises(ValueError, match="layer 0 lists 2 head densities"):
        eng.attend(q, k, v, CallContext(layer=0, step=0, layout=problem.layout))


def _anchor_density(eng, ctx, n):
    sel = eng.cache.peek(ctx.key(n)).selection
    return sum(head_density(sel, h, n) for h in range(sel.kv_counts.shape[1])) / sel.kv_counts.shape[1]


def test_anchor_factors_hold_across_chunk_flips_restarts_and_split_samplers(problem):
    """The factor comes from the step's span of the schedule, not from how often a cache key anchored: a cond that
    anchored batched at step 0 and alone at step 2 (ComfyUI splits cond / uncond when memory runs low) selects at
    the second factor there; a run restarted without begin_run, and a second sampler starting at step 2, select
    at the factor of the step they run at."""
    cfg = base_cfg("block_topk", anchor_steps=[0, 2], anchor_density_factors=[1.5, 0.5])
    q, k, v = problem.qkv(0)
    both = [torch.cat([t, t]) for t in (q, k, v)]
    n = q.shape[2]
    reference = SparseEngine(cfg)
    reference.begin_run()
    first = CallContext(layer=0, step=0, layout=problem.layout)
    reference.attend(q, k, v, first)
    high = _anchor_density(reference, first, n)
    reference.attend(q, k, v, CallContext(layer=0, step=2, layout=problem.layout))
    low = _anchor_density(reference, first, n)
    assert high > 2 * low
    # batched at step 0, split at step 2: each part anchors as its key's first, at the second span's factor
    eng = SparseEngine(cfg)
    eng.begin_run()
    eng.attend(*both, CallContext(layer=0, step=0, chunk=(1, 0), layout=problem.layout))
    for cond in ((1,), (0,)):
        part = CallContext(layer=0, step=2, chunk=cond, layout=problem.layout)
        eng.attend(q, k, v, part)
        assert _anchor_density(eng, part, n) == pytest.approx(low, rel=1e-9)
    # the steps go back without begin_run (a restarted run): step 0 selects at the first factor again
    eng.attend(q, k, v, first)
    assert _anchor_density(eng, first, n) == pytest.approx(high, rel=1e-9)
    eng.end_run()
    # a second sampler of a split run, starting at step 2 (its first sparse step anchors there)
    eng.begin_run()
    late = CallContext(layer=0, step=2, layout=problem.layout, total_steps=4)
    eng.attend(q, k, v, late)
    assert _anchor_density(eng, late, n) == pytest.approx(low, rel=1e-9)
    eng.end_run()


@pytest.mark.parametrize("method", METHODS)
def test_a_head_capped_at_density_1_beside_sparser_heads_computes_every_pair(problem, method):
    """Head 0's factor takes it past density 1 (capped) while the others stay sparse: mc_sparse describes a call at
    density 1 as dense rows without query groups, which used to fail concat_heads ("the parts differ in batch,
    query groups and segments"); every method now selects, head 0 computes every (query, key) pair and its
    output is the dense one."""
    eng = SparseEngine(base_cfg(method, layer_densities={0: [10.0, 1.0, 1.0, 0.5]}))
    q, k, v = problem.qkv(0)
    n = q.shape[2]
    eng.begin_run()
    eng.attend(q, k, v, CallContext(layer=0, step=0, layout=problem.layout))
    sel = eng.cache.peek(CallContext(layer=0, step=0).key(n)).selection
    assert head_density(sel, 0, n) == pytest.approx(1.0, abs=1e-12)
    assert head_density(sel, 1, n) < 0.5 and head_density(sel, 3, n) < head_density(sel, 1, n)
    dense = kernels.attention_dense(q, k, v, backend="torch")
    sparse = sel.run(q, k, v, scale=None, backend="torch")
    torch.testing.assert_close(sparse[:, 0], dense[:, 0], atol=2e-3, rtol=2e-3)
    eng.end_run()


def test_uniform_factors_change_nothing(problem):
    """Factor 1 everywhere selects exactly what the configuration without factors selects."""
    q, k, v = problem.qkv(0)
    outs = []
    for ld in ((), {0: [1.0] * 4}):
        eng = SparseEngine(base_cfg("mc_sparse", layer_densities=ld))
        eng.begin_run()
        eng.attend(q, k, v, CallContext(layer=0, step=0, layout=problem.layout))
        outs.append(eng.attend(*problem.qkv(1), CallContext(layer=0, step=1, layout=problem.layout)))
        eng.end_run()
    assert torch.equal(outs[0], outs[1])


def test_mc_sparse_prepares_its_groups_before_the_dense_call_and_groups_each_span_once(problem, monkeypatch):
    """The engine asks McSparsePolicy.prepare before the anchor's dense call (on CUDA its side stream waits for that
    point only: kernels/side_stream.py); the groups are made once per sparse span, at select, after the dense call was
    launched; the head groups of per-head densities take their heads of those groups; the cuboid grouping (no work)
    prepares nothing."""
    from comfyui_sparse_attention.engine import engine as engine_mod
    from comfyui_sparse_attention.engine import policy_mc_sparse
    order = []
    real_groups, real_dense = policy_mc_sparse.segment_groups, kernels.attention_dense
    real_prepare = policy_mc_sparse.McSparsePolicy.prepare

    def counted(q, span, cfg, backend):
        order.append(("group", q.shape[1], span.start, span.stop))
        return real_groups(q, span, cfg, backend)

    def dense(*a, **kw):
        order.append("dense")
        return real_dense(*a, **kw)

    def prepare(self, *a, **kw):
        got = real_prepare(self, *a, **kw)
        order.append(("prepare", got is not None))
        return got

    monkeypatch.setattr(policy_mc_sparse, "segment_groups", counted)
    monkeypatch.setattr(policy_mc_sparse.McSparsePolicy, "prepare", prepare)
    monkeypatch.setattr(engine_mod.kernels, "attention_dense", dense)
    q, k, v = problem.qkv(0)
    n = q.shape[2]
    for grouping in ("pca", "cuboid"):
        order.clear()
        eng = SparseEngine(base_cfg("mc_sparse", grouping=grouping, layer_densities={0: [0.5, 2.0, 1.0, 1.0]}))
        eng.begin_run()
        eng.attend(q, k, v, CallContext(layer=0, step=0, layout=problem.layout))
        eng.end_run()
        grouped = [o for o in order if o[0] == "group"]
        if grouping == "pca":  # one grouping of all four heads, though three head groups select apart
            assert order[:3] == [("prepare", True), "dense", ("group", 4, 64, n)] and len(grouped) == 1
        else:  # each head group makes its own (free) cuboid groups
            assert order[:2] == [("prepare", False), "dense"] and len(grouped) == 3
    prepared = policy_for("mc_sparse").prepare(q, problem.layout, base_cfg("mc_sparse"), backend="torch")
    full = prepared.groups()[(64, n)]
    assert full.shape[:2] == (1, 4)
    part = prepared.heads(torch.tensor([3, 1])).groups()[(64, n)]
    assert torch.equal(part, full[:, [3, 1]])
    with pytest.raises(ValueError, match="already a subset"):
        prepared.heads(slice(0, 2)).heads(slice(0, 1))


def test_mc_sparse_prepare_asks_room_for_the_grouping_of_its_longest_span(problem, monkeypatch):
    """McSparsePolicy.prepare tells kernels.beside the grouping's scratch (kernels.group_queries_scratch) of its longest
    sparse span, the spans being grouped one after the other: the side stream is taken only where the device has room
    for it (kernels/side_stream.py). The estimate follows the grouping's width (dims) and the tokens."""
    from comfyui_sparse_attention.engine import policy_mc_sparse
    asked, real = [], kernels.beside

    def beside(fn, ref, need_bytes=0):
        asked.append(need_bytes)
        return real(fn, ref, need_bytes)
    monkeypatch.setattr(policy_mc_sparse.kernels, "beside", beside)
    q = problem.qkv(0)[0]
    b, h, n, d = q.shape
    for dims in (16, 0):
        cfg = base_cfg("mc_sparse", grouping_dims=dims)
        policy_for("mc_sparse").prepare(q, problem.layout, cfg, backend="torch").groups()
        assert asked[-1] == kernels.group_queries_scratch((b, h, n - 64, d), cfg.group_size, dims, False)
    assert asked[0] < asked[1]  # 16 values a query against 128
    wan14b, wan13b = ((1, 40, 75600, 128), (1, 12, 32760, 128))
    assert kernels.group_queries_scratch(wan14b, 128, 16) > kernels.group_queries_scratch(wan13b, 128, 16)


def test_side_stream_room_counts_free_memory_and_what_the_side_stream_keeps(monkeypatch):
    """kernels/side_stream.py's room (pure logic; the CUDA queries stood in for): under the native allocator the side
    stream needs ROOM_FACTOR x its scratch in the driver's free memory plus what it keeps cached itself (at most what
    PyTorch holds unused), not the other streams' cache; under cudaMallocAsync, whose pool serves every stream,
    always."""
    from comfyui_sparse_attention.kernels import side_stream
    gb = 2**30
    state = dict(backend="native", free=10 * gb, reserved=30 * gb, allocated=25 * gb)
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: state["backend"])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (state["free"], 80 * gb))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev=None: state["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev=None: state["allocated"])
    monkeypatch.setattr(side_stream, "_held", {})
    dev = torch.device("cuda", 0)
    assert side_stream.room(dev, 0) and side_stream.room(dev, int(2.5 * gb))
    assert not side_stream.room(dev, 3 * gb)  # 10 GB free < 12; the 5 GB unused are other streams' until it ran
    side_stream._held[0] = 2 * gb
    assert side_stream.room(dev, 3 * gb)  # 10 + the 2 GB it keeps
    state["allocated"] = 29 * gb  # PyTorch holds 1 GB unused: the side stream keeps at most that
    assert not side_stream.room(dev, 3 * gb)
    state["backend"] = "cudaMallocAsync"
    assert side_stream.room(dev, 3 * gb) and side_stream.room(dev, 100 * gb)


def test_pending_work_runs_once_at_its_first_result_and_a_failure_is_not_kept():
    """kernels.beside off CUDA: nothing runs until the first result(), which runs the work once; a work that raises
    raises at that call, and later calls raise RuntimeError (the exception, holding its frames' tensors, is dropped)."""
    runs = []
    pending = kernels.beside(lambda: runs.append(1) or torch.ones(2), torch.zeros(1))
    assert not pending.on_side_stream and runs == []
    assert torch.equal(pending.result(), torch.ones(2)) and torch.equal(pending.result(), torch.ones(2))
    assert runs == [1]

    def failing():
        raise MemoryError("out of memory")
    pending = kernels.beside(failing, torch.zeros(1))
    with pytest.raises(MemoryError):
        pending.result()
    with pytest.raises(RuntimeError, match="raised at the first call"):
        pending.result()


def test_head_groups_index_tensors_are_made_once():
    """A head group that is not contiguous is an index tensor made once and kept (a tensor made from a host list
    waits for the device: docs/kernel_notes.md, "v27"); a contiguous one stays a slice."""
    from comfyui_sparse_attention.engine.layer_density import _head_slice
    from comfyui_sparse_attention.engine.selection import _inverse_order
    first = _head_slice([0, 2], "cpu")
    assert first is _head_slice([0, 2], "cpu") and first.tolist() == [0, 2]
    assert _head_slice([1, 2], "cpu") == slice(1, 3)
    parts = [torch.zeros(1, 2, 3), torch.zeros(1, 2, 3)]
    heads = [[0, 3], [1, 2]]  # concatenated as 0, 3, 1, 2: head 3 sits at 1, head 1 at 2, head 2 at 3
    order = _inverse_order(parts, heads, lambda p: p.shape[1], "cpu")
    assert order.tolist() == [0, 2, 3, 1] and order is _inverse_order(parts, heads, lambda p: p.shape[1], "cpu")
