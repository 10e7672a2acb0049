#!/usr/bin/env bash
# One H200 call (carry: [".carry/quality"], built by `bash bench/quality_bundle.sh --no-sol`):
# 1. the mc_sparse per-head search at density 0.10 continued from where search-2 converged with ±0.5 moves
#    (docs/calibration.md, "A search on the output"), now with ±0.25 moves and factors down to 0.1: is there more
#    than +0.97 dB for any per-head allocation on the testbed?
# 2. where an mc_sparse anchor's selection spends its time at Wan 14B: bench/engine.py --profile (torch.profiler).
# Each part keeps what it measured; all packed into $OUT/search_fine.tar.gz.
#   bash bench/device_search_fine.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_part.sh
need_quality_carry
new_root /tmp/search_fine
record_gpu
start=$(python3 -c "import json; print(json.load(open('docs/bench-runs/search-2/search.json'))['result']['layer_densities'])")
part mc_sparse 330 python3 bench/quality_search.py --testbed "$b/testbed" --out "$root/mc_sparse" \
  --method mc_sparse --density 0.1 --step 0.25 --min-factor 0.1 --budget-s 290 --start "$start"
part profile 100 python3 bench/engine.py --out "$root/profile" --methods mc_sparse --profile --overhead-reps 5
tar czf "$OUT/search_fine.tar.gz" -C /tmp search_fine
ls -la "$OUT"
