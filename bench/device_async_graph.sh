#!/usr/bin/env bash
# On the H100/H200 (nothing to carry): docs/kernel_notes.md, "v28". The whole-anchor GPU test (native allocator);
# the query grouping's CUDA graphs under cudaMallocAsync (ComfyUI's default allocator), capturing PyTorch's gathers
# (grouping_graph.graph_gather): bench/device_async_alloc.sh's probes (capture, engine, torch_gather) and the GPU
# tests TESTS_K selects; then the mc_sparse anchor (24 heads, TOKENS 16384 or 4608, bench/engine.py, d 0.15) under
# cudaMallocAsync without the graphs (SPARSE_ATTN_GROUPING_GRAPH=0) and with them, and under the native allocator.
# (v28's raw logs came from this script when graphs were off by default under cudaMallocAsync: "async-graphs-1" there
# is without them, "async-graphs-force" with them.)
# Output: $OUT/v28/ (logs, engine JSON) and $OUT/async-alloc.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 SPARSE_ATTN_TUNE=first
res="$OUT/v28"
mkdir -p "$res"
timeout 150 python3 -m pytest -q -m gpu tests/test_gpu_kernels.py -p no:cacheprovider -k whole_anchor \
  > "$res/whole-anchor.log" 2>&1
echo "whole anchor: rc $? $(tail -1 "$res/whole-anchor.log")"
STAGES="capture engine torch_gather" MODES=async-force TEST_MODES=force \
  TESTS_K=${TESTS_K-grouping_graph or side_stream or cond_and_uncond or whole_anchor} bash bench/device_async_alloc.sh
grid=$([ "${TOKENS:-16384}" = 4608 ] && echo "--frames 9 --height 16 --width 32" || echo "--frames 16 --height 32 --width 32")
for run in async:0 async:1 native:1; do
  conf=$([ "${run%%:*}" = async ] && echo backend:cudaMallocAsync || echo "")
  name=${run/:/-graphs-}
  PYTORCH_CUDA_ALLOC_CONF=$conf SPARSE_ATTN_GROUPING_GRAPH=${run#*:} timeout 150 python3 bench/engine.py \
    --out "$res/$name" --methods mc_sparse --heads 24 $grid --overhead-reps 5 \
    > "$res/$name.log" 2>&1 || { echo "$name: failed"; tail -5 "$res/$name.log"; continue; }
  python3 - "$res/$name/engine.json" "$name" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))["mc_sparse"]
print(sys.argv[2], {k: round(m[k], 3) for k in ("anchor_ms", "anchor_x_cudnn", "grouping_ms", "reuse_ms") if k in m})
PY
done
# PyTorch's "uncaptured free of a captured allocation" (v25-v27): over the probes' and tests' logs (in the archive) and
# this script's own
n=$( (tar xzf "$OUT/async-alloc.tgz" -O 2>/dev/null; cat "$res"/*.log) | grep -c "uncaptured free")
echo "uncaptured-free warnings: $n"
