#!/usr/bin/env bash
# One H200 call (nothing to carry): the token kernel decoding the engine's compact int16 lists in registers — its GPU
# tests and the token, engine and tuning tests, then the mc_sparse reuse call at Wan 14B (bench/engine.py: the engine's
# reuse call, the kernel on the compact lists, the kernel on decoded int32 lists, the decode alone). All packed into
# $OUT/compact-decode.tar.gz.
#   bash bench/device_compact_decode.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_part.sh
new_root /tmp/compact-decode
record_gpu
part gpu_tests 150 env SPARSE_ATTN_TUNE=first python3 -m pytest -q -rs -m gpu tests/test_gpu_kernels.py \
  -k "compact or token or engine" -p no:cacheprovider
part engine 200 python3 bench/engine.py --out "$root/engine" --methods mc_sparse --overhead-reps 5
tar czf "$OUT/compact-decode.tar.gz" -C /tmp compact-decode
ls -la "$OUT"
