#!/usr/bin/env bash
# On a two-GPU H200 machine (kind nvidia-h200-x2; carry: .carry/bundle-033.tar.xz, built by
#   COMFYUI_PATH=/path/to/ComfyUI-0.33.0 BUNDLE=.carry/bundle-033.tar.xz bash bench/device_bundle.sh):
# bench/multigpu.py for Wan 2.1 1.3B 480p and 14B 720p, dense and the preset's sparse mode, on one GPU and split
# over two by ComfyUI 0.33.0's MultiGPU CFG Split. Results packed into $OUT/multigpu.tar.gz.
#   bash bench/device_multigpu.sh [SECONDS (default 540)] [multigpu.py arguments]
set -uo pipefail
cd "$(dirname "$0")/.."
secs=${1:-540}
shift || true
source bench/device_part.sh
new_root /tmp/multigpu
source bench/device_comfyui.sh
unpack_comfyui .carry/bundle-033.tar.xz
# the machine's own settings (KINDS.md): NVLink multicast stays off
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
record_gpu
nvidia-smi topo -m >> "$root/gpu.txt" 2>&1
part multigpu "$secs" python3 bench/multigpu.py --out "$root/multigpu" --models wan13b,wan14b \
  --budget-s $((secs - 20)) "$@"
tar czf "$OUT/multigpu.tar.gz" -C /tmp multigpu
ls -la "$OUT"
