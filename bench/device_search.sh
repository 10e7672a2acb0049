#!/usr/bin/env bash
# One H200 call (carry: [".carry/quality"], built by `bash bench/quality_bundle.sh --no-sol`): per-head densities
# searched on the quality testbed's output (bench/quality_search.py), mc_sparse then block_topk at density 0.10.
# Each part keeps what it measured; all packed into $OUT/search.tar.gz.
#   bash bench/device_search.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_part.sh
need_quality_carry
new_root /tmp/search
record_gpu
part mc_sparse 260 python3 bench/quality_search.py --testbed "$b/testbed" --out "$root/mc_sparse" \
  --method mc_sparse --density 0.1 --budget-s 225
part block_topk 170 python3 bench/quality_search.py --testbed "$b/testbed" --out "$root/block_topk" \
  --method block_topk --density 0.1 --budget-s 140
tar czf "$OUT/search.tar.gz" -C /tmp search
ls -la "$OUT"
