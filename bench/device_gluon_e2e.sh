#!/usr/bin/env bash
# On the H100/H200 (carry [".carry/bundle.tar.xz"], bench/device_bundle.sh with ComfyUI 0.3.75): the presets' setting
# end to end with the TMA kernels (SPARSE_ATTN_GLUON=0, and the dense step timed on this card), then with the Gluon
# kernel (kernels/attention_gluon.py) on the same card against that dense step. Extra arguments go to bench/e2e.py
# (default: Wan 14B, block_topk 0.08 on every layer, the steps PATTERN (default ArAr: anchor / reuse / anchor / reuse)
# timed, projected to 30 steps).
# First the GPU test of a batch of two on the Gluon kernel. Output: $OUT/gpu-tests.log, $OUT/tma/, $OUT/gluon/.
set -uo pipefail
cd "$(dirname "$0")/.."
base="$OUT"
args=("$@")
[ "${#args[@]}" -gt 0 ] || args=(--models wan14b --modes block_topk@0.08 --warmup-layers 0 --pattern "${PATTERN:-ArAr}"
                                  --total-steps 30)
mkdir -p "$base"
timeout 120 python3 -m pytest -q -m gpu tests/test_gpu_kernels.py -k "gluon_batch" -p no:cacheprovider \
  > "$base/gpu-tests.log" 2>&1
tail -3 "$base/gpu-tests.log"
OUT="$base/tma" SPARSE_ATTN_GLUON=0 bash bench/device_e2e.sh "${args[@]}" > "$base/tma.log" 2>&1
tail -25 "$base/tma.log" | cut -c1-240
OUT="$base/gluon" bash bench/device_e2e.sh "${args[@]}" --reuse-dense "$base/tma/e2e.json" > "$base/gluon.log" 2>&1
tail -25 "$base/gluon.log" | cut -c1-240
