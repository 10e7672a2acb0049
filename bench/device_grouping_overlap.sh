#!/usr/bin/env bash
# On the H100/H200 (nothing to carry): the query grouping beside the anchor's dense call (bench/grouping_overlap.py) at
# Wan 14B (batch 1 and 2) and at SMALL ("heads tokens", default "24 16384"), after the GPU tests TESTS_K selects
# (default "cond_and_uncond or grouping_graph or side_stream or residual_of"; none when empty), the anchor's residual
# in one pass (bench/residual_of.py), then the Wan 14B anchor's phases (bench/device_mc_anchor.sh) with each setting
# of SPARSE_ATTN_SIDE_STREAM in OVERLAP (default "1 0"), and (unless BATCH2 is empty) the anchor of a batch of two.
# MICRO: one bench/grouping_overlap.py argument list instead of those three (empty: none).
# Everything lands in $OUT/overlap.tgz (one file comes back).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
root=$OUT
res="$root/overlap"
mkdir -p "$res"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$res/gpu.txt"
if [ -n "${TESTS_K-cond_and_uncond or grouping_graph or side_stream or residual_of}" ]; then
  SPARSE_ATTN_TUNE=first timeout 240 python3 -m pytest -q -rs -m gpu tests/test_gpu_kernels.py -p no:cacheprovider \
    -k "${TESTS_K-cond_and_uncond or grouping_graph or side_stream or residual_of}" > "$res/gpu-tests.log" 2>&1
  tail -3 "$res/gpu-tests.log"
fi
read -r sh sn <<< "${SMALL:-24 16384}"
lists=("--batch 1" "--batch 2" "--heads $sh --tokens $sn")
if [ -n "${MICRO+set}" ]; then lists=(); [ -n "$MICRO" ] && lists=("$MICRO"); fi
for args in "${lists[@]}"; do
  name=$(echo "$args" | tr -d '-' | tr ' ' '_')
  timeout 150 python3 bench/grouping_overlap.py $args --out "$res/overlap_$name.json" > "$res/overlap_$name.log" 2>&1
  grep "ms\|equal" "$res/overlap_$name.log" | grep -v '^ "' | tail -4
  grep '_ms"\|equal' "$res/overlap_$name.log" | tr -d '\n '; echo
done
timeout 100 python3 bench/residual_of.py --out "$res/residual-of.json" > "$res/residual-of.log" 2>&1
grep '_ms"' "$res/residual-of.log" | tr -d '\n '; echo
for o in ${OVERLAP-1 0}; do  # each setting once a word: "1 1 0" times the side stream twice
  i=$((${i:-0} + 1))
  SPARSE_ATTN_SIDE_STREAM=$o OUT=$res/anchor-overlap$o-$i VARIANTS=- TESTS_K= timeout 150 bash bench/device_mc_anchor.sh
done
if [ -n "${BATCH2-1}" ]; then  # cond and uncond batched, with the side stream
  OUT=$res/anchor-batch2 VARIANTS=- TESTS_K= ENGINE_ARGS="--batch 2" timeout 240 bash bench/device_mc_anchor.sh
fi
tar czf "$root/overlap.tgz" -C "$root" overlap && rm -rf "$res"
