"""Recordings and calibration (engine/recording.py, engine/calibrate.py, tools/calibrate.py) on the CPU: the file
round trip, the size cap and the disk check refusing before writing, bad files rejected with the file named, the
allocation (exact average, toward the heads that need density) on a synthetic recording, and the command line."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import ROOT
from safetensors.torch import save_file

from comfyui_sparse_attention.engine import SparseConfig
from comfyui_sparse_attention.engine import calibrate as cal
from comfyui_sparse_attention.engine import recording as recmod
from comfyui_sparse_attention.engine.context import TokenLayout
from comfyui_sparse_attention.engine.recording import (RecordingBuffer, RecordingTooLarge, load_recording,
                                                       save_recording)
from comfyui_sparse_attention.engine.synthetic import SyntheticVideoAttention

GRID = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4)


def synthetic_recording(path, steps=(0, 1, 2)):
    """Two layers of a synthetic video problem (8 x 16 x 16 tokens, 2 heads): layer 0 = (local, global) heads,
    layer 1 = (global, local); a global head's attention is broad (engine/synthetic.py, ``global_heads``)."""
    buf = RecordingBuffer(1 << 30)
    problems = [SyntheticVideoAttention(frames=8, height=16, width=16, text=0, heads=2, head_dim=32, steps=4,
                                        seed=1 + layer, global_heads=(1 - layer,)) for layer in range(2)]
    for s in steps:
        for layer, p in enumerate(problems):
            q, k, v = p.qkv(s)
            buf.add(layer, s, q[0], k[0], v[0], p.layout)
    return buf.save(path, {"family": "synthetic", "total_steps": 4})


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    return synthetic_recording(tmp_path_factory.mktemp("rec") / "syn.safetensors")


@pytest.fixture(scope="module")
def calibrated(recording):
    rec = load_recording(recording)
    base = SparseConfig(block_q=64, block_k=64, group_size=64)
    return rec, cal.calibrate(rec, ["mc_sparse"], [0.15], base=base, grid=GRID)


# recordings --------------------------------------------------------------------------------------------------------
def test_recording_round_trip(recording):
    rec = load_recording(recording)
    assert rec.layers == (0, 1) and rec.steps == (0, 1, 2) and rec.heads == 2 and rec.head_dim == 32
    assert rec.tokens == {0: 2048, 1: 2048} and rec.layouts[0] == TokenLayout(grid=(8, 16, 16))
    assert rec.family == "synthetic" and rec.total_steps == 4
    q, k, v = rec.qkv(1, 2)
    p = SyntheticVideoAttention(frames=8, height=16, width=16, text=0, heads=2, head_dim=32, steps=4, seed=2,
                                global_heads=(0,))
    ref = p.qkv(2)
    for got, want in zip((q, k, v), ref):
        assert got.shape == (1, 2, 2048, 32) and got.dtype == torch.float16
        assert torch.equal(got, want.half())
    with pytest.raises(ValueError, match=r"syn\.safetensors: no layer 5"):
        rec.qkv(5, 0)


def test_size_cap_refuses_before_copying_and_disk_check_before_writing(tmp_path, monkeypatch):
    one = torch.zeros(2, 100, 8)
    entry = 3 * one.numel() * 2
    buf = RecordingBuffer(max_bytes=entry + 10)
    buf.add(0, 0, one, one, one, TokenLayout())
    with pytest.raises(RecordingTooLarge, match="past the cap"):
        buf.add(1, 0, one, one, one, TokenLayout())
    assert buf.nbytes == entry and len(buf.tensors) == 3 and not buf.has(1, 0)
    monkeypatch.setattr(recmod, "host_memory", lambda: (recmod.HOST_RESERVE + entry - 1, 1 << 40))
    with pytest.raises(RecordingTooLarge, match="host has"):
        RecordingBuffer(1 << 20).add(0, 0, one, one, one, TokenLayout())
    monkeypatch.setattr(recmod, "host_memory", lambda: None)
    with pytest.raises(ValueError, match="fp16 range"):
        RecordingBuffer(1 << 20).add(0, 0, one + 1e6, one, one, TokenLayout())
    target = tmp_path / "cap.safetensors"
    with pytest.raises(RecordingTooLarge, match=r"cap\.safetensors: .* past the cap .* nothing written"):
        save_recording(target, dict(buf.tensors), {}, max_bytes=entry - 1)
    free = entry + recmod.HEADER_BYTES + 100  # room for the file but not for the file plus the reserve

    class Usage:
        def __init__(self, free):
            self.free = free
    monkeypatch.setattr(recmod.shutil, "disk_usage", lambda _: Usage(free))
    with pytest.raises(ValueError, match=r"cap\.safetensors: needs .* MB free .* nothing written"):
        buf.save(target, {})
    assert not target.exists() and not target.with_name(target.name + ".partial").exists()
    monkeypatch.setattr(recmod.shutil, "disk_usage", lambda _: Usage(free + recmod.DISK_RESERVE))
    assert buf.save(target, {}).is_file()
    with pytest.raises(ValueError, match=r"empty\.safetensors: nothing was recorded"):
        RecordingBuffer(1 << 20).save(tmp_path / "empty.safetensors", {})


def _t(*shape):
    return torch.randn(*shape).half()


@pytest.mark.parametrize("case", ["missing", "garbage", "truncated", "weights", "no_v", "shapes", "heads", "layout",
                                  "meta_steps", "dtype", "format"])
def test_bad_files_are_rejected_with_the_file_named(tmp_path, recording, case):
    path = tmp_path / f"bad_{case}.safetensors"
    good = {f"layer00.step00.{c}": _t(2, 64, 8) for c in "qkv"}
    meta = {"grid": json.dumps([1, 8, 8])}
    expect = {"missing": "no such recording file", "garbage": "not a readable safetensors file",
              "truncated": "not a readable safetensors file", "weights": "not a q/k/v recording",
              "no_v": "layer 0 step 0 lacks v", "shapes": "are not one \\(H, N, D\\) shape",
              "heads": "layer 1 has 4 heads", "layout": "another shape", "meta_steps": "metadata lists steps",
              "dtype": "not a float tensor", "format": "unknown recording format"}[case]
    if case == "garbage":
        path.write_bytes(b"not a safetensors file at all" * 10)
    elif case == "truncated":
        data = recording.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif case == "weights":
        save_file({"blocks.0.attn.q.weight": _t(8, 8)}, str(path))
    elif case == "no_v":
        save_file({k: v for k, v in good.items() if not k.endswith(".v")}, str(path), metadata=meta)
    elif case == "shapes":
        save_file({**good, "layer00.step00.k": _t(2, 60, 8)}, str(path), metadata=meta)
    elif case == "heads":
        save_file({**good, **{f"layer01.step00.{c}": _t(4, 64, 8) for c in "qkv"}}, str(path), metadata=meta)
    elif case == "layout":
        save_file(good, str(path), metadata={"grid": json.dumps([2, 8, 8])})
    elif case == "meta_steps":
        save_file(good, str(path), metadata={**meta, "steps": json.dumps([0, 5])})
    elif case == "dtype":
        save_file({**good, "layer00.step00.q": torch.zeros(2, 64, 8, dtype=torch.int32)}, str(path), metadata=meta)
    elif case == "format":
        save_file(good, str(path), metadata={**meta, "format": "something-else/9"})
    with pytest.raises(ValueError, match=expect) as err:
        load_recording(path)
    assert path.name in str(err.value)


def test_a_testbed_dump_loads_with_its_grid(tmp_path):
    """The quality testbed's evaluate.py --dump keys and metadata (grid, layers, steps, sampler_steps)."""
    path = tmp_path / "dump.safetensors"
    tensors = {f"layer{la:02d}.step{s:02d}.{c}": _t(2, 48, 8) for la in (1, 4) for s in (0, 10) for c in "qkv"}
    save_file(tensors, str(path), metadata={"grid": json.dumps([3, 4, 4]), "layers": json.dumps([1, 4]),
                                            "steps": json.dumps([0, 10]), "sampler_steps": "30"})
    rec = load_recording(path)
    assert rec.layers == (1, 4) and rec.steps == (0, 10) and rec.total_steps == 30 and rec.family == "testbed"
    assert rec.layouts[4] == TokenLayout(grid=(3, 4, 4))


# allocation ----------------------------------------------------------------------------------------------------------
def curve(layer, head, errors, weight=0.5, grid=(0.05, 0.1, 0.2, 0.4)):
    return cal.Curve("mc_sparse", layer, head, grid, list(errors), list(errors), list(errors), list(grid), weight)


def test_allocation_spends_the_budget_exactly_where_it_gains_most():
    steep = curve(0, 0, [0.8, 0.4, 0.2, 0.1])    # error halves with every doubling: needs density
    flat = curve(0, 1, [0.05, 0.04, 0.035, 0.03])  # already low: gives density away
    bumpy = curve(1, 0, [0.5, 0.6, 0.2, 0.19])   # not monotone: its convex hull is used
    a = cal.allocate([steep, flat, bumpy], 0.15, "reuse")
    d = a.densities
    assert sum(d.values()) / 3 == pytest.approx(0.15, abs=1e-12)
    assert d[(0, 0)] > d[(0, 1)] and d[(0, 1)] == 0.05
    assert a.cost_calibrated < a.cost_uniform
    assert a.factors[0] == (round(d[(0, 0)] / 0.15, 4), round(0.05 / 0.15, 4))
    rounded = cal.Curve("block_topk", 0, 0, (0.05, 0.1, 0.2, 0.4), [0.5, 0.5, 0.2, 0.1], [0.5, 0.5, 0.2, 0.1],
                        None, [0.1, 0.1, 0.2, 0.4], 0.5)  # 0.05 and 0.1 compute the same blocks
    r = cal.allocate([rounded, curve(0, 1, [0.3, 0.2, 0.15, 0.1])], 0.1, "reuse")
    # budget: what uniform 0.1 computes (0.1 + 0.1); start at the lowest (0.1 for the rounded head, 0.05); the
    # remaining 0.05 goes to the steepest segment, the rounded head's (0.1 -> 0.2 computed; of 0.05 and 0.1, which
    # compute the same, the one nearer the target stands for the point)
    assert r.achieved == pytest.approx({(0, 0): 0.15, (0, 1): 0.05})
    assert r.densities == pytest.approx({(0, 0): 0.15, (0, 1): 0.05})
    uniform = cal.allocate([curve(0, h, [0.4, 0.2, 0.1, 0.05]) for h in range(2)], 0.1, "reuse")
    assert uniform.densities == {(0, 0): 0.1, (0, 1): 0.1} and uniform.factors == {0: 1.0}
    with pytest.raises(ValueError, match=r"rec\.safetensors: an average density of 0.01 cannot be met"):
        cal.allocate([steep, flat], 0.01, "reuse", source="rec.safetensors")
    with pytest.raises(ValueError, match="cannot be met"):
        cal.allocate([steep, flat], 0.5, "reuse")


def test_allocation_within_layers_keeps_each_layers_share():
    """scope "layer": the heads of a layer share what the uniform density gives that layer; nothing moves between
    layers, however much steeper one layer's curves are."""
    steep = [curve(0, h, e) for h, e in enumerate(([0.8, 0.4, 0.2, 0.1], [0.9, 0.5, 0.25, 0.12]))]
    mixed = [curve(1, 0, [0.8, 0.4, 0.2, 0.1]), curve(1, 1, [0.05, 0.04, 0.035, 0.03])]
    free = cal.allocate(steep + mixed, 0.1, "reuse")
    assert free.densities[(0, 0)] + free.densities[(0, 1)] > 0.2  # model scope: layer 0 takes from layer 1
    within = cal.allocate(steep + mixed, 0.1, "reuse", scope="layer")
    d = within.densities
    assert d[(0, 0)] + d[(0, 1)] == pytest.approx(0.2) and d[(1, 0)] + d[(1, 1)] == pytest.approx(0.2)
    assert d[(1, 0)] > d[(1, 1)] == 0.05  # inside layer 1 the steep head takes the flat head's share
    assert free.cost_calibrated <= within.cost_calibrated < within.cost_uniform == pytest.approx(free.cost_uniform)
    with pytest.raises(ValueError, match="scope must be one of"):
        cal.allocate(steep, 0.1, "reuse", scope="heads")


def span_curve(layer, head, spans, weight=0.5, grid=(0.05, 0.1, 0.2, 0.4), anchors=(2, 10)):
    """A curve whose reuse errors differ by anchor span (``spans``: one error list per anchor)."""
    live = [e for e in spans if e]
    rms = [sum(e[i] ** 2 for e in live) ** 0.5 / len(live) ** 0.5 for i in range(len(grid))]
    return cal.Curve("mc_sparse", layer, head, grid, rms, rms, rms, list(grid), weight, anchors=anchors,
                     reuse_spans=[list(e) for e in spans], reuse_plain_spans=[list(e) for e in spans])


def test_spans_move_density_to_the_span_whose_error_falls_fastest():
    """allocate_spans: the first span's reuse error falls steeply with density, the second's hardly: density moves
    to the first span's steps, the reuse steps keep their pairs (7 f0 + 19 f1 = 26 for anchors 2 and 10 of 30
    steps), and the cost at the factors is span_cost's."""
    steep, flat = [0.8, 0.4, 0.2, 0.1], [0.05, 0.045, 0.04, 0.035]
    curves = [span_curve(0, h, (steep, flat)) for h in range(2)]
    assert cal.span_steps((2, 10), 30) == (7, 19)
    sp = cal.allocate_spans(curves, 0.1, "reuse", 30, warmup_steps=2)
    f0, f1 = sp.factors
    assert sp.anchors == (2, 10) and sp.steps == (7, 19)
    assert f0 > 1 > f1 and 7 * f0 + 19 * f1 == pytest.approx(26, abs=1e-3)
    assert sp.cost_calibrated < sp.cost_uniform
    assert sp.cost_uniform == pytest.approx(cal.span_cost(curves, 0.1, "reuse", 30, [1, 1]))
    assert sp.cost_calibrated == pytest.approx(cal.span_cost(curves, 0.1, "reuse", 30, sp.factors), rel=1e-3)
    # the same error in both spans: nothing to move
    same = [span_curve(0, h, (steep, steep)) for h in range(2)]
    assert cal.allocate_spans(same, 0.1, "reuse", 30, warmup_steps=2).factors == (1.0, 1.0)
    # per-head densities: a head already at 0.2 sits where the steep curve is flatter, so the spans move less
    dens = {(0, 0): 0.2, (0, 1): 0.2}
    assert 1 < cal.allocate_spans(curves, 0.1, "reuse", 30, warmup_steps=2, densities=dens).factors[0] < f0
    # a span factor never asks a head for more than everything
    assert cal.span_cost(curves, 0.1, "reuse", 30, [20, 1]) == pytest.approx(
        cal.span_cost(curves, 0.1, "reuse", 30, [10, 1]))


def test_spans_refuse_what_they_cannot_measure():
    curves = [span_curve(0, 0, ([0.4, 0.2, 0.1, 0.05], []))]  # anchor 10: no later step recorded
    with pytest.raises(ValueError, match=r"rec\.safetensors: anchor step 10: no later step was recorded"):
        cal.allocate_spans(curves, 0.1, "reuse", 30, warmup_steps=2, source="rec.safetensors")
    with pytest.raises(ValueError, match="objective 'fresh'"):
        cal.allocate_spans([span_curve(0, 0, ([0.4] * 4, [0.3] * 4))], 0.1, "fresh", 30, warmup_steps=2)
    with pytest.raises(ValueError, match=r"x: anchor steps \[2, 10\] must lie within the run's 8 steps"):
        cal.span_steps((2, 10), 8, "x")
    with pytest.raises(ValueError, match="leave no reuse step"):
        cal.span_steps((0, 1), 2)
    ok = [span_curve(0, 0, ([0.4, 0.2, 0.1, 0.05], [0.3, 0.2, 0.1, 0.05]))]
    with pytest.raises(ValueError, match=r"first sparse step \(0, after the warm-up\).*is step 2"):
        cal.allocate_spans(ok, 0.1, "reuse", 30, warmup_steps=0)  # factor 0 would land on the engine's span [0, 2)
    with pytest.raises(ValueError, match=r"densities: no density for \(layer, head\) \[\(0, 0\)\]"):
        cal.allocate_spans(ok, 0.1, "reuse", 30, warmup_steps=2, densities={(1, 0): 0.1})
    with pytest.raises(ValueError, match="one method"):
        other = span_curve(0, 1, ([0.4] * 4, [0.3] * 4))
        other.method = "block_topk"
        cal.allocate_spans([span_curve(0, 0, ([0.4] * 4, [0.3] * 4)), other], 0.1, "reuse", 30, warmup_steps=2)


def test_measure_keeps_each_anchors_reuse_error(recording):
    """measure: the reuse error of each anchor's own pairs, whose weighted squares add up to the overall one."""
    rec = load_recording(recording)
    base = SparseConfig(block_q=64, block_k=64, group_size=64, backend="torch")
    curves = cal.measure(rec, ["mc_sparse"], (0.1, 0.2), base, pairs=[(0, 1), (1, 2)], layers=[0])
    for c in curves:
        assert c.anchors == (0, 1) and len(c.reuse_spans) == 2
        for i in range(2):
            for objective, spans in (("reuse", c.reuse_spans), ("reuse_plain", c.reuse_plain_spans)):
                both = 0.5 * spans[0][i] ** 2 + 0.5 * spans[1][i] ** 2
                assert c.errors(objective)[i] ** 2 == pytest.approx(both, rel=1e-9)
        assert c.span_error_at("reuse", 1, 0.15) == pytest.approx((c.reuse_spans[1][0] + c.reuse_spans[1][1]) / 2)


def test_an_anchor_without_a_later_step_is_kept_and_refused(recording):
    """measure with anchors 0 and 2 of steps (0, 1, 2): anchor 2 has no later recorded step, so its span keeps no
    reuse errors and allocate_spans refuses to guess them, instead of moving every factor one span."""
    rec = load_recording(recording)
    base = SparseConfig(block_q=64, block_k=64, group_size=64, backend="torch")
    pairs = cal.pairs_for(rec.steps, [0, 2])
    assert pairs == [(0, 1)]
    curves = cal.measure(rec, ["mc_sparse"], (0.1, 0.2), base, pairs=pairs, anchors=[0, 2], layers=[0])
    assert all(c.anchors == (0, 2) and c.reuse_spans[1] == [] and len(c.reuse_spans[0]) == 2 for c in curves)
    with pytest.raises(ValueError, match="anchor step 2: no later step was recorded"):
        cal.allocate_spans(curves, 0.1, "reuse", 4, warmup_steps=0)


def test_pairs_follow_the_anchors():
    assert cal.pairs_for([2, 6, 10, 20]) == [(2, 6), (6, 10), (10, 20)]
    assert cal.pairs_for([2, 6, 10, 20], anchors=[2, 10]) == [(2, 6), (10, 20)]
    assert cal.pairs_for([3]) == []
    # each pair stands for the reuse steps nearest to its later step (ties to the earlier): anchor 2 -> steps 3..9
    # (3..7 for step 5, 8..9 for step 9), anchor 10 -> steps 11..29 (11..20 for step 15, 21..29 for step 25)
    pairs = cal.pairs_for([2, 5, 9, 10, 15, 25], anchors=[2, 10])
    assert pairs == [(2, 5), (2, 9), (10, 15), (10, 25)]
    assert cal.pair_weights(pairs, [2, 10], 30) == pytest.approx([5 / 26, 2 / 26, 10 / 26, 9 / 26])
    assert cal.pair_weights(pairs) == [0.25] * 4
    with pytest.raises(ValueError, match="x.safetensors: anchor step\\(s\\) \\[4\\] were not recorded"):
        cal.pairs_for([2, 6], anchors=[4], source="x.safetensors")


# calibration on a synthetic recording ---------------------------------------------------------------------------------
def test_calibration_gives_global_heads_more_density(calibrated):
    rec, (curves, allocs, pairs, _) = calibrated
    assert pairs == [(0, 1), (1, 2)]
    a = allocs[0]
    assert a.method == "mc_sparse" and a.objective == "reuse"
    uniform = sum(c.achieved[c.densities.index(0.15)] for c in curves) / len(curves)
    assert a.mean_achieved == pytest.approx(uniform, rel=1e-12)  # as many pairs as the uniform density computes
    assert a.mean_density == pytest.approx(0.15, rel=0.02)
    d = a.densities
    assert d[(0, 1)] > d[(0, 0)]  # layer 0: head 1 is the global one
    assert d[(1, 0)] > d[(1, 1)]  # layer 1: head 0 is
    assert a.cost_calibrated < a.cost_uniform
    for c in curves:
        assert c.reuse[0] > c.reuse[-1]  # more density, less error
        assert c.achieved[0] < c.achieved[-1]
        assert all(r < f for r, f in zip(c.reuse, c.fresh))  # the residual helps at reuse steps
    assert sum(c.weight for c in curves if c.layer == 0) == pytest.approx(1.0)
    flat = [x for f in a.factors.values() for x in (f if isinstance(f, tuple) else (f, f))]
    assert sum(flat) / len(flat) == pytest.approx(a.mean_density / 0.15, abs=2e-4)


def _reuse_errors(recording, weighting):
    """{anchor step: the calibration's block_topk reuse error at step 2 (layer 0, head 0, density 0.1)}, each
    checked against the rel-L2 of the engine's own reuse step under ``weighting``."""
    from comfyui_sparse_attention.engine import CallContext, SparseEngine
    from comfyui_sparse_attention.kernels import attention_dense
    rec = load_recording(recording)
    base = SparseConfig(method="block_topk", block_q=64, block_k=64, min_tokens=0, backend="torch",
                        residual_weighting=weighting)
    errors = {}
    for anchor in (0, 1):
        (curve, *_) = cal.measure(rec, ["block_topk"], (0.1,), base, pairs=[(anchor, 2)], layers=[0])
        q, k, v = (t.float() for t in rec.qkv(0, anchor))
        q2, k2, v2 = (t.float() for t in rec.qkv(0, 2))
        eng = SparseEngine(base.replace(density=0.1, anchor_steps=str(anchor)))
        eng.begin_run()
        eng.attend(q, k, v, CallContext(layer=0, step=anchor, total_steps=3))
        out = eng.attend(q2, k2, v2, CallContext(layer=0, step=2, total_steps=3))
        stats = eng.end_run().totals()
        assert stats["anchors"] == 1 and stats["reuses"] == 1
        ref = attention_dense(q2, k2, v2, backend="torch")
        want = float(torch.linalg.vector_norm(out[0, 0] - ref[0, 0]) / torch.linalg.vector_norm(ref[0, 0]))
        assert curve.head == 0 and curve.reuse[0] == pytest.approx(want, rel=1e-3)
        errors[anchor] = curve.reuse[0]
    return errors


def test_reuse_error_is_the_engines_reuse_step(recording):
    """The calibration's reuse error is what the engine's reuse step returns: a block selection anchored after the
    run's first step weights its residual by the mass (residual_weighting "mass"; "fixed" adds it as cached), and an
    anchor at step 0 keeps it fixed in both."""
    mass, fixed = _reuse_errors(recording, "mass"), _reuse_errors(recording, "fixed")
    assert mass[0] == pytest.approx(fixed[0], rel=1e-9)  # step-0 anchors keep the residual fixed
    assert abs(mass[1] - fixed[1]) > 1e-3 * fixed[1]


def test_preset_and_report(calibrated, tmp_path):
    rec, (curves, allocs, pairs, seconds) = calibrated
    a = allocs[0]
    base = SparseConfig(block_q=64, block_k=64, group_size=64, warmup_steps=2, anchor_steps="2,10",
                        anchor_density_factors=(1.5, 0.8))
    path = cal.write_preset(tmp_path / "p.yaml", cal.preset_text(a, rec, cal.plain_fields(base)))
    cfg = SparseConfig.from_yaml(path)
    assert cfg.method == "mc_sparse" and cfg.density == 0.15 and cfg.group_size == 64
    assert cfg.anchor_density_factors == (1.5, 0.8)
    assert cfg.anchor_steps.steps == (2, 10) and cfg.warmup_steps == 2
    assert dict(cfg.layer_densities) == a.factors
    text = path.read_text()
    assert text.startswith("# Source: calibrated") and "title: Calibrated mc_sparse" in text
    md = cal.report_markdown(rec, curves, allocs, pairs=pairs, plot_name="x.png", seconds=seconds)
    assert "| 0 | 1 |" in md and "error against density (reuse with residual)" in md and "![" in md
    assert md.count("\n| 1.1 |") == 3  # one row per table: reuse, reuse without residual, fresh
    assert "Check the result before keeping it" in md and "Sparse Attention Compare" in md


def test_calibration_errors_name_the_file(recording, tmp_path):
    rec = load_recording(recording)
    with pytest.raises(ValueError, match=r"syn\.safetensors: an average density of 0.6 cannot be met"):
        cal.calibrate(rec, ["block_topk"], [0.6], base=SparseConfig(block_q=64, block_k=64), grid=(0.05, 0.1))
    with pytest.raises(ValueError, match=r"syn\.safetensors: every recorded layer is dense"):
        cal.calibrate(rec, ["block_topk"], [0.1], base=SparseConfig(dense_layers="0,1"))
    with pytest.raises(ValueError, match="methods: 'dense'"):
        cal.measure(rec, ["dense"], GRID)
    single = synthetic_recording(tmp_path / "one.safetensors", steps=(0,))
    curves, allocs, pairs, _ = cal.calibrate(load_recording(single), ["block_topk"], [0.2],
                                             base=SparseConfig(block_q=64, block_k=64), grid=(0.1, 0.2, 0.3))
    assert pairs == [] and allocs[0].objective == "fresh" and curves[0].reuse is None
    with pytest.raises(ValueError, match="needs two or more recorded steps"):
        cal.allocate(curves, 0.2, "reuse")


# the command line ---------------------------------------------------------------------------------------------------
def test_command_line_writes_presets_and_report(recording, tmp_path):
    out = tmp_path / "cal_{method}.yaml"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "calibrate.py"), str(recording), "--methods",
                           "mc_sparse,block_topk", "--density", "0.15", "--grid", "0.05,0.1,0.2,0.3", "--out",
                           str(out), "--anchors", "0", "--device", "cpu"], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    for m in ("mc_sparse", "block_topk"):
        cfg = SparseConfig.from_yaml(tmp_path / f"cal_{m}.yaml")
        assert cfg.method == m and cfg.density == 0.15 and len(cfg.layer_densities) == 2
    report = (tmp_path / "cal_mc_sparse.md").read_text()
    assert "pairs (anchor → later step) 0→1 (33% of the reuse steps), 0→2 (67% of the reuse steps)" in report
    assert "block_topk at average density 0.15" in report
    # --scope layer through calibrate(): each layer keeps the uniform share (the achieved densities, summed per layer,
    # equal the uniform density's); test_allocation_within_layers_keeps_each_layers_share shows the default moving it
    rec = load_recording(recording)
    base = SparseConfig(block_q=64, block_k=64, group_size=64)
    _, (free,), _, _ = cal.calibrate(rec, ["mc_sparse"], [0.15], base=base, grid=GRID)
    curves, (within,), _, _ = cal.calibrate(rec, ["mc_sparse"], [0.15], base=base, grid=GRID, scope="layer")
    for layer in rec.layers:
        uniform = sum(cal._interp(c.densities, c.achieved, 0.15) for c in curves if c.layer == layer)
        assert sum(v for (la, _), v in within.achieved.items() if la == layer) == pytest.approx(uniform)
    assert within.cost_uniform == pytest.approx(free.cost_uniform)
    assert free.cost_calibrated <= within.cost_calibrated <= within.cost_uniform
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "calibrate.py"), str(recording), "--density", "0.15",
                           "--methods", "mc_sparse", "--grid", "0.05,0.1,0.2,0.3", "--out",
                           str(tmp_path / "layer.yaml"), "--scope", "layer", "--device", "cpu"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    for layer, f in SparseConfig.from_yaml(tmp_path / "layer.yaml").layer_densities:  # each layer averages ~1
        heads = f if isinstance(f, tuple) else (f, f)
        assert sum(heads) / len(heads) == pytest.approx(1.0, abs=0.05), (layer, f)
    bad = tmp_path / "broken.safetensors"
    bad.write_bytes(b"\x00" * 64)
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "calibrate.py"), str(bad)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "broken.safetensors" in proc.stderr
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "calibrate.py"), str(recording), "--methods",
                           "mc_sparse,static", "--out", str(tmp_path / "one.yaml")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "{method}" in proc.stderr
