#!/usr/bin/env bash
# One device call (carry: [".carry/quality"]) for residuals at 4 bits (docs/decisions.md, "Residuals at 4 bits"):
# 1. the GPU test of the host path (a host residual packed on its GPU into page-locked memory);
# 2. the GPU time of packing and unpacking one Wan 14B 720p layer's residual (bench/residual_pack_time.py);
# 3. the presets' setting on the testbed with fp8 and with 4-bit residuals, all 8 videos (bench/grids/residual_int4.yaml).
# Everything in $OUT/int4.tar.gz.
#   bash bench/device_int4.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_part.sh
need_quality_carry
new_root /tmp/int4
record_gpu
part gpu-tests 120 python3 -m pytest -q -rs -m gpu tests/test_residual_packing.py -p no:cacheprovider
part pack-time 90 python3 bench/residual_pack_time.py --out "$root/pack-time"
part quality 240 bash bench/device_quality.sh --grid bench/grids/residual_int4.yaml \
  --steps 30 --budget-s 200
tar czf "$OUT/int4.tar.gz" -C /tmp int4
ls -la "$OUT"
