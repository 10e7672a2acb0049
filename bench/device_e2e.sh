#!/usr/bin/env bash
# On the H200 (carry: [".carry"], built by bench/device_bundle.sh): unpack ComfyUI and the wheels (BUNDLE names
# another bundle than .carry/bundle.tar.xz), run bench/e2e.py with the given arguments, results and log under $OUT;
# the GPU's clocks, power, temperature, throttle reasons and memory every half second in $OUT/smi.csv.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/device_comfyui.sh
unpack_comfyui "${BUNDLE:-.carry/bundle.tar.xz}"
out=${OUT:-/tmp/e2e/out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
nvidia-smi --format=csv -lms 500 \
  --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active,memory.used \
  > "$out/smi.csv" 2>&1 &
smi=$!
trap 'kill $smi 2>/dev/null || true' EXIT
python3 bench/e2e.py --out "$out" "$@" 2>&1 | tee "$out/e2e.log"
