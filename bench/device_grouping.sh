#!/usr/bin/env bash
# One H200 call (carry: [".carry/quality"], built by `bash bench/quality_bundle.sh --no-sol`): the query grouping
# with subsampled directions (kernels/grouping_torch.py) — the GPU tests of grouping, pass 2, token-sparse
# attention, compaction and the engine; the mc_sparse anchor at Wan 14B with its profile (bench/engine.py); the
# testbed's PSNR of the mc_sparse rows earlier runs measured (bench/grids/mc_sparse_check.yaml). Each part keeps
# what it measured; all packed into $OUT/grouping.tar.gz.
#   bash bench/device_grouping.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_part.sh
need_quality_carry
new_root /tmp/grouping
record_gpu
part quality 120 python3 bench/quality.py --testbed "$b/testbed" --out "$root/quality" \
  --grid bench/grids/mc_sparse_check.yaml --steps 30 --budget-s 100
part engine 110 python3 bench/engine.py --out "$root/engine" --methods mc_sparse --profile --overhead-reps 5
part gpu_tests 200 env SPARSE_ATTN_TUNE=first python3 -m pytest -q -rs -m gpu tests/test_gpu_kernels.py \
  -k "group or token or compact or engine or mass" -p no:cacheprovider
tar czf "$OUT/grouping.tar.gz" -C /tmp grouping
ls -la "$OUT"
