"""bench/quality_search.py (per-head densities searched on the sampled output) on the CPU with the stand-in
quality testbed (tests/quality_testbed_fake): the whole path, and the move that keeps the average density."""

import json
import subprocess
import sys

import pytest
from conftest import ROOT

BENCH = ROOT / "bench"
FAKE_TESTBED = ROOT / "tests" / "quality_testbed_fake"


@pytest.fixture
def search_module(bench_import):
    return bench_import("quality_search")


def test_a_move_keeps_the_mean_and_the_bounds(search_module):
    f = [1.0, 1.0, 1.0, 1.0]
    up = search_module.moved(f, 1, 0.5, 0.25, 4.0)
    assert up[1] == 1.5 and abs(sum(up) / 4 - 1.0) < 1e-12 and all(abs(x - 2.5 / 3) < 1e-12 for i, x in
                                                                    enumerate(up) if i != 1)
    down = search_module.moved(up, 1, -0.5, 0.25, 4.0)
    assert abs(sum(down) / 4 - 1.0) < 1e-12 and abs(down[1] - 1.0) < 1e-12
    assert search_module.moved(f, 0, -0.8, 0.25, 4.0) is None  # 0.2 is below the lower bound
    assert search_module.moved([0.3, 1.0, 1.0, 1.7], 3, 1.0, 0.25, 4.0) is None  # 0.3 would be scaled below 0.25
    assert search_module.as_layer_densities([0.5, 1.5, 1.0, 1.0], 2) == {0: [0.5, 1.5], 1: [1.0, 1.0]}


def test_a_search_continues_from_printed_factors(search_module):
    from comfyui_sparse_attention.engine.layer_density import parse_layer_densities
    flat = search_module.start_factors("{0: [0.5, 1.5], 2: 2}", 3, 2, parse_layer_densities)
    assert len(flat) == 6 and abs(sum(flat) / 6 - 1.0) < 1e-12
    assert flat[1] / flat[0] == 3.0 and flat[4] == flat[5] and flat[2] == flat[3]
    with pytest.raises(SystemExit, match="layer 5"):
        search_module.start_factors("{5: 1.5}", 3, 2, parse_layer_densities)
    with pytest.raises(SystemExit, match="3 factors for 2 heads"):
        search_module.start_factors("{0: [1, 1, 1]}", 3, 2, parse_layer_densities)


def test_search_end_to_end_on_the_fake_testbed(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, str(BENCH / "quality_search.py"), "--testbed", str(FAKE_TESTBED), "--out", str(out),
           "--random-init-small", "--steps", "3", "--warmup", "0", "--anchors", "0", "--density", "0.25",
           "--fit-seeds", "0,1", "--check-seeds", "2", "--rounds", "2", "--device", "cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads((out / "search.json").read_text())
    r, heads = doc["result"], doc["meta"]["testbed"]["heads"]
    factors = r["factors"]
    assert len(factors) == doc["meta"]["testbed"]["layers"] * heads
    assert abs(sum(factors) / len(factors) - 1.0) < 1e-3  # the average density is the uniform one
    assert all(0.25 - 1e-6 <= f <= 4.0 + 1e-6 for f in factors)
    # every candidate of round 1 was sampled: two moves per head, minus those leaving the bounds
    assert doc["rounds"][0]["complete"] and doc["rounds"][0]["scored"] == len(
        [m for m in doc["moves"] if m["round"] == 1]) == 2 * len(factors)
    taken = doc["rounds"][0]["taken"]
    if taken:  # the move taken is the best scored one, and the fit PSNR is its score
        best = max((m for m in doc["moves"] if m["round"] == 1), key=lambda m: m["psnr_mean"])
        assert best["move"] == taken and r["searched"]["fit"]["psnr_mean"] == best["psnr_mean"]
    else:
        assert factors == [1.0] * len(factors)
    for name in ("uniform", "searched"):
        assert len(r[name]["fit"]["psnr"]) == 2 and len(r[name]["check"]["psnr"]) == 1
        assert abs(r[name]["check"]["density_sparse"] - 0.25) < 0.05
    md = (out / "search.md").read_text()
    assert md.startswith("### A search on the output") and "| uniform |" in md and "| searched |" in md


def test_layer_scope_moves_every_head_of_a_layer_together(tmp_path):
    """--scope layer: a round samples two moves per layer (not per head), the model's allocation is fitted on layers,
    and every head of a layer ends with its layer's factor."""
    out = tmp_path / "out"
    cmd = [sys.executable, str(BENCH / "quality_search.py"), "--testbed", str(FAKE_TESTBED), "--out", str(out),
           "--random-init-small", "--steps", "3", "--warmup", "0", "--anchors", "0", "--density", "0.25",
           "--fit-seeds", "0", "--check-seeds", "2", "--rounds", "1", "--min-gain-db", "-1000", "--device", "cpu",
           "--scope", "layer", "--mode", "quadratic", "--start", "{0: [0.5, 1.5]}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads((out / "search.json").read_text())
    layers, heads = doc["meta"]["testbed"]["layers"], doc["meta"]["testbed"]["heads"]
    singles = [m["move"] for m in doc["moves"] if m["move"][-1] in "+-"]
    assert sorted(singles) == sorted(f"{layer}{sign}" for layer in range(layers) for sign in "+-")
    assert any(m["move"].startswith("model") for m in doc["moves"])  # the quadratic model, fitted on layers
    factors = doc["result"]["factors"]
    assert len(factors) == layers * heads and abs(sum(factors) / len(factors) - 1.0) < 1e-3
    per_layer = [factors[layer * heads:(layer + 1) * heads] for layer in range(layers)]
    assert all(len(set(f)) == 1 for f in per_layer)  # --start's heads 0.5 / 1.5 became their layer's mean
    assert doc["rounds"][0]["taken"] and doc["meta"]["scope"] == "layer"
    assert "Factors per layer" in (out / "search.md").read_text()


def test_search_starts_from_given_factors(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, str(BENCH / "quality_search.py"), "--testbed", str(FAKE_TESTBED), "--out", str(out),
           "--random-init-small", "--steps", "3", "--warmup", "0", "--anchors", "0", "--density", "0.25",
           "--fit-seeds", "0,1", "--check-seeds", "2", "--rounds", "1", "--min-gain-db", "1000", "--device", "cpu",
           "--start", "{0: [0.5, 1.5]}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads((out / "search.json").read_text())
    assert doc["meta"]["start"] == "{0: [0.5, 1.5]}" and doc["rounds"][0]["taken"] is None  # no move clears 1000 dB
    assert doc["result"]["factors"] == [0.5, 1.5, 1.0, 1.0]  # kept as given (mean 1 already)
    assert doc["result"]["searched"]["fit"] != doc["result"]["uniform"]["fit"]
    assert doc["result"]["start_fit"] == doc["result"]["searched"]["fit"]  # round 1's moves were measured from it


def test_no_rounds_samples_the_given_allocation(tmp_path):
    """--rounds 0 --start: an allocation made elsewhere (bench/search_model.py's optimum) scored on both seed sets."""
    out = tmp_path / "out"
    cmd = [sys.executable, str(BENCH / "quality_search.py"), "--testbed", str(FAKE_TESTBED), "--out", str(out),
           "--random-init-small", "--steps", "3", "--warmup", "0", "--anchors", "0", "--density", "0.25",
           "--fit-seeds", "0,1", "--check-seeds", "2", "--rounds", "0", "--device", "cpu",
           "--start", "{0: [0.25, 1.5], 1: [1.25, 1]}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads((out / "search.json").read_text())
    assert doc["rounds"] == [] and doc["moves"] == [] and doc["result"]["factors"] == [0.25, 1.5, 1.25, 1.0]
    assert doc["result"]["searched"]["check"] != doc["result"]["uniform"]["check"]
    assert "No rounds: the allocation given with --start" in (out / "search.md").read_text()


def test_anchor_factors_apply_to_every_allocation_the_search_samples(tmp_path):
    """--anchor-factors: uniform and the searched allocation both move density between the anchors (the uniform row
    differs from a search without them), and the report says so."""
    docs = {}
    for name, extra in (("plain", []), ("split", ["--anchor-factors", "2,0.5"])):
        out = tmp_path / name
        cmd = [sys.executable, str(BENCH / "quality_search.py"), "--testbed", str(FAKE_TESTBED), "--out", str(out),
               "--random-init-small", "--steps", "4", "--warmup", "0", "--anchors", "0,2", "--density", "0.25",
               "--fit-seeds", "0,1", "--check-seeds", "2", "--rounds", "0", "--device", "cpu", *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        docs[name] = json.loads((out / "search.json").read_text())
    assert docs["split"]["meta"]["anchor_factors"] == "2,0.5" and not docs["plain"]["meta"]["anchor_factors"]
    assert docs["split"]["result"]["uniform"]["fit"]["psnr"] != docs["plain"]["result"]["uniform"]["fit"]["psnr"]
    report = (tmp_path / "split" / "search.md").read_text()
    assert "(anchor density factors 2,0.5, in every row, uniform's too)" in report


def test_search_refuses_start_factors_outside_the_bounds(tmp_path):
    cmd = [sys.executable, str(BENCH / "quality_search.py"), "--testbed", str(FAKE_TESTBED), "--out",
           str(tmp_path), "--random-init-small", "--fit-seeds", "0", "--check-seeds", "1", "--device", "cpu",
           "--steps", "2", "--warmup", "0", "--anchors", "0", "--start", "{0: [0.01, 1]}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "outside" in proc.stderr and "--min-factor" in proc.stderr


def test_search_refuses_overlapping_seed_sets(tmp_path):
    cmd = [sys.executable, str(BENCH / "quality_search.py"), "--testbed", str(FAKE_TESTBED), "--out",
           str(tmp_path), "--random-init-small", "--fit-seeds", "0,1", "--check-seeds", "1,2", "--device", "cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "must not share a seed" in proc.stderr


def test_allocations_are_sampled_side_by_side_on_the_fake_testbed(tmp_path, bench_import):
    """bench/quality_allocations.py: uniform and every named allocation on each video, gains against uniform."""
    alloc = bench_import("quality_allocations")
    assert alloc.parse_allocs(["a={0: [2, 1]}", "b = {1: 0.5}", "c=anchors 2, 0.5;", "d=anchors 2,0.5; {0: 3}"]) == [
        ("a", "{0: [2, 1]}", ""), ("b", "{1: 0.5}", ""), ("c", None, "2, 0.5"), ("d", "{0: 3}", "2,0.5")]
    for bad, why in (("a", "NAME=LAYER_DENSITIES"), ("uniform={0: 2}", "taken"), ("=x", "NAME="),
                     ("e=anchors ;", "NAME=anchors")):
        with pytest.raises(SystemExit, match=why):
            alloc.parse_allocs([bad])
    with pytest.raises(SystemExit, match="taken"):
        alloc.parse_allocs(["a={0: 2}", "a={1: 2}"])
    out = tmp_path / "out"
    cmd = [sys.executable, str(BENCH / "quality_allocations.py"), "--testbed", str(FAKE_TESTBED), "--out", str(out),
           "--random-init-small", "--steps", "3", "--warmup", "0", "--anchors", "0,2", "--density", "0.25",
           "--seeds", "0,1,2", "--batch", "2", "--device", "cpu", "--alloc", "same={0: 1}", "--alloc",
           "tilted={0: [3, 1]}", "--alloc", "flat=anchors 1, 1;", "--alloc", "early=anchors 2, 0.5; {0: [3, 1]}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads((out / "allocations.json").read_text())
    res = doc["results"]
    assert list(res) == ["uniform", "same", "tilted", "flat", "early"]
    assert all(len(r["psnr"]) == len(r["ssim"]) == 3 and len(r["seconds"]) == 2 for r in res.values())
    # factors that average to 1 everywhere are the uniform density itself: the same videos
    assert res["same"]["psnr"] == res["uniform"]["psnr"] == res["flat"]["psnr"]
    # anchor factors: recorded, and the first anchor's doubled density serves step 1 (0.5 at the anchor of step 2)
    assert doc["meta"]["anchor_density_factors"] == {"flat": [1.0, 1.0], "early": [2.0, 0.5]}
    assert doc["meta"]["allocations"]["early"] == doc["meta"]["allocations"]["tilted"]
    assert res["early"]["psnr"] != res["tilted"]["psnr"]
    assert doc["meta"]["allocations"]["uniform"] is None
    tilted = doc["meta"]["allocations"]["tilted"]
    assert tilted.startswith("{0: [") and res["tilted"]["psnr"] != res["uniform"]["psnr"]
    md = (out / "allocations.md").read_text()
    assert "| tilted |" in md and "seeds) [0, 1, 2] of [0, 1, 2]" in md
