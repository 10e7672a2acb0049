#!/usr/bin/env bash
# One device call (carry: [".carry/quality"]) after device_search_model.sh (docs/calibration.md, "A model of the
# output"), for issue 18's +1.5 dB at 0.10:
# 1. the quadratic search's result (search-model-1, mc_quadratic: +1.41 dB on the check videos, two heads at the
#    0.25 floor) continued with finer moves (±0.25), a lower floor (0.1) and a smaller model radius (0.5);
# 2. the same quadratic search from uniform at density 0.15.
# Each part is packed into $OUT as soon as it ends, so a cut call still returns what finished.
#   bash bench/device_search_more.sh [BUDGET_S_1] [BUDGET_S_2]
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_part.sh
need_quality_carry
new_root /tmp/search_more
record_gpu
found=docs/bench-runs/search-model-1/mc_quadratic/search.json
start=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['result']['layer_densities'])" "$found")
part mc_continue $(( ${1:-200} + 60 )) python3 bench/quality_search.py --testbed "$b/testbed" \
  --out "$root/mc_continue" --method mc_sparse --density 0.1 --mode quadratic --radius 0.5 --step 0.25 \
  --min-factor 0.1 --min-gain-db 0.02 --start "$start" --budget-s "${1:-200}"
tar czf "$OUT/search_more.tar.gz" -C /tmp search_more
part mc_quadratic_015 $(( ${2:-150} + 60 )) python3 bench/quality_search.py --testbed "$b/testbed" \
  --out "$root/mc_quadratic_015" --method mc_sparse --density 0.15 --mode quadratic --radius 0.75 \
  --budget-s "${2:-150}"
tar czf "$OUT/search_more.tar.gz" -C /tmp search_more
ls -la "$OUT"
