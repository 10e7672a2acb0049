#!/usr/bin/env bash
# One H200 call (carry: [".carry/quality"], built by `bash bench/quality_bundle.sh --no-sol`): how a reuse step should
# combine its sparse output with the anchor's cache (bench/reuse_combine.py: add / lse / merge, exact fp32 with TF32
# matmuls) on the trained quality testbed at its own size, 8 videos, 30 steps. Packed into $OUT/reuse_combine.tar.gz.
#   bash bench/device_reuse_combine.sh [bench/reuse_combine.py arguments]
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_part.sh
need_quality_carry
new_root /tmp/reuse_combine
record_gpu
part combine 540 python3 bench/reuse_combine.py --testbed "$b/testbed" --out "$root/combine" --tf32 \
  --methods block_topk,mc_sparse --densities 0.15,0.1 --schedules "w2 a2,6,14;w2 a2,10;a0" --budget-s 500 "$@"
tar czf "$OUT/reuse_combine.tar.gz" -C /tmp reuse_combine
ls -la "$OUT"
