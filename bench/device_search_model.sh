#!/usr/bin/env bash
# One H200 call (carry: [".carry/quality"], built by `bash bench/quality_bundle.sh --no-sol`) for issue 18
# (docs/calibration.md, "A model of the output"):
# 1. the optima of the per-head quadratic model fitted offline on search-1's first round (bench/search_model.py,
#    radius 0.5 and 0.75; predicted +1.12 / +1.26 dB for mc_sparse at 0.10) beside the greedy search's allocation
#    (search-2) and uniform, on the same dense references of the fit and the check videos (seeds 0-15,
#    bench/quality_allocations.py): does the model's allocation beat the search's +0.97 dB without any further search?
# 2. the search with the model in the loop (bench/quality_search.py --mode quadratic, radius 0.75) from uniform.
# 3. block_topk at 0.10: the model's optimum (radius 0.5; predicted +0.35 dB on the fit videos, where the greedy
#    search measured +0.34, +0.28 on its check videos).
# Each part keeps what it measured; all packed into $OUT/search_model.tar.gz.
#   bash bench/device_search_model.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_part.sh
need_quality_carry
new_root /tmp/search_model
record_gpu
mc=docs/bench-runs/search-1/mc_sparse/search.json
bt=docs/bench-runs/search-1/block_topk/search.json
searched=$(python3 -c "import json; print(json.load(open('docs/bench-runs/search-2/search.json'))['result']['layer_densities'])")
r5=$(python3 bench/search_model.py "$mc" --factors 0.5)
r75=$(python3 bench/search_model.py "$mc" --factors 0.75)
part mc_model 120 python3 bench/quality_allocations.py --testbed "$b/testbed" --out "$root/mc_model" \
  --method mc_sparse --density 0.1 --seeds 0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15 --batch 8 \
  --alloc "searched=$searched" --alloc "model r0.5=$r5" --alloc "model r0.75=$r75"
part mc_quadratic 300 python3 bench/quality_search.py --testbed "$b/testbed" --out "$root/mc_quadratic" \
  --method mc_sparse --density 0.1 --mode quadratic --radius 0.75 --budget-s 250
f=$(python3 bench/search_model.py "$bt" --factors 0.5)
part bt_model_r0.5 60 python3 bench/quality_search.py --testbed "$b/testbed" --out "$root/bt_model_r0.5" \
  --method block_topk --density 0.1 --rounds 0 --start "$f"
tar czf "$OUT/search_model.tar.gz" -C /tmp search_model
ls -la "$OUT"
