#!/usr/bin/env bash
# On the H100/H200 (nothing to carry). Two parts:
# 1. GPU tests not yet run on a GPU since the thirty-fifth session (docs/kernel_notes.md, "v28"): the whole-anchor
#    test (hybrid's variants are new), the grouping graphs, the side stream and every pinned-pool test, under the
#    native allocator and under cudaMallocAsync (ComfyUI's default).
# 2. The block kernel kernels/api.py picks against live FlexAttention on the same lists, alternated REPEATS times
#    (bench/hopper.py --plan flex): issue 14's >= 1.25x Flex target as a median, not one draw.
# Output: $OUT/flex-ab/ (test logs, hopper.json / hopper.md / hopper.log).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 SPARSE_ATTN_TUNE=first
res="$OUT/flex-ab"
mkdir -p "$res"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$res/gpu.txt"
k=${TESTS_K-whole_anchor or grouping_graph or side_stream or pinned or pool or host}
for conf in "" backend:cudaMallocAsync; do
  name=${conf:+async}; name=${name:-native}
  PYTORCH_CUDA_ALLOC_CONF=$conf timeout ${TESTS_TIMEOUT:-130} python3 -m pytest -q -m gpu tests/test_gpu_kernels.py \
    tests/test_residual_packing.py -p no:cacheprovider -k "$k" > "$res/tests-$name.log" 2>&1
  echo "tests ($name): rc $? $(tail -1 "$res/tests-$name.log")"
done
timeout ${FLEX_TIMEOUT:-330} python3 bench/hopper.py --plan flex --skip-tests --shapes ${SHAPES:-wan14b,hyv} \
  --densities ${DENSITIES:-0.25,0.1} --repeats ${REPEATS:-4} --budget ${BUDGET:-280} --out "$res" \
  > "$res/hopper.log" 2>&1
echo "flex plan: rc $?"
grep "vs Flex median\|FAILED\|failed" "$res/hopper.log"
