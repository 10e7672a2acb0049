#!/usr/bin/env bash
# On the H200 (carry: [".carry/quality"], built by bench/quality_bundle.sh): run bench/quality.py on the carried
# testbed (Sol-Attn rows when the bundle has comfy-kitchen), then its report; results, log and report under $OUT.
#   bash bench/device_quality.sh [bench/quality.py arguments, e.g. --grid full --skip-from OLD/quality.json]
# Defaults: --grid quick --steps 30,8,4 --budget-s 540 (the device's limit is 600 s per call).
set -euo pipefail
cd "$(dirname "$0")/.."
b=.carry/quality
[ -f "$b/testbed/weights.safetensors" ] || { echo "no $b/testbed: run bench/quality_bundle.sh and carry .carry/quality" >&2; exit 2; }
rm -rf /tmp/quality && mkdir -p /tmp/quality/site
[ -f "$b/site.tar.xz" ] && tar xJf "$b/site.tar.xz" -C /tmp/quality
export PYTHONPATH=/tmp/quality/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
out=${OUT:-/tmp/quality/out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
python3 bench/quality.py --testbed "$b/testbed" --out "$out" --budget-s 540 "$@" 2>&1 | tee "$out/quality.log"
python3 bench/quality.py --report "$out/quality.json" --report-out "$out/quality.md" \
  --plot-out "$out/quality-frontier.png" 2>&1 | tail -1
