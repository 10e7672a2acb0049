#!/usr/bin/env bash
# One H200 call (carry: .carry/bundle-033.tar.xz, built by `COMFYUI_PATH=.cache/comfyui-0.33.0
# BUNDLE=.carry/bundle-033.tar.xz bash bench/device_bundle.sh`): end to end with the shipped preset under ComfyUI
# 0.33.0 on the whole H200 (bf16 weights): Wan 2.1 14B 720p and HunyuanVideo 720p, dense against block_topk@0.15;
# first the lazy-rescale GPU test. Each part keeps what it measured; all packed into $OUT/e2e033.tar.gz.
#   bash bench/device_e2e_033.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_part.sh
new_root /tmp/e2e033
source bench/device_comfyui.sh
unpack_comfyui .carry/bundle-033.tar.xz
record_gpu
part lazy_test 90 env SPARSE_ATTN_TUNE=first python3 -m pytest -q -rs -m gpu tests/test_gpu_kernels.py -k lazy \
  -p no:cacheprovider
part wan14b 250 python3 bench/e2e.py --out "$root/wan14b" --models wan14b --modes block_topk@0.15 --budget-s 240
part hyv 220 python3 bench/e2e.py --out "$root/hyv" --models hyv --modes block_topk@0.15 --budget-s 210
tar czf "$OUT/e2e033.tar.gz" -C /tmp e2e033
ls -la "$OUT"
