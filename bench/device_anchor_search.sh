#!/usr/bin/env bash
# On the H100/H200 (carry: [".carry/quality"], built by bench/quality_bundle.sh --no-sol): the per-head quadratic search
# (bench/quality_search.py) re-fitted under an anchor split, starting from the search's allocation at uniform anchors
# (docs/calibration.md, "Sixteen more held-out videos"), then uniform, that allocation under the split and the new
# search's allocation under the split on the held-out videos 8-31 (bench/quality_allocations.py).
#   F0=1.3 BUDGET=300 bash bench/device_anchor_search.sh      Output: $OUT/anchor-search/ (search/, heldout/).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
t=.carry/quality/testbed
[ -f "$t/weights.safetensors" ] || { echo "no $t: run bench/quality_bundle.sh --no-sol and carry .carry/quality" >&2; exit 2; }
res="$OUT/anchor-search"
mkdir -p "$res"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$res/gpu.txt"
f0=${F0:-1.3}
factors="$f0,$(python3 -c "print(round((26 - 7 * $f0) / 19, 4))")"  # 7 reuse steps after anchor 2, 19 after anchor 10
q010='{0: [0.25, 1.1684], 1: [1.7886, 0.9599], 2: [1.1178, 1.6319], 3: [0.25, 1.2101], 4: [0.4187, 0.6879], 5: [0.8056, 0.8775], 6: [1.455, 1.5757], 7: [1.3174, 0.4855]}'
timeout ${SEARCH_TIMEOUT:-400} python3 bench/quality_search.py --testbed "$t" --out "$res/search" --method mc_sparse \
  --density 0.1 --mode quadratic --radius 0.75 --start "$q010" --anchor-factors "$factors" \
  --budget-s ${BUDGET:-300} > "$res/search.log" 2>&1
echo "search: rc $?"; tail -3 "$res/search.log"
found=$(python3 -c "import json; print(json.load(open('$res/search/search.json'))['result']['layer_densities'])")
timeout ${CHECK_TIMEOUT:-150} python3 bench/quality_allocations.py --testbed "$t" --out "$res/heldout" --method mc_sparse \
  --density 0.1 --seeds "$(seq -s, 8 31)" --batch 8 --alloc "quadratic=$q010" \
  --alloc "quadratic a$f0=anchors $factors; $q010" --alloc "searched a$f0=anchors $factors; $found" \
  > "$res/heldout.log" 2>&1
echo "held-out: rc $?"
cat "$res/heldout/allocations.md"
