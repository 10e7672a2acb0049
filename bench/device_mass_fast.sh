#!/usr/bin/env bash
# One H200 call (carry: [".carry/quality"]): the quality grid bench/grids/residual_mass_fast.yaml (block_topk with the
# residual weighted by the mass on schedules with few dense steps and anchors). Packed into $OUT/mass_fast.tar.gz.
#   bash bench/device_mass_fast.sh     (GRID=bench/grids/residual_mass_preset.yaml: the preset candidates)
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_part.sh
need_quality_carry
new_root /tmp/mass_fast
record_gpu
part quality 300 python3 bench/quality.py --testbed "$b/testbed" --out "$root/quality" --grid \
  "${GRID:-bench/grids/residual_mass_fast.yaml}" --steps 20,30,50 --budget-s 270
tar czf "$OUT/mass_fast.tar.gz" -C /tmp mass_fast
ls -la "$OUT"
