"""The quality benchmark (bench/quality.py and its modules) on the CPU: step counting, projection arithmetic, the
engine adapter on a fake model, the report writer, and the runner end to end on a stand-in testbed."""

import json
import subprocess
import sys

import pytest
import torch
import yaml
from conftest import ROOT

BENCH = ROOT / "bench"
FAKE_TESTBED = ROOT / "tests" / "quality_testbed_fake"


@pytest.fixture(autouse=True)
def bench_on_path(monkeypatch):
    """The bench modules import each other by name (as when run as scripts from bench/)."""
    monkeypatch.syspath_prepend(str(BENCH))


def kinds_str(kinds):
    return "".join(k[0] for k in kinds)


# ---- step counting --------------------------------------------------------------------------------------

@pytest.mark.parametrize("steps,warm,anchors,expect", [
    (30, 3, [3, 12, 21], "ddd" + "a" + "r" * 8 + "a" + "r" * 8 + "a" + "r" * 8),
    (30, 0, [0], "a" + "r" * 29),
    (30, 0, [0, 15], "a" + "r" * 14 + "a" + "r" * 14),
    (30, 1, [1], "da" + "r" * 28),
    (30, 2, [2, 10], "dda" + "r" * 7 + "a" + "r" * 19),
    (8, 0, [0], "arrrrrrr"),
    (8, 1, [1], "darrrrrr"),
    (8, 0, [0, 4], "arrrarrr"),
    (8, 2, [2], "ddarrrrr"),
    (4, 0, [0], "arrr"),
    (4, 1, [1], "darr"),
    (4, 0, [0, 2], "arar"),
    (4, 2, [], "ddar"),             # no anchor listed: the first sparse step is one anyway
    (6, 3, [0, 1, 4], "dddaar"),    # anchors inside the warm-up are dense steps
    (4, 0, [3, 9], "arra"),         # anchors past the end change nothing
])
def test_engine_step_kinds(steps, warm, anchors, expect):
    from quality_grid import count_kinds, engine_step_kinds

    kinds = engine_step_kinds({"method": "block_topk", "warmup_steps": warm, "anchor_steps": anchors}, steps)
    assert kinds_str(kinds) == expect
    n = count_kinds(kinds)
    assert (n["dense"], n["anchor"], n["reuse"]) == (expect.count("d"), expect.count("a"), expect.count("r"))


def test_sol_dense_steps_are_the_engine_schedules_dense_and_anchor_steps():
    from quality_grid import SCHEDULES, sol_dense_steps, sol_step_kinds

    assert sol_dense_steps(30, (3, (3, 12, 21))) == [0, 1, 2, 3, 12, 21]
    assert sol_dense_steps(30, (0, (0,))) == [0]
    assert sol_dense_steps(8, (2, (2,))) == [0, 1, 2]
    assert sol_dense_steps(4, (0, (0, 2))) == [0, 2]
    assert kinds_str(sol_step_kinds([0, 2], 4)) == "dsds"
    for steps, schedules in SCHEDULES.items():
        for sch in schedules:
            assert all(s < steps for s in sol_dense_steps(steps, sch))


def test_quick_grid_covers_the_required_settings_in_priority_order():
    from quality_grid import estimate_grid, quick_grid, sol_dense_steps

    grid = quick_grid()
    ids = [s["id"] for s in grid]
    assert len(ids) == len(set(ids))
    assert [s["tier"] for s in grid] == sorted(s["tier"] for s in grid)
    eng = [s for s in grid if s["kind"] == "engine" and s["family"] != "dense"]
    have = {(s["steps"], s["family"], s["config"]["density"]) for s in eng}
    for steps in (30, 8, 4):
        for fam in ("mc_sparse", "block_topk", "block_topk+select"):
            for d in (0.25, 0.15, 0.1):
                assert (steps, fam, d) in have, (steps, fam, d)
    assert {s["config"]["density"] for s in eng} >= {0.05}
    sizes = {(s["family"], s["config"]["group_size"] if s["family"] == "mc_sparse" else s["config"]["block_q"])
             for s in eng}
    assert {("mc_sparse", 64), ("mc_sparse", 128), ("block_topk", 64), ("block_topk", 128)} <= sizes
    assert {s["config"]["warmup_layers"] for s in eng} == {0, 1}
    assert any(not s["config"]["residual"] for s in eng)
    ref = [s for s in eng if s["steps"] == 30 and s["schedule"] == "w3 a3,12,21"
           and s["config"]["density"] == 0.15 and s["tier"] == 1]
    assert {s["family"] for s in ref} == {"mc_sparse", "block_topk"}
    from quality_grid import SCHEDULES
    sol = {(s["steps"], s["sol"]["density"], tuple(s["sol"]["dense_steps"])) for s in grid if s["kind"] == "sol"}
    for steps, schedules in SCHEDULES.items():
        for sch in schedules:
            for d in (0.25, 0.15, 0.1):
                assert (steps, d, tuple(sol_dense_steps(steps, sch))) in sol
    total, _ = estimate_grid(grid, 0.05)
    assert total < 330  # about 6 minutes of H200 time with model load and references


def test_yaml_grid_and_its_errors(tmp_path):
    from quality_grid import grid_from_yaml, load_grid

    good = tmp_path / "g.yaml"
    good.write_text(yaml.safe_dump({"settings": [
        {"steps": 8, "sparse": {"method": "block_topk", "density": 0.1, "anchor_steps": "0,4", "block_q": 64}},
        {"steps": 4, "sol": {"density": 0.15, "dense_steps": [0]}}]}))
    grid = grid_from_yaml(good)
    assert [s["kind"] for s in grid] == ["engine", "sol"]
    assert grid[0]["config"]["anchor_steps"] == [0, 4] and grid[0]["config"]["min_tokens"] == 0
    assert [s["steps"] for s in load_grid(str(good), [4])] == [4]
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"settings": [{"steps": 8, "sparse": {"anchor_steps": "every 5"}}]}))
    with pytest.raises(ValueError, match="anchor_steps"):
        grid_from_yaml(bad)
    bad.write_text(yaml.safe_dump({"settings": [{"sparse": {}}]}))
    with pytest.raises(ValueError, match="steps"):
        grid_from_yaml(bad)
    with pytest.raises(ValueError, match="--grid"):
        load_grid("medium", [30])


@pytest.mark.parametrize("path", sorted((ROOT / "bench" / "grids").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_grid_loads_and_builds_its_configs(path):
    from quality_grid import grid_from_yaml

    from comfyui_sparse_attention.engine import SparseConfig

    grid = grid_from_yaml(path)
    assert grid and len({s["id"] for s in grid}) == len(grid)  # distinct settings (ids merge and resume runs)
    for s in grid:
        if s["kind"] == "engine":
            SparseConfig.from_dict(s["config"], source=path.name)


# ---- projection -------------------------------------------------------------------------------------------

def write_e2e(path, meta, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "rows": rows}))
    return path


@pytest.fixture
def costs(tmp_path):
    from quality_costs import StepCosts

    old = write_e2e(tmp_path / "old" / "e2e.json", "device X, 2026-11-29 20:00", [
        dict(model="wan14b", mode="dense", dense_s=10.0, step_s=10.0),
        dict(model="wan14b", mode="block_topk@0.1", dense_s=10.0, anchor_s=99.0, step_s=99.0),
        dict(model="wan14b", mode="block_topk@0.25", dense_s=10.0, anchor_s=14.0, step_s=6.0),
        dict(model="wan14b", mode="sol@0.15", dense_s=10.0, step_s=7.0),
        dict(model="hyv", mode="block_topk@0.1", dense_s=20.0, anchor_s=1.0, step_s=1.0),
        dict(model="wan14b", mode="mc_sparse@0.1", skipped="budget")])
    new = write_e2e(tmp_path / "new" / "e2e.json", "device X, 2026-11-30 08:00", [
        dict(model="wan14b", mode="dense", dense_s=10.0, step_s=10.0),
        dict(model="wan14b", mode="block_topk@0.1", dense_s=10.0, anchor_s=12.0, step_s=4.0),
        dict(model="wan14b", mode="mc_sparse@0.1", dense_s=10.0, anchor_s=30.0, step_s=4.5),
        # a variant of the preset (bench/e2e.py --warmup-layers 0) is not what these projections price (1 layer)
        dict(model="wan14b", mode="block_topk@0.25", variant="wl0", warmup_layers=0, dense_s=10.0, anchor_s=1.0,
             step_s=1.0)])
    return StepCosts.from_e2e([old, new], warmup_layers=1)  # given oldest first: the dates decide


def test_costs_merge_newest_first_and_interpolate(costs):
    assert costs.dense_s == 10.0 and costs.sources[0] == "new"
    assert costs.costs("block_topk", 0.1) == (12.0, 4.0, None)  # the newer run wins
    assert costs.costs("block_topk", 0.25) == (14.0, 6.0, None)  # its variant row does not
    a, r, flag = costs.costs("block_topk", 0.15)                  # 1/3 of the way from 0.1 to 0.25
    assert flag == "interpolated" and a == pytest.approx(12 + (14 - 12) / 3) and r == pytest.approx(4 + 2 / 3)
    assert costs.costs("block_topk", 0.05) == (12.0, 4.0, "nearest")
    assert costs.costs("block_topk", 0.5) == (14.0, 6.0, "nearest")
    with pytest.raises(ValueError, match="hybrid"):
        costs.costs("hybrid", 0.1)


def test_costs_prefer_the_presets_dense_layer_count_and_flag_others(tmp_path):
    """Rows run with the preset's number of dense layers win over newer rows with another; a projection priced
    from rows with another count is flagged "layers"; variants of another kind are never priced."""
    from quality_costs import StepCosts, preset_warmup_layers
    from quality_grid import engine_setting

    older = write_e2e(tmp_path / "older" / "e2e.json", "device X, 2026-12-01 10:00", [
        dict(model="wan14b", mode="dense", dense_s=10.0, step_s=10.0),
        dict(model="wan14b", mode="block_topk@0.08", variant="wl0", warmup_layers=0, dense_s=10.0, anchor_s=11.0,
             later_anchor_s=10.5, anchor_times_s=[11.0, 10.5], step_s=3.0),
        dict(model="wan14b", mode="block_topk@0.2", dense_s=10.0, anchor_s=13.0, step_s=5.0)])  # legacy: 1 layer
    newer = write_e2e(tmp_path / "newer" / "e2e.json", "device X, 2026-12-02 10:00", [
        dict(model="wan14b", mode="dense", dense_s=10.0, step_s=10.0),
        dict(model="wan14b", mode="block_topk@0.08", warmup_layers=1, dense_s=10.0, anchor_s=12.0,
             later_anchor_s=11.5, anchor_times_s=[12.0, 11.5], step_s=3.5),
        dict(model="wan14b", mode="block_topk@0.2", variant="fp8", dense_s=10.0, anchor_s=1.0, step_s=1.0)])
    c0 = StepCosts.from_e2e([older, newer], warmup_layers=0)
    assert c0.costs("block_topk", 0.08) == (11.0, 3.0, None) and c0.later_anchor_s("block_topk", 0.08) == 10.5
    assert c0.costs("block_topk", 0.2) == (13.0, 5.0, None)  # the "fp8" variant is not priced
    at = lambda d: engine_setting(30, "block_topk", d, 128, (0, (0, 6, 16)), 1)  # noqa: E731
    assert c0.project(at(0.08))["flags"] == [] and "layers" in c0.project(at(0.2))["flags"]
    assert c0.project(at(0.1))["flags"][:2] == ["interpolated", "layers"]  # one of its two neighbours ran 1 layer
    c1 = StepCosts.from_e2e([older, newer], warmup_layers=1)
    assert c1.costs("block_topk", 0.08) == (12.0, 3.5, None) and c1.project(at(0.08))["flags"] == []
    c1.to_json(tmp_path / "c1.json")
    assert "layers" not in StepCosts.load([tmp_path / "c1.json"]).project(at(0.2))["flags"]
    assert StepCosts.load([tmp_path / "c1.json"]).warmup_layers == 1
    # a later anchor is filled in only from a row run with the entry's own count
    no_later = write_e2e(tmp_path / "nolater" / "e2e.json", "device X, 2026-12-03 10:00", [
        dict(model="wan14b", mode="dense", dense_s=10.0, step_s=10.0),
        dict(model="wan14b", mode="block_topk@0.08", variant="wl0", dense_s=10.0, anchor_s=11.5, step_s=3.1)])
    c2 = StepCosts.from_e2e([newer, no_later], warmup_layers=0)  # "wl0" without a key: 0 layers, from the variant
    assert c2.costs("block_topk", 0.08) == (11.5, 3.1, None) and c2.later_anchor_s("block_topk", 0.08) is None
    assert c2.modes["block_topk"][0.08]["warmup_layers"] == 0
    # a step-cost file from before the comparison: no count, no marks
    legacy = {k: v for k, v in c1.to_dict().items() if k != "warmup_layers"}
    old = StepCosts.from_dict(legacy)
    assert old.warmup_layers is None and "layers" not in old.project(at(0.08))["flags"]
    from comfyui_sparse_attention.engine.presets import load_preset
    assert preset_warmup_layers() == load_preset("wan21_t2v_14b").warmup_layers
    bad = tmp_path / "p.yaml"
    bad.write_text("sparse: [1, 2]\n")
    with pytest.raises(ValueError, match="p.yaml"):
        preset_warmup_layers(bad)


def test_costs_prefer_the_wan_presets_rows_over_another_presets(tmp_path):
    """A row timed with another preset's settings (bench/e2e.py --preset) is priced only where no row of the Wan 14B
    preset's own configuration measured that mode, even when it is newer and kept as many layers dense."""
    from quality_costs import StepCosts

    own = write_e2e(tmp_path / "own" / "e2e.json", "device X, 2026-12-01 10:00", [
        dict(model="wan14b", mode="dense", dense_s=10.0, step_s=10.0),
        dict(model="wan14b", mode="block_topk@0.15", warmup_layers=0, dense_s=10.0, anchor_s=12.0, step_s=4.0)])
    other = write_e2e(tmp_path / "other" / "e2e.json", "device X, 2026-12-04 10:00", [
        dict(model="wan14b", mode="dense", dense_s=10.0, step_s=10.0),
        dict(model="wan14b", mode="block_topk@0.15", preset="wan21_t2v_14b_small_vram", warmup_layers=0,
             dense_s=10.0, anchor_s=20.0, step_s=9.0),
        dict(model="wan14b", mode="block_topk@0.25", preset="wan21_t2v_14b_quality", warmup_layers=0,
             dense_s=10.0, anchor_s=14.0, step_s=6.0),
        dict(model="wan14b", mode="block_topk@0.1", preset="wan21_t2v_14b", warmup_layers=0,
             dense_s=10.0, anchor_s=11.0, step_s=3.0)])
    c = StepCosts.from_e2e([own, other], warmup_layers=0)
    assert c.costs("block_topk", 0.15) == (12.0, 4.0, None)  # the older row of the preset's own configuration
    assert c.costs("block_topk", 0.25) == (14.0, 6.0, None)  # the only row of that mode
    assert c.costs("block_topk", 0.1) == (11.0, 3.0, None)   # a row naming the Wan 14B preset is its own


def test_projection_counts_steps_as_the_engine_does(costs, tmp_path):
    from quality_costs import StepCosts
    from quality_grid import engine_setting, sol_setting

    ref = engine_setting(30, "block_topk", 0.1, 128, (3, (3, 12, 21)), 1)
    p = costs.project(ref)
    assert p["n"] == {"dense": 3, "anchor": 3, "reuse": 24} and p["flags"] == []
    assert p["speedup"] == pytest.approx(300 / (3 * 10 + 3 * 12 + 24 * 4))
    a0 = costs.project(engine_setting(8, "block_topk", 0.1, 64, (0, (0,)), 1))
    assert a0["speedup"] == pytest.approx(80 / (12 + 7 * 4)) and a0["flags"] == ["method costs"]
    w1 = costs.project(engine_setting(4, "mc_sparse", 0.1, 128, (1, (1,)), 1))
    assert w1["speedup"] == pytest.approx(40 / (10 + 30 + 2 * 4.5))
    sel = costs.project(engine_setting(4, "block_topk+select", 0.15, 128, (0, (0, 2)), 1))
    assert sel["flags"] == ["interpolated", "method costs"] and sel["n"] == {"dense": 0, "anchor": 2, "reuse": 2}
    sol = costs.project(sol_setting(30, 0.15, [0, 1, 2, 3, 12, 21], 1))
    assert sol["n"] == {"dense": 6, "anchor": 0, "reuse": 24}
    assert sol["speedup"] == pytest.approx(300 / (6 * 10 + 24 * 7))
    # the table round-trips through its own JSON form
    costs.to_json(tmp_path / "costs.json")
    again = StepCosts.load([tmp_path / "costs.json"])
    assert again.project(ref)["speedup"] == pytest.approx(p["speedup"])


def test_projection_takes_later_anchors_where_a_run_timed_them(costs, tmp_path):
    """A run that timed a later anchor (bench/e2e.py --pattern ArAr) prices every anchor after the first at that
    time; rows that timed only the first anchor price all anchors at it."""
    from quality_costs import StepCosts
    from quality_grid import engine_setting

    later = write_e2e(tmp_path / "later" / "e2e.json", "device X, 2026-12-01 15:00", [
        dict(model="wan14b", mode="dense", dense_s=10.0, step_s=10.0),
        dict(model="wan14b", mode="block_topk@0.1", dense_s=10.0, anchor_s=12.0, later_anchor_s=9.0,
             anchor_times_s=[12.0, 9.0], step_s=4.0),
        dict(model="wan14b", mode="block_topk@0.25", dense_s=10.0, anchor_s=20.0, later_anchor_s=20.0,
             anchor_times_s=[20.0], step_s=6.0)])  # one anchor timed: its later_anchor_s is the first's
    c = StepCosts.from_e2e([tmp_path / "old" / "e2e.json", later], warmup_layers=1)
    assert c.later_anchor_s("block_topk", 0.1) == 9.0 and c.later_anchor_s("block_topk", 0.25) is None
    ref = engine_setting(30, "block_topk", 0.1, 128, (3, (3, 12, 21)), 1)
    assert c.project(ref)["seconds"] == pytest.approx(3 * 10 + 12 + 2 * 9 + 24 * 4)
    assert costs.project(ref)["seconds"] == pytest.approx(3 * 10 + 3 * 12 + 24 * 4)
    assert "first-anchor price" not in costs.project(ref)["flags"]  # no later anchor measured for the method at all
    newest = write_e2e(tmp_path / "newest" / "e2e.json", "device X, 2026-12-02 09:00", [
        dict(model="wan14b", mode="dense", dense_s=10.0, step_s=10.0),
        dict(model="wan14b", mode="block_topk@0.1", dense_s=10.0, anchor_s=11.0, later_anchor_s=11.0,
             anchor_times_s=[11.0], step_s=3.9)])  # one anchor timed: the older run's later anchor still counts
    c2 = StepCosts.from_e2e([later, newest], warmup_layers=1)
    assert c2.costs("block_topk", 0.1) == (11.0, 3.9, None) and c2.later_anchor_s("block_topk", 0.1) == 9.0
    assert c2.modes["block_topk"][0.1]["later_run"] == "later"
    mid = c.project(engine_setting(30, "block_topk", 0.15, 128, (3, (3, 12, 21)), 1))
    a, r, _ = c.costs("block_topk", 0.15)
    assert mid["seconds"] == pytest.approx(3 * 10 + 3 * a + 24 * r)  # no later time at 0.25: first-anchor price
    assert "first-anchor price" in mid["flags"] and "first-anchor price" not in c.project(ref)["flags"]
    one = c.project(engine_setting(8, "block_topk", 0.25, 128, (0, (0,)), 1))  # one anchor: nothing to price later
    assert "first-anchor price" not in one["flags"]


def test_costs_from_the_repository_runs():
    import json

    from quality_costs import StepCosts, _layers_of, _run_date, preset_warmup_layers

    c = StepCosts.load()
    assert c.model == "wan14b" and c.dense_s == pytest.approx(22.99, abs=0.01)
    assert {"mc_sparse", "block_topk", "sol"} <= set(c.modes)
    assert c.warmup_layers == preset_warmup_layers()
    # every (mode, density) comes from the newest run (by its date) that measured it with the preset's dense-layer
    # count, else from the newest with another count
    runs = []
    for path in sorted((ROOT / "docs" / "bench-runs").glob("e2e-wan14b*/e2e.json")):
        doc = json.loads(path.read_text())
        runs.append((_run_date(doc.get("meta")), path.parent.name, doc["rows"]))
    for method, by_density in c.modes.items():
        for density, cost in by_density.items():
            have = [(_layers_of(r) == c.warmup_layers, d, name) for d, name, rows in runs for r in rows
                    if r.get("model") == "wan14b" and r.get("mode") == f"{method}@{density}"
                    and _layers_of(r) is not None and "skipped" not in r]
            assert have and cost["run"] == max(have)[2], (method, density, cost["run"], have)


# ---- the engine adapter -------------------------------------------------------------------------------------

def fake_model_run(attn, context, steps, layers=2, grid=(2, 8, 8), stop=None):
    """A model that sets CONTEXT like the testbed and calls ``attn`` once per layer with random q/k/v."""
    g = torch.Generator().manual_seed(0)
    n = grid[0] * grid[1] * grid[2]
    outs = []
    context["batch_offset"] = 0
    for step in range(steps if stop is None else stop):
        context["step"] = step
        context["grid"] = grid
        for layer in range(layers):
            context["layer"] = layer
            q, k, v = (torch.randn(1, 2, n, 32, generator=g) for _ in range(3))
            outs.append((step, layer, q, k, v, attn(q, k, v)))
        context["layer"] = None
    return outs


@pytest.mark.parametrize("cfg,steps", [
    (dict(method="block_topk", density=0.25, warmup_steps=3, anchor_steps=[3, 12, 21], block_q=64, block_k=64), 30),
    (dict(method="mc_sparse", density=0.25, warmup_steps=0, anchor_steps=[0, 4], group_size=64), 8),
    (dict(method="mc_sparse", density=0.25, warmup_steps=2, anchor_steps=[2], group_size=64, warmup_layers=1), 8),
    (dict(method="block_topk", density=0.25, warmup_steps=1, anchor_steps=[1], block_q=64, block_k=64,
          select_every_step=True, residual=False), 4),
    (dict(method="block_topk", density=0.25, warmup_steps=0, anchor_steps=[0, 2], block_q=64, block_k=64), 4),
])
def test_adapter_calls_are_dense_anchor_reuse_as_the_schedule_says(cfg, steps):
    """Step by step: runs of 1, 2, .. steps; the growth of the run's counts is that step's kind per layer."""
    from quality_engine import EngineAttention
    from quality_grid import engine_step_kinds

    cfg = dict(cfg, min_tokens=0, backend="torch")
    layers, wl = 2, cfg.get("warmup_layers", 0)
    expect = engine_step_kinds(cfg, steps)
    context: dict = {}
    prev = {"dense": 0, "anchor": 0, "reuse": 0}
    for stop in range(1, steps + 1):
        attn = EngineAttention(cfg, steps, context)
        with attn.run():
            fake_model_run(attn, context, steps, layers, stop=stop)
        got = {k: attn.stats[k] for k in prev}
        step = {k: got[k] - prev[k] for k in prev}
        kind = expect[stop - 1]
        want = {"dense": layers if kind == "dense" else wl, "anchor": 0, "reuse": 0}
        if kind != "dense":
            want[kind] = layers - wl
        assert step == want, (stop - 1, kind, step)
        assert attn.stats["calls"] == stop * layers and attn.stats["fallback"] == 0
        prev = got
    if "anchor" in expect:
        assert attn.stats["fidelity_mean"] is not None and 0 < attn.stats["density_sparse"] <= 1


def test_adapter_context_and_dense_paths():
    """Dense and anchor calls return the model's dense attention; a reuse call differs (sparse + residual);
    the CallContext carries the layer, the step and the grid (a wrong grid would fail the block layout)."""
    import torch.nn.functional as F
    from quality_engine import EngineAttention

    context: dict = {}
    calls = []

    def dense_fn(q, k, v):
        calls.append(q.shape)
        return F.scaled_dot_product_attention(q, k, v)
    cfg = dict(method="block_topk", density=0.25, warmup_steps=1, anchor_steps=[1], block_q=64, block_k=64,
               min_tokens=0, backend="torch")
    attn = EngineAttention(cfg, 3, context, dense_fn=dense_fn)
    with attn.run():
        outs = fake_model_run(attn, context, 3)
    for step, layer, q, k, v, o in outs:
        exact = F.scaled_dot_product_attention(q, k, v)
        if step < 2:   # warm-up (dense) and the anchor return the dense output
            torch.testing.assert_close(o, exact)
        else:
            assert not torch.allclose(o, exact)
    # 2 layers x the warm-up step through the model's dense function; a block_topk anchor computes its dense
    # output and residual in one fused pass (kernels.block_anchor_attention), exact as the assertions above show
    assert len(calls) == 2
    with pytest.raises(ValueError, match="density"):
        EngineAttention(dict(cfg, density=2.0), 3, context)


def test_sol_runs_at_the_steps_outside_its_dense_set():
    """bench/quality.py's Sol-Attn wrapper: the model's dense attention at the dense steps, Sol-Attn (here a
    stand-in: comfy_kitchen needs CUDA) at every call of the other steps; counts match expected_calls."""
    import importlib.util

    from quality_grid import sol_setting

    # by path: a bare "import quality" could find another module or folder of that name
    spec = importlib.util.spec_from_file_location("quality_bench_cli", BENCH / "quality.py")
    quality = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quality)

    context: dict = {}
    seen = []
    attn = quality.SolOnSteps(0.15, [0, 2], context, lambda q, k, v: q * 0 + 1)
    attn.sol = lambda q, k, v, density: seen.append((context["step"], density)) or q * 0 + 2
    outs = fake_model_run(attn, context, 5, layers=3)
    assert [int(o[-1].flatten()[0]) for o in outs] == [1] * 3 + [2] * 3 + [1] * 3 + [2] * 6
    assert seen == [(s, 0.15) for s in (1, 3, 4) for _ in range(3)]
    want = quality.expected_calls(sol_setting(5, 0.15, [0, 2], 1), layers=3, chunks=1)
    assert {k: attn.stats[k] for k in want} == want == {"dense": 6, "sol": 9}


# ---- report -----------------------------------------------------------------------------------------------

def synthetic_results(tmp_path):
    from quality_grid import dense_check_setting, engine_setting, sol_setting

    def row(setting, psnr, ssim=0.95, **extra):
        r = dict(setting, psnr=[psnr] * 8, ssim=[ssim] * 8, psnr_mean=psnr, psnr_min=psnr - 1, ssim_mean=ssim,
                 ssim_min=ssim - 0.01, time_s=1.5, schedule_check="ok",
                 stats={"fidelity_mean": 0.02, "density_sparse": 0.15}, **extra)
        return r
    rows = [
        row(dense_check_setting(30), 100.0, 1.0),
        row(engine_setting(30, "mc_sparse", 0.15, 64, (3, (3, 12, 21)), 1), 33.8),
        row(engine_setting(30, "block_topk", 0.1, 64, (0, (0,)), 1), 31.0),        # 30 dB at > 2x: (a) met
        row(engine_setting(30, "block_topk", 0.15, 64, (3, (3, 12, 21)), 1), 36.0),
        row(sol_setting(30, 0.15, [0, 1, 2, 3, 12, 21], 1), 22.4),
        row(sol_setting(30, 0.1, [0], 2), 35.5),                                    # none of ours is 1.5x at 35.5
        row(engine_setting(8, "mc_sparse", 0.15, 64, (0, (0,)), 1), 31.0),          # 7 of 8 steps reuse: (c8) met
        row(engine_setting(4, "mc_sparse", 0.15, 64, (1, (1,)), 1), 34.0),          # only 2 of 4 reuse
        row(engine_setting(4, "block_topk", 0.15, 64, (0, (0,)), 1), 27.0),         # 3 of 4 but < 30 dB: (c4) missed
        dict(engine_setting(4, "block_topk", 0.05, 64, (0, (0, 2)), 3), error="RuntimeError: boom", time_s=0.1),
    ]
    meta = {"device": "NVIDIA H200", "versions": {"torch": "2.11.0+cu130", "triton": "3.6.0",
                                                  "comfy_kitchen": "0.2.40", "python": "3.12.3"},
            "date": "2026-12-01 10:00", "command": "python bench/quality.py --testbed T --out O", "grid": "quick",
            "seeds": list(range(8)), "batch": 8, "shift": 3.0, "budget_s": 540, "n_measured": 9, "n_skipped": 1,
            "wall_s": 300.0, "testbed": {"config": {"frames": 16, "height": 128, "width": 128, "patch": [1, 4, 4],
                                                    "dim": 256, "num_heads": 2, "num_layers": 8, "num_classes": 8},
                                         "grid": [16, 32, 32], "tokens": 16384, "random_init": False,
                                         "weights_sha256": "ab" * 32}}
    p = tmp_path / "quality.json"
    p.write_text(json.dumps({"meta": meta, "rows": rows, "skipped": [{"id": "30|x", "reason": "time budget",
                                                                        "detail": "9 s needed, 2 s left"}]}))
    return p


def test_report_tables_frontier_and_targets(tmp_path, costs):
    import quality_report as qr

    results = qr.load_results([synthetic_results(tmp_path)])
    md = qr.render(results, costs, "images/quality-frontier.png", "python bench/quality.py --report q.json")
    assert "NVIDIA H200" in md and "Triton 3.6.0" in md and "comfy_kitchen 0.2.40" in md and "16384 tokens" in md
    for steps in (30, 8, 4):
        assert f"## {steps} steps" in md
    lines = md.splitlines()
    a = next(ln for ln in lines if ln.startswith("- (a)"))
    # block_topk@0.1 a0 at these costs: 300 / (12 + 29 x 4) = 2.34x
    assert "**met**" in a and "block_topk b64 d0.1, a0" in a and "2.34×" in a
    b_head = lines.index(next(ln for ln in lines if ln.startswith("- (b)")))
    assert "**missed**" in lines[b_head]
    b_lines = lines[b_head + 1:b_head + 3]
    assert any("22.4 dB" in ln and "✓" in ln for ln in b_lines)
    assert any("35.5 dB" in ln and "✗" in ln for ln in b_lines)
    c = [ln for ln in lines if ln.startswith("- (c)")]
    assert "4 steps" in c[0] and "**missed**" in c[0] and "27.0 dB" in c[0]
    assert "8 steps" in c[1] and "**met**" in c[1] and "7 of 8 steps" in c[1]
    front = next(ln for ln in lines if ln.startswith("| 30 | block_topk (residual as cached) |"))
    assert "block_topk b64 d0.1, a0" in front and "block_topk b64 d0.15, w3 a3,12,21" in front
    assert "| 2.34×§ |" in front and "| 1.67×†§ |" in front  # 64-blocks: method costs; 0.15: interpolated
    assert "| 30 | Sol-Attn | sol d0.1, dense 0 | 35.5 | 1.41×‡ |" in md  # sol 0.1: nearest measured (0.15)
    assert "error: RuntimeError: boom" in md
    assert "![PSNR against projected speed-up](images/quality-frontier.png)" in md
    assert "matched them in all 9 runs" in md
    assert "Not measured: 1 setting of the grid — 1 for time budget (9 s needed, 2 s left), e.g. `30|x`." in md


def test_choose_prints_preset_snippets(tmp_path, costs):
    import quality_report as qr

    text = qr.choose(qr.load_results([synthetic_results(tmp_path)]), costs)
    blocks = [b for b in text.split("\n\n") if b.strip()]
    thirty = [b for b in blocks if b.startswith("# 30 steps")]
    assert ">= 30 dB: block_topk b64 d0.1, a0" in thirty[0]
    snippet = yaml.safe_load(thirty[0])
    assert snippet["sparse"]["method"] == "block_topk" and snippet["sparse"]["anchor_steps"] == [0]
    assert "min_tokens" not in snippet["sparse"]
    assert ">= 35 dB: block_topk b64 d0.15, w3 a3,12,21" in thirty[1]
    assert any(b.startswith("# 4 steps, fastest with PSNR >= 35 dB: none") for b in blocks)


# ---- the runner end to end ----------------------------------------------------------------------------------

def test_runner_end_to_end_on_a_stand_in_testbed(tmp_path):
    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump({"settings": [
        {"steps": 4, "sparse": {"method": "dense"}},
        {"steps": 4, "sparse": {"method": "mc_sparse", "density": 0.25, "anchor_steps": [0], "group_size": 64}},
        {"steps": 4, "sparse": {"method": "block_topk", "density": 0.25, "warmup_steps": 1, "anchor_steps": [1],
                                "block_q": 64, "block_k": 64, "warmup_layers": 1}},
        {"steps": 3, "sparse": {"method": "block_topk", "density": 0.25, "block_q": 64, "block_k": 64}},
    ]}))
    out = tmp_path / "out"
    cmd = [sys.executable, str(BENCH / "quality.py"), "--testbed", str(FAKE_TESTBED), "--out", str(out),
           "--random-init-small", "--steps", "4", "--grid", str(grid), "--seeds", "0,1,2", "--batch", "2",
           "--device", "cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    doc = json.loads((out / "quality.json").read_text())
    rows = doc["rows"]
    assert [r["config"]["method"] for r in rows] == ["dense", "mc_sparse", "block_topk"]  # the 3-step one filtered
    assert all(r["schedule_check"] == "ok" for r in rows), [r["schedule_check"] for r in rows]
    assert rows[0]["psnr_mean"] == 100.0
    assert rows[1]["step_kinds"] == "arrr" and rows[2]["step_kinds"] == "darr"
    # 3 videos in chunks of 2: two chunks, each anchoring at its own first sparse step
    assert rows[1]["stats"]["anchor"] == 2 * 2 and rows[1]["stats"]["reuse"] == 2 * 3 * 2
    assert rows[2]["stats"]["dense"] == 2 * (2 + 3)  # the warm-up step, and layer 0 at the 3 other steps
    assert doc["meta"]["testbed"]["tokens"] == 128 and doc["meta"]["seeds"] == [0, 1, 2]
    assert "--- targets ---" in proc.stdout
    # resume: nothing left to do
    again = subprocess.run(cmd + ["--skip-from", str(out / "quality.json"), "--out", str(tmp_path / "o2")],
                           capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert again.returncode == 0 and json.loads((tmp_path / "o2" / "quality.json").read_text())["rows"] == []
    md = tmp_path / "q.md"
    rep = subprocess.run([sys.executable, str(BENCH / "quality.py"), "--report", str(out / "quality.json"),
                          "--report-out", str(md), "--plot-out", str(tmp_path / "q.png")],
                         capture_output=True, text=True, timeout=120)
    assert rep.returncode == 0, rep.stderr
    assert "## 4 steps" in md.read_text() and "random weights" in md.read_text()
