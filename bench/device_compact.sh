#!/usr/bin/env bash
# One H200 call (nothing to carry): every GPU kernel test (the compaction kernel of mc_sparse anchors,
# kernels/compact_triton.py, among them), then the mc_sparse anchor at Wan 14B with its operator profile
# (bench/engine.py --profile). Each part keeps what it measured; all packed into $OUT/compact.tar.gz.
#   bash bench/device_compact.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_part.sh
new_root /tmp/compact
record_gpu
part gpu_tests 240 env SPARSE_ATTN_TUNE=first python3 -m pytest -q -rs -m gpu tests/test_gpu_kernels.py -p no:cacheprovider
part engine 110 python3 bench/engine.py --out "$root/engine" --methods mc_sparse --profile --overhead-reps 5
tar czf "$OUT/compact.tar.gz" -C /tmp compact
ls -la "$OUT"
