#!/usr/bin/env bash
# On the H200 (carry: [".carry"], built by bench/device_bundle.sh): unpack ComfyUI and the wheels (BUNDLE names
# another bundle than .carry/bundle.tar.xz), run bench/e2e.py with the given arguments, results and log under $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf /tmp/e2e && mkdir -p /tmp/e2e && tar xJf "${BUNDLE:-.carry/bundle.tar.xz}" -C /tmp/e2e
export PYTHONPATH=/tmp/e2e/site PYTHONUNBUFFERED=1 COMFYUI_PATH=/tmp/e2e/comfyui
# comfy_api imports PyAV (video files) at import time; the device has none and no model here reads video
python3 -c "import av" 2>/dev/null || cp -r bench/avstub/av /tmp/e2e/site/
# ComfyUI's main.py selects this allocator on CUDA builds of torch (cuda_malloc.py); the bench does not run
# main.py, so it asks for it here (set PYTORCH_CUDA_ALLOC_CONF to override)
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-backend:cudaMallocAsync}
out=${OUT:-/tmp/e2e/out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
python3 bench/e2e.py --out "$out" "$@" 2>&1 | tee "$out/e2e.log"
