#!/usr/bin/env bash
# One H200 call (nothing to carry) for the GPUs without TMA (docs/kernel_notes.md, "v14"): the GPU test of the fp8
# residual read as bytes (Ampere's path, run here on real hardware against the typed load) and the kernel variants'
# tests, then bench/kernels.py on the pointer-load kernels (SPARSE_ATTN_TMA=0) with Triton's autotuning choices
# printed (TRITON_PRINT_AUTOTUNING=1), so the 8-warp candidates added for consumer cards are timed beside the
# 4-warp ones on one GPU. Packed into $OUT/pointer.tar.gz.
#   bash bench/device_pointer.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_part.sh
new_root /tmp/pointer
record_gpu
part gpu_tests "${TESTS_S:-240}" env SPARSE_ATTN_TUNE=first python3 -m pytest -q -rs -m gpu tests/test_gpu_kernels.py \
  -p no:cacheprovider -k "fp8_residual_read_as_bytes or variants_match_twin or pointer"
part kernels-pointer "${KERNELS_S:-300}" env SPARSE_ATTN_TMA=0 TRITON_PRINT_AUTOTUNING=1 python3 bench/kernels.py \
  --out "$root/kernels-pointer" --shapes "${SHAPES:-wan13b,wan14b}" --no-flex
tar czf "$OUT/pointer.tar.gz" -C /tmp pointer
ls -la "$OUT"
