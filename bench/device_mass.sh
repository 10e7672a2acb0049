#!/usr/bin/env bash
# One H200 call (carry: [".carry/quality"], built by `bash bench/quality_bundle.sh --no-sol`): the residual weighted
# by the mass (SparseConfig.residual_weighting) — the GPU tests of its kernels and of the block-sparse / anchor /
# engine paths it touches, then the quality grid bench/grids/residual_mass.yaml (block_topk, weighted against fixed)
# on the trained testbed. All packed into $OUT/mass.tar.gz.
#   bash bench/device_mass.sh            (GRID=bench/grids/residual_mass_step0.yaml for the second run)
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_part.sh
need_quality_carry
new_root /tmp/mass
record_gpu
part gpu_tests 170 env SPARSE_ATTN_TUNE=first python3 -m pytest -q -rs -m gpu tests/test_gpu_kernels.py \
  -k "mass or engine" -p no:cacheprovider
part quality 200 python3 bench/quality.py --testbed "$b/testbed" --out "$root/quality" --grid \
  "${GRID:-bench/grids/residual_mass.yaml}" --steps 30,50,20,8,4 --budget-s 170
part kernels 120 python3 bench/hopper.py --plan mass --shapes wan14b --skip-tests --no-flex --budget 100 --out "$root/kernels"
tar czf "$OUT/mass.tar.gz" -C /tmp mass
ls -la "$OUT"
