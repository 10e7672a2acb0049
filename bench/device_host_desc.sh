#!/usr/bin/env bash
# One H200 call (nothing to carry): the Hopper kernel with host-made descriptors against in-kernel ones
# (bench/host_desc.py; docs/kernel_notes.md, "v15"), the GPU tests (every kernel variant against its twin, the engine
# on the GPU), then (POINTER=1) the pointer-load kernels timed with Triton's autotuning choices printed (SPARSE_ATTN_TMA=0: the
# 8-warp candidates added for the cards without TMA, docs/kernel_notes.md "v14"). Packed into $OUT/host_desc.tar.gz.
#   bash bench/device_host_desc.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_part.sh
new_root /tmp/hostdesc
record_gpu
part host-desc "${HOST_S:-220}" python3 bench/host_desc.py --out "$root/host-desc" --dense \
  --shapes "${SHAPES:-wan14b,wan13b,hyv}" --budget-s "$(( ${HOST_S:-220} - 20 ))"
# the GPU tests the code since the last device run touches first (the engine, the fp8 residual read as bytes, the
# TMA variants), the rest of the file after them
first="engine or fp8 or on_cuda or variants_match_twin or anchor_residual or mass_weighted or fast_launch or dispatch"
part gpu-tests "${TESTS_S:-150}" env SPARSE_ATTN_TUNE=first python3 -m pytest -q -rs -m gpu \
  tests/test_gpu_kernels.py tests/test_torch_backend.py -p no:cacheprovider -k "$first"
part gpu-tests-rest "${REST_S:-150}" env SPARSE_ATTN_TUNE=first python3 -m pytest -q -rs -m gpu \
  tests/test_gpu_kernels.py -p no:cacheprovider -k "not ($first)"
[ "${POINTER:-0}" = 1 ] && part kernels-pointer "${KERNELS_S:-110}" env SPARSE_ATTN_TMA=0 TRITON_PRINT_AUTOTUNING=1 python3 bench/kernels.py \
  --out "$root/kernels-pointer" --shapes wan13b --no-flex
tar czf "$OUT/host_desc.tar.gz" -C /tmp hostdesc
ls -la "$OUT"
