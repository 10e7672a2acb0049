#!/usr/bin/env bash
# On the H100/H200 (nothing to carry): the mc_sparse anchor's pass 2 with the one-dot packed kernel and its grouping
# replayed from a CUDA graph (kernel_notes "v22"): GPU tests (TESTS_K, default "mass or grouping_graph"), each pass-2
# kernel and configuration timed at Wan 14B (bench/mass_pack.py), the grouping with and without its graph
# (bench/grouping_graph.py) at Wan 14B and at SMALL ("heads frames height width", default "24 4 64 64"), a SMALL anchor
# with the graph and without, the Wan 14B anchor's phases (bench/device_mc_anchor.sh, VARIANTS), without the graph
# (SPARSE_ATTN_GROUPING_GRAPH=0: nograph/) unless NOGRAPH is empty, and, unless PROFILE is empty, an operator profile
# of the anchor's grouping and selection. Everything lands in
# $OUT/mass-pack.tgz (one file comes back).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
root=$OUT
res="$root/mass-pack"
mkdir -p "$res"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$res/gpu.txt"
if [ -n "${TESTS_K-mass or grouping_graph}" ]; then
  SPARSE_ATTN_TUNE=first timeout 240 python3 -m pytest -q -rs -m gpu tests/test_gpu_kernels.py -p no:cacheprovider \
    -k "${TESTS_K-mass or grouping_graph}" > "$res/gpu-tests.log" 2>&1
  tail -3 "$res/gpu-tests.log"
fi
timeout 200 python3 bench/mass_pack.py --out "$res/mass-pack.json" > "$res/mass-pack.log" 2>&1
tail -12 "$res/mass-pack.log"
if [ -n "${BIG_GRAPH-1}" ]; then  # at Wan 14B (beyond grouping_graph.MAX_TOKENS since mass-pack-1: no graph)
  timeout 120 python3 bench/grouping_graph.py --out "$res/grouping-graph.json" > "$res/grouping-graph.log" 2>&1
  tail -14 "$res/grouping-graph.log"
fi
read -r sh sf sy sx <<< "${SMALL:-24 4 64 64}"  # a shorter anchor: heads, frames, height, width (16 384 tokens)
timeout 60 python3 bench/grouping_graph.py --heads "$sh" --tokens $((sf * sy * sx)) \
  --out "$res/grouping-graph-small.json" > "$res/grouping-graph-small.log" 2>&1
tail -14 "$res/grouping-graph-small.log"
for g in 1 0; do  # where the dense call no longer hides the grouping's launches
  SPARSE_ATTN_GROUPING_GRAPH=$g timeout 120 python3 bench/engine.py --out "$res/small-graph$g" --methods mc_sparse \
    --heads "$sh" --frames "$sf" --height "$sy" --width "$sx" --overhead-reps 5 > "$res/small-graph$g.log" 2>&1
  grep -o '"anchor_ms": [0-9.]*\|"anchor_x_cudnn": [0-9.]*\|"grouping_ms": [0-9.]*' "$res/small-graph$g.log" \
    | tr '\n' ' '
  echo " (graph $g)"
done
OUT=$res VARIANTS="${VARIANTS:--}" TESTS_K= timeout 200 bash bench/device_mc_anchor.sh
if [ -n "${NOGRAPH-1}" ]; then
  SPARSE_ATTN_GROUPING_GRAPH=0 OUT=$res/nograph VARIANTS=- TESTS_K= timeout 150 bash bench/device_mc_anchor.sh
fi
if [ -n "${PROFILE-1}" ]; then
  timeout 120 python3 bench/engine.py --out "$res/profile" --methods mc_sparse --overhead-reps 3 --profile \
    > "$res/profile.log" 2>&1 || tail -5 "$res/profile.log"
fi
tar czf "$root/mass-pack.tgz" -C "$root" mass-pack && rm -rf "$res"
