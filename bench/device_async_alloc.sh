#!/usr/bin/env bash
# On the H100/H200 (nothing to carry): the pack under PyTorch's cudaMallocAsync backend (ComfyUI's default allocator;
# docs/kernel_notes.md, "v25"). bench/async_graph_probe.py's stages, one process each: under the native allocator,
# under cudaMallocAsync with the query grouping's CUDA graphs forced on (SPARSE_ATTN_GROUPING_GRAPH=force) and with
# the default (graphs on there too since v28, so the two now run the same; before, off); then, under cudaMallocAsync,
# the GPU tests TESTS_K selects, in one process with the default and in one with the graphs forced on (the same since
# v28: narrow with MODES and TEST_MODES); with FULL set, every GPU test of
# tests/test_gpu_kernels.py under cudaMallocAsync (FULL_TIMEOUT seconds at most). MODES narrows the probes' settings
# (native, async-force, async-default), TEST_MODES the tests' (1, force).
# Everything lands in $OUT/async-alloc.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 SPARSE_ATTN_TUNE=first
res="$OUT/async-alloc"
mkdir -p "$res"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$res/gpu.txt"
async=backend:cudaMallocAsync
pack() { tar czf "$OUT/async-alloc.tgz" -C "$OUT" async-alloc; }  # after each part: a run cut short keeps the rest
probe() {  # probe NAME ALLOC_CONF GRAPH STAGE
  PYTORCH_CUDA_ALLOC_CONF=$2 SPARSE_ATTN_GROUPING_GRAPH=$3 timeout 90 python3 bench/async_graph_probe.py "$4" \
    > "$res/probe-$1-$4.log" 2>&1
  echo "probe $1 $4: rc $? $(grep -a '^step\|^ok' "$res/probe-$1-$4.log" | tail -1)"
}
modes=" ${MODES:-native async-force async-default} "  # which allocator settings the probes run under
for stage in ${STAGES:-cublas capture graph_first engine}; do
  [[ $modes == *" native "* ]] && probe native "" 1 "$stage"
  [[ $modes == *" async-force "* ]] && probe async-force "$async" force "$stage"
  [[ $modes == *" async-default "* && $stage != cublas ]] && probe async-default "$async" 1 "$stage"
done
pack
k=${TESTS_K-grouping_graph or side_stream or cond_and_uncond}
if [ -n "$k" ]; then
  for mode in ${TEST_MODES:-1 force}; do  # SPARSE_ATTN_GROUPING_GRAPH for the tests under cudaMallocAsync
    PYTORCH_CUDA_ALLOC_CONF=$async SPARSE_ATTN_GROUPING_GRAPH=$mode timeout 240 python3 -m pytest -q -rs -m gpu \
      tests/test_gpu_kernels.py -p no:cacheprovider -k "$k" > "$res/tests-async-$mode.log" 2>&1
    echo "tests, cudaMallocAsync, graphs $mode: rc $? $(grep -a "passed\|failed\|Abort" "$res/tests-async-$mode.log" \
      | tail -1)"
    pack
  done
fi
if [ -n "${FULL:-}" ]; then  # every GPU test of tests/test_gpu_kernels.py under cudaMallocAsync, the default setting
  PYTORCH_CUDA_ALLOC_CONF=$async timeout "${FULL_TIMEOUT:-300}" python3 -m pytest -q -rs -m gpu \
    tests/test_gpu_kernels.py -p no:cacheprovider > "$res/tests-async-all.log" 2>&1
  echo "all GPU tests, cudaMallocAsync: rc $? $(grep -a "passed\|failed\|Abort" "$res/tests-async-all.log" | tail -1)"
fi
pack && rm -rf "$res"
