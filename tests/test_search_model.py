"""bench/search_model.py: the per-head quadratic model of the output search (docs/calibration.md, "A model of the
output") — the fit through two moves, the constrained optimum, and the offline report on a search.json — and
bench/quality_search.py's --mode quadratic on the stand-in testbed."""

import itertools
import json
import subprocess
import sys

import pytest
from conftest import ROOT

BENCH = ROOT / "bench"
FAKE_TESTBED = ROOT / "tests" / "quality_testbed_fake"


@pytest.fixture
def sm(bench_import):
    return bench_import("search_model")


def test_the_fit_goes_through_both_moves_and_caps_the_curvature(sm):
    truth = {"0.0": (0.4, -0.8), "0.1": (-0.2, -0.3), "1.0": (0.1, 0.6)}  # the last is convex
    step = 0.5
    gains = {h + s: a * d + b * d * d for h, (a, b) in truth.items() for s, d in (("+", step), ("-", -step))}
    model = sm.fit(gains, step, list(truth) + ["1.1"])
    for h in ("0.0", "0.1"):
        assert model[h] == pytest.approx(truth[h])
    assert model["1.0"] == pytest.approx((0.1, -sm.MIN_CURVATURE))  # convex: taken as slightly concave
    assert model["1.1"] == (0.0, -sm.MIN_CURVATURE)  # never measured: no slope
    one_sided = sm.fit({"0.0+": 0.3}, step, ["0.0"])["0.0"]
    a, b = one_sided
    assert b == -sm.MIN_CURVATURE and a * step + b * step * step == pytest.approx(0.3)


def test_the_optimum_keeps_the_mean_the_radius_and_the_bounds(sm):
    model = {"0.0": (1.0, -1.0), "0.1": (-1.0, -1.0)}
    d = sm.solve(model, radius=1.0)
    assert d["0.0"] == pytest.approx(0.5) and d["0.1"] == pytest.approx(-0.5)  # 2x - 2x^2 is largest at 0.5
    d = sm.solve(model, radius=0.3)
    assert d["0.0"] == pytest.approx(0.3) and sum(d.values()) == pytest.approx(0.0, abs=1e-12)
    # head 0.1's factor is 0.4: with lo 0.25 it may fall by 0.15 only, so head 0.0 rises by 0.15 only
    d = sm.solve(model, radius=1.0, factors={"0.0": 1.6, "0.1": 0.4}, lo=0.25, hi=4.0)
    assert d["0.1"] == pytest.approx(-0.15) and d["0.0"] == pytest.approx(0.15)
    with pytest.raises(ValueError, match="outside the bounds"):
        sm.solve(model, radius=0.1, factors={"0.0": 0.1, "0.1": 1.9}, lo=0.25)  # 0.1 cannot reach 0.25
    d = sm.solve(model, radius=1.0, factors={"0.0": 0.1, "0.1": 1.9}, lo=0.25)  # a radius that can: back inside
    assert d["0.0"] >= 0.15 - 1e-12 and sum(d.values()) == pytest.approx(0.0, abs=1e-12)


def test_the_optimum_beats_every_point_of_a_grid(sm):
    """Three heads, radius 0.5: no allocation on a 0.05 grid that keeps the mean scores above the solution."""
    model = {"0.0": (0.3, -0.4), "0.1": (-0.5, -0.2), "1.0": (0.05, -1.5)}
    best = sm.predict(model, sm.solve(model, radius=0.5))
    grid = [i * 0.05 for i in range(-10, 11)]
    for x, y in itertools.product(grid, grid):
        z = -x - y
        if abs(z) <= 0.5 + 1e-9:
            assert sm.predict(model, {"0.0": x, "0.1": y, "1.0": z}) <= best + 1e-9


def synthetic_search(truth: dict, step: float, rounds_taken: list[str], sm) -> dict:
    """A search.json whose PSNR is 30 dB plus an additive quadratic truth of the factors (what the model assumes),
    with greedy rounds taking the given moves — bench/quality_search.py's moves: one head changed by +-step, the
    others rescaled to keep the mean."""
    heads = list(truth)

    def psnr(f):
        return 30.0 + sum(a * (x - 1) + b * (x - 1) ** 2 for (a, b), x in zip(truth.values(), f))

    f = [1.0] * len(heads)
    moves, rounds = [], []
    for r, take in enumerate(rounds_taken + [None], start=1):
        for i, h in enumerate(heads):
            for s, d in (("+", step), ("-", -step)):
                g = sm.moved(f, i, d, 0.0, 4.0)
                if g is not None:  # a move out of the bounds is not sampled
                    moves.append(dict(round=r, move=h + s, psnr_mean=psnr(g), psnr_min=0.0, density_sparse=0.1))
        if take is not None:
            f = sm.moved(f, heads.index(take[:-1]), step if take[-1] == "+" else -step, 0.0, 4.0)
        rounds.append(dict(round=r, scored=2 * len(heads), candidates=2 * len(heads), complete=True, taken=take,
                           best_psnr=psnr(f)))
    return {"meta": {"command": "synthetic", "method": "mc_sparse", "density": 0.1, "step": step, "start": None,
                     "testbed": {"layers": 2, "heads": 2}},
            "moves": moves, "rounds": rounds,
            "result": {"uniform": {"fit": {"psnr_mean": 30.0}}, "searched": {"fit": {"psnr_mean": psnr(f)}},
                       "factors": f}}


def test_moves_that_rescale_the_other_heads_are_fitted_as_such(sm):
    """A move raises one head and lowers the others a little: the rescaled fit recovers every head's own terms,
    where crediting each gain to the moved head alone gets the slopes wrong."""
    truth = {"0.0": (0.6, -0.5), "0.1": (-0.4, -0.3), "1.0": (0.2, -0.9), "1.1": (-0.1, -0.2)}
    heads, step, f = list(truth), 0.5, [1.0] * 4
    gains = {}
    for i, h in enumerate(heads):
        for s, d in (("+", step), ("-", -step)):
            g = sm.moved(f, i, d, 0.0, 4.0)
            gains[h + s] = sum(a * (x - 1) + b * (x - 1) ** 2 for (a, b), x in zip(truth.values(), g))
    exact = sm.fit(gains, step, heads, factors=f)
    # moves keep the mean, so the slopes are known up to one constant added to all (which no such move sees): the
    # fit's differ from the truth's by their mean; the curvatures are the truth's
    shift = sum(a for a, _ in truth.values()) / 4
    for h in heads:
        assert exact[h] == pytest.approx((truth[h][0] - shift, truth[h][1]), abs=1e-9)
    naive = sm.fit(gains, step, heads)
    assert naive["0.0"][0] - naive["0.1"][0] != pytest.approx(truth["0.0"][0] - truth["0.1"][0], abs=1e-3)


def test_on_an_additive_truth_the_report_predicts_what_was_measured(sm, tmp_path):
    truth = {"0.0": (0.6, -0.5), "0.1": (-0.4, -0.3), "1.0": (0.2, -0.9), "1.1": (-0.1, -0.2)}
    doc = synthetic_search(truth, 0.5, ["0.0+", "0.1-"], sm)
    result = sm.analyse(doc, [], [0.5])
    shift = sum(a for a, _ in truth.values()) / 4  # slopes known up to a common constant (mean-keeping moves)
    assert result["model"]["0.0"] == pytest.approx([truth["0.0"][0] - shift, truth["0.0"][1]], abs=1e-4)
    check = result["checks"][0]
    assert check["predicted"] == pytest.approx(check["measured"], abs=1e-3)
    # consecutive rounds compared on the moves both sampled (round 3 cannot lower head 0.1 again: out of bounds)
    assert [(s["rounds"], s["moves"]) for s in result["stability"]] == [((1, 2), 8), ((2, 3), 7)]
    assert sm.spearman([1, 2, 3, 4], [10, 30, 20, 40]) == pytest.approx(0.8)
    assert sm.pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0) and sm.pearson([1, 1], [2, 3]) == 0.0
    opt = result["optima"][0]
    assert opt["predicted"] >= check["predicted"] - 1e-9  # the optimum within the radius beats the greedy search's
    assert sum(opt["factors"].values()) == pytest.approx(4.0, abs=1e-3)
    path = tmp_path / "search.json"
    path.write_text(json.dumps(doc))
    proc = subprocess.run([sys.executable, str(BENCH / "search_model.py"), str(path), "--radius", "0.5",
                           "--out", str(tmp_path / "t.md")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    md = (tmp_path / "t.md").read_text()
    assert "| 1 → 2 |" in md and "model optimum, radius 0.5" in md and "- radius 0.5: `{0: [" in md


def test_moves_from_another_allocation_are_predicted_where_the_truth_is_the_model(sm):
    """A search that started elsewhere (its meta 'start', its start's PSNR in 'start_fit'): on an additive quadratic
    truth the model fitted at uniform predicts each of its moves (rescaling included) exactly."""
    from comfyui_sparse_attention.engine.layer_density import parse_layer_densities
    truth = {"0.0": (0.6, -0.5), "0.1": (-0.4, -0.3), "1.0": (0.2, -0.9), "1.1": (-0.1, -0.2)}
    heads = list(truth)

    def psnr(f):
        return 30.0 + sum(a * (x - 1) + b * (x - 1) ** 2 for (a, b), x in zip(truth.values(), f))

    fitted = sm.analyse(synthetic_search(truth, 0.5, [], sm), [], [0.5])
    model = {h: tuple(v) for h, v in fitted["model"].items()}
    start = [1.4, 0.6, 1.1, 0.9]
    moves = []
    for i, h in enumerate(heads):
        for s, d in (("+", 0.25), ("-", -0.25)):
            moves.append(dict(round=1, move=h + s, psnr_mean=psnr(sm.moved(start, i, d, 0.0, 4.0)), psnr_min=0.0,
                              density_sparse=0.1))
    other = {"meta": {"command": "x", "step": 0.25, "start": "{0: [1.4, 0.6], 1: [1.1, 0.9]}",
                      "testbed": {"layers": 2, "heads": 2}},
             "moves": moves, "rounds": [dict(round=1, taken="0.0+", best_psnr=max(m["psnr_mean"] for m in moves))],
             "result": {"start_fit": {"psnr_mean": psnr(start)}}}
    n = sm.neighbour_check(model, other, heads, parse_layer_densities)
    assert n["moves"] == 8 and n["spearman"] == pytest.approx(1.0)
    assert n["measured_up"] == n["predicted_up"] > 0
    del other["result"]["start_fit"]  # an older file: the start's PSNR unknown, the ranks still compared
    n = sm.neighbour_check(model, other, heads, parse_layer_densities)
    assert n["measured_up"] is None and n["measured_range"] is None and n["spearman"] == pytest.approx(1.0)


def test_the_report_refuses_a_search_that_did_not_start_from_uniform(sm):
    doc = synthetic_search({"0.0": (0.1, -0.1), "0.1": (0.0, -0.1), "1.0": (0.0, -0.1), "1.1": (0.0, -0.1)},
                           0.5, [], sm)
    doc["meta"]["start"] = "{0: [0.5, 1.5]}"
    with pytest.raises(SystemExit, match="uniform"):
        sm.analyse(doc, [], [0.5])


def test_quadratic_search_end_to_end_on_the_fake_testbed(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, str(BENCH / "quality_search.py"), "--testbed", str(FAKE_TESTBED), "--out", str(out),
           "--random-init-small", "--steps", "3", "--warmup", "0", "--anchors", "0", "--density", "0.25",
           "--fit-seeds", "0,1", "--check-seeds", "2", "--rounds", "2", "--device", "cpu", "--mode", "quadratic",
           "--radius", "0.4", "--min-gain-db", "-1000"]  # every round takes its best allocation
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads((out / "search.json").read_text())
    assert doc["meta"]["mode"] == "quadratic" and doc["meta"]["radius"] == 0.4
    for rd in doc["rounds"]:
        assert rd["complete"] and rd["scored"] == rd["candidates"] and rd["model_predicted"] is not None
        mine = [m for m in doc["moves"] if m["round"] == rd["round"]]
        model = [m for m in mine if "predicted_gain" in m]
        assert len(model) == 1 and model[0]["move"] == "model r0.4" and len(mine) == rd["scored"] + 1
        assert rd["taken"] == max(mine, key=lambda m: m["psnr_mean"])["move"]
    factors = doc["result"]["factors"]
    assert abs(sum(factors) / len(factors) - 1.0) < 1e-3 and all(0.25 - 1e-6 <= f <= 4.0 + 1e-6 for f in factors)
    md = (out / "search.md").read_text()
    assert "quadratic model" in md and "(model: predicted" in md
