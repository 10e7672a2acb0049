#!/usr/bin/env bash
# One H200 call (carry: [".carry/bundle.tar.xz", ".carry/quality"]): the lower-density candidates for the presets
# (docs/benchmarks.md, "Lower density, every layer sparse"): the quality grid GRID (default
# bench/grids/lower_density.yaml) on the testbed, then Wan 2.1 14B 720p timed as anchor, reuse, later anchor, reuse
# (--pattern ArAr) at the densities in MODES (default block_topk@0.08,block_topk@0.06) with every layer sparse
# (--warmup-layers 0, as the testbed runs), projected to 30 steps against the dense row of docs/bench-runs/e2e-dense.
# Everything in $OUT/lower.tar.gz.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_part.sh
need_quality_carry
new_root /tmp/lower
record_gpu
part quality 200 python3 bench/quality.py --testbed "$b/testbed" --out "$root/quality" --grid \
  "${GRID:-bench/grids/lower_density.yaml}" --steps 20,30,50 --budget-s 180
part e2e-wan14b "${E2E_LIMIT:-340}" bash bench/device_e2e.sh --models wan14b \
  --modes "${MODES:-block_topk@0.08,block_topk@0.06}" --warmup-layers 0 --pattern ArAr --total-steps 30 \
  --reuse-dense docs/bench-runs/e2e-dense/e2e.json
tar -czf "$OUT/lower.tar.gz" -C "$root" .
