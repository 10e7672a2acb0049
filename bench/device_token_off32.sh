#!/usr/bin/env bash
# On the H100/H200 (nothing to carry): the Gluon token kernel's loader with 64- and 32-bit row offsets
# (kernels/token_sparse_gluon.py, OFF32; docs/kernel_notes.md "v24"). First the GPU tests TESTS_K selects (default:
# the Gluon token kernel against its twin with both offsets, the grouping's scratch bound and the side stream's room
# check), then (unless TOKEN is empty) bench/hopper.py's token plan on SHAPES (default wan14b,hyv,wan13b: the loader's
# variants alternated), then (unless PERSIST is empty) the Gluon block kernel on its own and its persistent grid at
# d 0.15-0.5 (wan14b, hyv), then (unless ANCHOR is empty) the Wan 14B mc_sparse anchor as bench/device_mc_anchor.sh
# times it, once per word of ANCHOR (below).
# Everything lands in $OUT/token-off32.tgz (one file comes back).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
root=$OUT
res="$root/token-off32"
mkdir -p "$res"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$res/gpu.txt"
k=${TESTS_K-gluon_token or grouping_scratch or side_stream}
if [ -n "$k" ]; then
  SPARSE_ATTN_TUNE=first timeout 280 python3 -m pytest -q -rs -m gpu tests/test_gpu_kernels.py -p no:cacheprovider \
    -k "$k" > "$res/gpu-tests.log" 2>&1
  tail -6 "$res/gpu-tests.log"
fi
if [ -n "${TOKEN-1}" ]; then
  timeout 260 python3 bench/hopper.py --plan token --budget "${BUDGET:-150}" --shapes "${SHAPES:-wan14b,hyv,wan13b}" \
    --skip-tests --out "$res/hopper" > "$res/hopper.log" 2>&1
  grep "^|" "$res/hopper.log" | grep -v "^|---"
fi
if [ -n "${PERSIST-1}" ]; then  # the Gluon block kernel's two grids at d 0.15-0.5 (bench/hopper.py --plan persistent)
  timeout "${PERSIST_TIMEOUT:-260}" python3 bench/hopper.py --plan persistent --budget "${PERSIST_BUDGET:-150}" \
    --shapes "${PERSIST_SHAPES:-wan14b,hyv}" --densities "${PERSIST_DENSITIES:-0.15,0.2,0.25,0.3,0.5}" \
    --repeats "${PERSIST_REPEATS:-2}" \
    --skip-tests --out "$res/persistent" > "$res/persistent.log" 2>&1
  grep "^|" "$res/persistent.log" | grep -v "^|---" | cut -d'|' -f2-9
fi
# ANCHOR: the anchors to time, words ALLOCATOR:SIDE (allocator native or async, PyTorch's cudaMallocAsync backend,
# ComfyUI's default; SIDE the SPARSE_ATTN_SIDE_STREAM setting); "1" = native:1
for a in ${ANCHOR-1}; do
  [ "$a" = 1 ] && a=native:1
  alloc=${a%%:*} side=${a##*:}
  echo "anchor: allocator $alloc, side stream $side"
  (
    if [ "$alloc" = async ]; then export PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync; fi
    SPARSE_ATTN_SIDE_STREAM=$side OUT=$res/anchor-$alloc-$side VARIANTS=- TESTS_K= \
      timeout "${ANCHOR_TIMEOUT:-150}" bash bench/device_mc_anchor.sh
  )
done
tar czf "$root/token-off32.tgz" -C "$root" token-off32 && rm -rf "$res"
