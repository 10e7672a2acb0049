#!/usr/bin/env bash
# On the H200 (nothing to carry): GPU kernel tests, then bench/hopper.py; everything lands in $OUT.
#   bash bench/device_hopper.sh [bench/hopper.py arguments, e.g. --budget 240 --skip-tests]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/hopper-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
python3 bench/hopper.py --out "$out" "$@" 2>&1 | tee "$out/hopper.log"
