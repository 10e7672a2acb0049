#!/usr/bin/env bash
# One H200 call (carry: [".carry/quality"], built by `bash bench/quality_bundle.sh --no-sol`): low-rank query
# grouping (grouping_rank, kernels/grouping_torch.py) — its GPU tests and the lazy-rescale test over every kernel
# variant, the grouping's time at Wan 14B for ranks 8/16/32 against all 128 dimensions and an mc_sparse anchor
# with rank 16 (bench/engine.py), and the testbed's PSNR per rank (bench/grids/grouping_rank.yaml). Each part keeps
# what it measured; all packed into $OUT/grouping.tar.gz.
#   bash bench/device_grouping.sh
set -uo pipefail
cd "$(dirname "$0")/.."
b=.carry/quality
[ -f "$b/testbed/weights.safetensors" ] || { echo "no $b/testbed: run bench/quality_bundle.sh --no-sol" >&2; exit 2; }
source bench/device_part.sh
new_root /tmp/grouping
record_gpu
part gpu_tests 170 env SPARSE_ATTN_TUNE=first python3 -m pytest -q -rs -m gpu tests/test_gpu_kernels.py \
  -k "lazy or low_rank" -p no:cacheprovider
part engine 110 python3 bench/engine.py --out "$root/engine" --methods mc_sparse --grouping-ranks 8,16,32
part engine_rank16 80 python3 bench/engine.py --out "$root/engine_rank16" --methods mc_sparse --grouping-rank 16
part quality 200 python3 bench/quality.py --testbed "$b/testbed" --out "$root/quality" \
  --grid bench/grids/grouping_rank.yaml --steps 30 --budget-s 180
python3 bench/quality.py --report "$root/quality/quality.json" --report-out "$root/quality/quality.md" \
  --plot-out "$root/quality/frontier.png" 2>&1 | tail -1
tar czf "$OUT/grouping.tar.gz" -C /tmp grouping
ls -la "$OUT"
