#!/usr/bin/env bash
# On the H200 (carry: [".carry/quality"], built by `bash bench/quality_bundle.sh --no-sol`): calibrated against uniform
# density on the quality testbed (bench/quality_calibration.py); JSON, markdown section, presets, report and log
# under $OUT. About 2 minutes.
#   bash bench/device_calibration.sh [bench/quality_calibration.py arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
b=.carry/quality
[ -f "$b/testbed/weights.safetensors" ] || { echo "no $b/testbed: run bench/quality_bundle.sh --no-sol and carry .carry/quality" >&2; exit 2; }
out=${OUT:-/tmp/calibration/out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
python3 bench/quality_calibration.py --testbed "$b/testbed" --out "$out" "$@" 2>&1 | tee "$out/calibration.log"
