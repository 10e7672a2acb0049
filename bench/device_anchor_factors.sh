#!/usr/bin/env bash
# On the H100/H200 (carry: [".carry/quality"], built by bench/quality_bundle.sh --no-sol): issue 18's setting (mc_sparse,
# 30 steps, warm-up 2, anchors 2 and 10, groups of 64, residual on) with the density moved between the two anchors
# (SparseConfig.anchor_density_factors) at an equal mean over the reuse steps: anchor 2 serves the 7 reuse steps 3-9,
# anchor 10 the 19 steps 11-29, so factors (f0, f1) with 7 f0 + 19 f1 = 26.
#   PART=grid (default): first-span factors FIRST alone and COMBINED on top of the quadratic search's per-head
#     allocations (docs/calibration.md, "Sixteen more held-out videos"), SEEDS videos (default 0-31), at DENSITIES
#     (default 0.1 0.15). Output: $OUT/anchor-factors/d01, d015 (allocations.json / .md, run.log).
#   PART=search F0=1.3 BUDGET=150: the per-head quadratic search (bench/quality_search.py) re-fitted under the split
#     (F0, its f1), from the search's allocation at uniform anchors, at 0.10; then uniform, that allocation, it under
#     the split and the new search's allocation under the split on the held-out videos 8-31. Output:
#     $OUT/anchor-factors/search/, search.log, heldout/, heldout.log.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
t=.carry/quality/testbed
[ -f "$t/weights.safetensors" ] || { echo "no $t: run bench/quality_bundle.sh --no-sol and carry .carry/quality" >&2; exit 2; }
res="$OUT/anchor-factors"
mkdir -p "$res"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$res/gpu.txt"
f1() { python3 -c "print(round((26 - 7 * $1) / 19, 4))"; }
q010='{0: [0.25, 1.1684], 1: [1.7886, 0.9599], 2: [1.1178, 1.6319], 3: [0.25, 1.2101], 4: [0.4187, 0.6879], 5: [0.8056, 0.8775], 6: [1.455, 1.5757], 7: [1.3174, 0.4855]}'
q015='{0: [0.3215, 1.2661], 1: [1.609, 1.2562], 2: [1.2155, 1.2172], 3: [0.2503, 0.8108], 4: [0.8441, 0.5532], 5: [0.9382, 0.9264], 6: [1.3239, 1.3282], 7: [1.3811, 0.7585]}'
if [ "${PART:-grid}" = search ]; then
  f0=${F0:-1.3}
  factors="$f0,$(f1 $f0)"
  timeout ${SEARCH_TIMEOUT:-400} python3 bench/quality_search.py --testbed "$t" --out "$res/search" --method mc_sparse \
    --density 0.1 --mode quadratic --radius 0.75 --start "$q010" --anchor-factors "$factors" \
    --budget-s ${BUDGET:-150} > "$res/search.log" 2>&1
  echo "search: rc $?"; tail -3 "$res/search.log"
  found=$(python3 -c "import json; print(json.load(open('$res/search/search.json'))['result']['layer_densities'])")
  timeout ${CHECK_TIMEOUT:-150} python3 bench/quality_allocations.py --testbed "$t" --out "$res/heldout" \
    --method mc_sparse --density 0.1 --seeds "$(seq -s, 8 31)" --batch 8 --alloc "quadratic=$q010" \
    --alloc "quadratic a$f0=anchors $factors; $q010" --alloc "searched a$f0=anchors $factors; $found" \
    > "$res/heldout.log" 2>&1
  echo "held-out: rc $?"
  cat "$res/heldout/allocations.md"
  exit 0
fi
seeds=${SEEDS:-$(seq -s, 0 31)}
for dens in ${DENSITIES:-0.1 0.15}; do
  q=$([ $dens = 0.1 ] && echo "$q010" || echo "$q015")
  args=()
  for f0 in ${FIRST:-0.3 0.6 1.5 2 2.5}; do args+=(--alloc "a$f0=anchors $f0,$(f1 $f0);"); done
  args+=(--alloc "quadratic=$q")
  for f0 in ${COMBINED:-1.5 2}; do args+=(--alloc "quadratic a$f0=anchors $f0,$(f1 $f0); $q"); done
  out="$res/d${dens/./}"
  mkdir -p "$out"
  timeout ${TIMEOUT:-280} python3 bench/quality_allocations.py --testbed "$t" --out "$out" --method mc_sparse \
    --density $dens --seeds "$seeds" --batch 8 "${args[@]}" > "$out/run.log" 2>&1
  echo "density $dens: rc $?"
  cat "$out/allocations.md"
done
