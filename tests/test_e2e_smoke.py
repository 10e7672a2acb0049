"""bench/e2e.py runs end to end (shrunken models on the CPU), so the GPU benchmark does not rot."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, comfyui_path

pytestmark = pytest.mark.comfyui


def test_e2e_benchmark_smoke(tmp_path):
    env = dict(os.environ, COMFYUI_PATH=str(comfyui_path()), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "e2e.py"), "--out", str(tmp_path), "--tiny",
                           "--models", "wan13b", "--methods", "mc_sparse", "--densities", "0.25"],
                          cwd=str(comfyui_path()), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads((tmp_path / "e2e.json").read_text())["rows"]
    assert [r["mode"] for r in rows] == ["dense", "mc_sparse@0.25"]
    sparse = rows[1]
    assert 0.1 < sparse["density_kept"] < 0.4 and sparse["projected_s"] > 0 and sparse["ceiling_speedup"] >= 1.0
    assert (tmp_path / "e2e.md").read_text().count("| wan13b |") == 2
