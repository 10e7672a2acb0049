"""bench/quality_calibration.py end to end on the CPU with the stand-in quality testbed (tests/quality_testbed_fake):
record, calibrate, sample uniform and calibrated, write the JSON, the markdown section and the presets."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT

from comfyui_sparse_attention.engine import SparseConfig

BENCH = ROOT / "bench"
FAKE_TESTBED = ROOT / "tests" / "quality_testbed_fake"


def test_calibration_bench_end_to_end(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, str(BENCH / "quality_calibration.py"), "--testbed", str(FAKE_TESTBED), "--out", str(out),
           "--random-init-small", "--steps", "4", "--warmup", "0", "--anchors", "0,2", "--record-steps", "0,1,2,3",
           "--seeds", "0,1,2", "--batch", "2", "--densities", "0.25,0.5", "--methods", "mc_sparse,block_topk",
           "--device", "cpu", "--sensitivity-videos", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    doc = json.loads((out / "calibration.json").read_text())
    rows = doc["rows"]
    assert [(r["method"], r["density"], r["kind"]) for r in rows] == [
        (m, d, k) for m in ("mc_sparse", "block_topk") for d in (0.25, 0.5)
        for k in ("uniform", "calibrated", "calibrated within layers", "calibrated+sensitivity")]
    assert all("error" not in r and len(r["psnr"]) == 3 for r in rows)
    # the same schedule for both: 2 chunks x 2 layers x (2 anchors, 2 reuse steps)
    assert all(r["stats"]["anchor"] == 2 * 2 * 2 and r["stats"]["reuse"] == 2 * 2 * 2 for r in rows)
    assert doc["pairs"] == [[0, 1], [2, 3]]
    assert doc["meta"]["record_steps"] == [0, 1, 2, 3] and doc["meta"]["testbed"]["random_init"] is True
    assert len(doc["gains"]) == 12 and len(doc["curves"]) == 2 * 2 * 2  # methods x layers x heads
    for a in doc["allocations"]:  # within layers: every layer keeps its uniform share (factors average 1 per layer)
        within = next(r for r in rows if (r["method"], r["density"], r["kind"]) ==
                      (a["method"], a["target"], "calibrated within layers"))
        factors = SparseConfig.from_dict(within["config"]).layer_densities
        for layer, f in factors:
            per_head = f if isinstance(f, tuple) else (f, f)
            assert sum(per_head) / 2 == pytest.approx(1.0, abs=0.02), (a["method"], layer, f)
    for sens in doc["sensitivity"]:  # one single-layer run per layer, weights normalised to mean 1
        assert sorted(sens["mse_single_layer"]) == ["0", "1"] and sens["videos"] == 1
        assert sum(sens["layer_weights"].values()) / 2 == pytest.approx(1.0)
        assert (out / "presets" / f"{sens['method']}_d{sens['target']:g}_sensitivity.yaml").is_file()
    for a in doc["allocations"]:
        cfg = SparseConfig.from_yaml(out / "presets" / f"{a['method']}_d{a['target']:g}.yaml")
        assert cfg.method == a["method"] and cfg.density == a["target"] and cfg.anchor_steps.steps == (0, 2)
        calibrated = next(r for r in rows if (r["method"], r["density"], r["kind"]) ==
                          (a["method"], a["target"], "calibrated"))
        assert SparseConfig.from_dict(calibrated["config"]).layer_densities == cfg.layer_densities
    md = (out / "calibration.md").read_text()
    assert md.startswith("## Measured on the quality testbed") and "| mc_sparse | 0.25 |" in md
    assert "Target (+1.5 dB PSNR at density 0.10)" not in md  # 0.10 not measured here
    assert (out / "calibration-report.md").is_file()
    assert not list(out.glob("*.safetensors"))  # the recording stays out of the results


def test_calibration_bench_samples_the_spans_chosen_from_the_recording(tmp_path):
    """--anchor-spans: rows 'uniform+spans' and 'calibrated+spans' run with the anchor_density_factors that
    allocate_spans chose (kept in the JSON with the first span's cost curve), the reuse steps keeping their pairs."""
    out = tmp_path / "out"
    cmd = [sys.executable, str(BENCH / "quality_calibration.py"), "--testbed", str(FAKE_TESTBED), "--out", str(out),
           "--random-init-small", "--steps", "6", "--warmup", "0", "--anchors", "0,3", "--record-steps", "0,1,3,4",
           "--seeds", "0,1", "--batch", "2", "--densities", "0.25", "--methods", "mc_sparse", "--device", "cpu",
           "--sensitivity-videos", "0", "--anchor-spans"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    doc = json.loads((out / "calibration.json").read_text())
    kinds = [r["kind"] for r in doc["rows"]]
    assert kinds == ["uniform", "calibrated", "calibrated within layers", "uniform+spans", "calibrated+spans"]
    for span in doc["spans"]:
        assert span["steps"] == [2, 2] and len(span["factors"]) == 2
        assert sum(n * f for n, f in zip(span["steps"], span["factors"])) == pytest.approx(4, abs=1e-3)
        assert span["cost_calibrated"] <= span["cost_uniform"] + 1e-12 and span["costs_by_first_factor"]
        row = next(r for r in doc["rows"] if r["kind"] == span["kind"])
        assert SparseConfig.from_dict(row["config"]).anchor_density_factors == tuple(span["factors"])
    assert all(c["anchors"] == [0, 3] and len(c["reuse_spans"]) == 2 for c in doc["curves"])
