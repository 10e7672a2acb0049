"""Schedules: steps or fractions of the run, their resolution, the engine's decisions over a run, bad input,
and placing a split sampler in its run (engine/schedule.py). CPU only."""

import pytest
import torch

from comfyui_sparse_attention.engine import (AnchorSchedule, CallContext, Coordinate, SparseConfig, SparseEngine,
                                             locate_run)
from comfyui_sparse_attention.engine.schedule import parse_warmup, resolve_fraction, resolve_warmup, warmup_text


def test_forms_parse_and_round_trip():
    a = AnchorSchedule.parse("20%, 50%")
    assert a.fractions == (0.2, 0.5) and a.steps == () and a.relative
    assert AnchorSchedule.parse([0.2, 3]).fractions == (0.2,) and AnchorSchedule.parse([0.2, 3]).steps == (3,)
    assert AnchorSchedule.parse("every 25%").every_fraction == 0.25
    b = AnchorSchedule.parse("0 + every 5")
    assert b.steps == (0,) and b.every == 5
    assert AnchorSchedule.parse({"steps": [10, 26], "every": 4}).every == 4
    assert AnchorSchedule.parse(5).every == 5  # an integer alone means "every N"
    for text in ("10,26", "20%,50%", "every 5", "0 + every 25%", "3,50% + every 4", ""):
        assert AnchorSchedule.parse(AnchorSchedule.parse(text).text()) == AnchorSchedule.parse(text), text
    assert parse_warmup("10%") == 0.1 and parse_warmup(3) == 3 and parse_warmup("3") == 3 and parse_warmup(0.25) == 0.25
    assert warmup_text(0.1) == "10%" and warmup_text(3) == "3"
    assert SparseConfig(warmup_steps="10%").warmup_steps == 0.1


@pytest.mark.parametrize("bad", ["0%", "150%", "1.5", [1.5, 2.7], "every 0", "every", "ten", "10:26", "-3",
                                 {"evry": 5}, True, [True], "every -2"])
def test_bad_anchor_schedules_name_the_field(bad):
    with pytest.raises(ValueError, match="anchor_steps"):
        SparseConfig.from_dict({"anchor_steps": bad})


@pytest.mark.parametrize("bad", ["0%", "120%", 1.5, 2.0, -1, "x", True])
def test_bad_warmups_name_the_field(bad):
    with pytest.raises(ValueError, match="warmup_steps"):
        SparseConfig.from_dict({"warmup_steps": bad})


def test_resolution_against_the_run():
    assert [resolve_fraction(0.5, n) for n in (4, 8, 20, 30, 50)] == [2, 4, 10, 15, 25]
    assert resolve_fraction(1.0, 30) == 29  # the last step, never beyond the run
    assert [resolve_warmup(0.1, n) for n in (4, 8, 20, 30, 50)] == [0, 1, 2, 3, 5]
    assert resolve_warmup(0.1, None) == 0 and resolve_warmup(4, None) == 4
    a = AnchorSchedule.parse("every 25%")
    assert sorted(s for s in range(20) if a.is_anchor(s, 2, 20)) == [2, 7, 12, 17]
    assert AnchorSchedule.parse("20%,50%").resolved(None) == frozenset()  # unknown length: none resolved


def decisions(cfg, total, steps=None):
    """The engine's decision per step of a run of ``total`` steps (one layer), as a string D/A/r."""
    eng = SparseEngine(cfg)
    n = 64
    letters = []
    for s in (range(total) if steps is None else steps):
        ctx = CallContext(layer=0, step=s, total_steps=total)
        d = eng.decide(ctx, n)
        if d == "anchor":
            eng.cache.on_device[ctx.key(n)] = object()
            eng._anchored_at[ctx.key(n)] = s
        letters.append({"dense": "D", "anchor": "A", "reuse": "r"}[d])
    return "".join(letters)


def test_run_relative_schedule_over_run_lengths():
    cfg = SparseConfig(warmup_steps="10%", anchor_steps="50%", min_tokens=0)
    assert decisions(cfg, 4) == "ArAr"
    assert decisions(cfg, 8) == "DArrArrr"
    assert decisions(cfg, 20) == "DDArrrrrrrArrrrrrrrr"
    assert decisions(cfg, 50) == "DDDDDA" + "r" * 19 + "A" + "r" * 24  # warm-up 5, anchors 5 and 25
    few = SparseConfig(warmup_steps=0, anchor_steps="", min_tokens=0)  # few-step: anchor first, reuse after
    assert decisions(few, 4) == "Arrr"
    # a second sampler continuing the same 20-step run from step 10 (its first sparse step anchors)
    assert decisions(cfg, 20, steps=range(10, 20)) == "Arrrrrrrrr"
    assert decisions(cfg, 20, steps=range(12, 20)) == "Arrrrrrr"


def _uniform_index_schedule(total, table=1000):
    """ComfyUI's "simple" scheduler over a table of ``table`` sigmas (ascending sigma_of_index)."""
    ss = table / total
    idx = [table - 1 - int(x * ss) for x in range(total)]
    return [sigma_of_index(i, table) for i in idx] + [0.0]


def sigma_of_index(i, table=1000, shift=5.0):
    t = (i + 1) / table
    return shift * t / (1 + (shift - 1) * t)


def index_coordinate(table=1000, shift=5.0):
    def of(s):
        t = s / (shift - (shift - 1) * s)  # inverse of the shift
        return t * table - 1
    return Coordinate("index", of, table - 1.0, lambda spacing: spacing - 1)


@pytest.mark.parametrize("total,start,end", [(20, 0, 10), (20, 10, 20), (30, 0, 12), (30, 12, 30), (8, 4, 8),
                                             (50, 20, 35), (20, 0, 20)])
def test_a_split_sampler_is_placed_in_its_run(total, start, end):
    full = _uniform_index_schedule(total)
    part = full[start:end + 1]
    clock = locate_run(part, [index_coordinate()])
    assert (clock.offset, clock.total) == (start, total), clock


@pytest.mark.parametrize("start,end", [(4, 12), (6, 12), (0, 6), (3, 9)])
def test_a_split_is_placed_by_a_timestep_in_zero_to_one(start, end):
    """Flow models whose timestep is sigma itself, in [0, 1] (Flux, Qwen-Image, LTX-2): a tolerance of one unit took
    every first sigma for the top, so any part ending at 0 was a whole run (anchors at absolute steps beyond it
    refused). The coordinate's unit (one sigma-table step) scales the tolerances."""
    shift, total = 3.0, 12
    t = [1.0 - i * (1.0 - 1e-3) / (total - 1) for i in range(total)]  # ComfyUI's "normal": even in t, then 0
    full = [shift * x / (1 + (shift - 1) * x) for x in t] + [0.0]
    timestep = Coordinate("timestep", lambda s: s / (shift - (shift - 1) * s), 1.0, lambda spacing: 1e-3,
                          unit=1e-3)
    clock = locate_run(full[start:end + 1], [timestep])
    assert (clock.offset, clock.total) == (start, total), clock
    assert (clock.offset, clock.total) != (0, end - start) or start == 0


def test_uneven_schedules_are_their_own_run():
    karras = [float(x) for x in torch.linspace(1.0, 0.1, 9) ** 3] + [0.0]
    clock = locate_run(karras[3:], [index_coordinate()])
    assert (clock.offset, clock.total) == (0, len(karras) - 4) and not clock.exact


def test_reuse_steps_counts_what_the_engine_would_reuse():
    from comfyui_sparse_attention.engine.schedule import reuse_steps
    presets = AnchorSchedule.parse("20%, 53%")
    assert reuse_steps(presets, 0, 0, 30, 30) == 27         # anchors 0, 6, 16
    assert reuse_steps(presets, 0, 0, 3, 3) == 0            # 0, 1 (0.6), 2 (1.59): every step anchors
    assert reuse_steps(presets, 0, 0, 4, 4) == 1            # 0, 1 (0.8), 2 (2.12): step 3 reuses
    assert reuse_steps(presets, 0, 10, 1, 20) == 0          # a one-step part of a split
    assert reuse_steps(presets, 0, 10, 10, 20) == 9         # the second expert: 10 (its first) stands in for 11 (53 %)
    assert reuse_steps(presets, 0, 25, 25, 50) == 24        # 25 + 25: 27 (53 %) lies within 5 % of the run after 25
    assert reuse_steps(AnchorSchedule.parse("20%, 53%, 60%"), 0, 10, 10, 20) == 8  # 12 (60 %) lies past it: anchors
    assert reuse_steps(AnchorSchedule.parse("20%, 50%, 55%"), 0, 10, 10, 20) == 8  # 10 on the schedule: 11 anchors
    assert reuse_steps(AnchorSchedule.parse("4"), 3, 0, 10, 10) == 5  # a whole run: warm-up 3, anchors 3 and 4
    assert reuse_steps(AnchorSchedule.parse("every 2"), 0, 47, 10, 100) == 4  # periodic anchors keep their period:
    # 47 (first, off the schedule), 48, 50, 52, 54, 56 anchor
    assert reuse_steps(AnchorSchedule.parse(""), 2, 0, 3, 3) == 0   # 2 warm-up steps, one sparse step: an anchor
    assert reuse_steps(AnchorSchedule.parse("every 1"), 0, 0, 8, 8) == 0
    assert reuse_steps(AnchorSchedule.parse("every 2"), 0.25, 0, 8, 8) == 3  # warm-up 2; anchors 2, 4, 6
