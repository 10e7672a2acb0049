"""The device scripts (bench/device_*.sh) only run on the lent GPU machine; here: every one parses, and the helpers
they share (bench/device_part.sh) do what the scripts rely on, with stand-ins for nvidia-smi and python3."""

import subprocess

import pytest
from conftest import ROOT

SCRIPTS = sorted((ROOT / "bench").glob("device_*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_device_script_parses(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_scripts_that_use_the_helpers_source_them_first():
    for script in SCRIPTS:
        if script.name == "device_part.sh":  # the helpers themselves
            continue
        text = script.read_text()
        used = [f for f in ("need_quality_carry", "new_root ", "record_gpu", "part ") if f"\n{f}" in text]
        if used:
            first_use = min(text.index(f"\n{f}") for f in used)
            assert "source bench/device_part.sh" in text[:first_use], (script.name, used)


def test_part_helpers(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho '0, NVIDIA H200, 580.0, 143771 MiB'\n")
    (fake / "python3").write_text("#!/bin/sh\necho 'torch 2.11.0 triton 3.6.0'\n")
    for f in fake.iterdir():
        f.chmod(0o755)
    root = tmp_path / "run"
    root.mkdir()
    (root / "stale.txt").write_text("from an earlier run")
    script = f"""
set -uo pipefail
cd {ROOT}
source bench/device_part.sh
new_root {root}
record_gpu
part quick 20 sh -c 'echo "out=$OUT"; echo done'
part slow 1 sleep 5
echo "unbuffered=$PYTHONUNBUFFERED"
"""
    env = {"PATH": f"{fake}:/usr/bin:/bin"}
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert not (root / "stale.txt").exists()  # a fresh root
    assert (root / "gpu.txt").read_text().splitlines() == ["0, NVIDIA H200, 580.0, 143771 MiB",
                                                           "torch 2.11.0 triton 3.6.0"]
    assert (root / "quick" / "run.log").read_text().splitlines() == [f"out={root}/quick", "done"]
    assert "=== quick exit 0" in proc.stdout and "=== slow exit 124" in proc.stdout  # the time limit holds
    assert "unbuffered=1" in proc.stdout


def test_need_quality_carry_stops_without_the_testbed(tmp_path):
    """need_quality_carry (bench/device_part.sh): b is the carried testbed's folder, or the script stops (exit 2)."""
    script = f"""
cd {tmp_path}
source {ROOT}/bench/device_part.sh
need_quality_carry
echo "b=$b"
"""
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "no .carry/quality/testbed" in proc.stderr and "b=" not in proc.stdout
    (tmp_path / ".carry/quality/testbed").mkdir(parents=True)
    (tmp_path / ".carry/quality/testbed/weights.safetensors").write_bytes(b"")
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and proc.stdout.strip() == "b=.carry/quality"
