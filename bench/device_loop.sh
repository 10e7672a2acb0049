#!/usr/bin/env bash
# One H200 call (nothing to carry): scores one tile ahead (SPARSE_ATTN_LOOP=ahead, docs/kernel_notes.md "v8") —
# the GPU tests of both loop modes at real sizes, then bench/hopper.py --plan loop at Wan 14B (every TMA kernel and the
# token kernel, plain / ahead / plain again, each mode tuned for itself) with the compiler's resource report.
# All packed into $OUT/loop.tar.gz.
#   bash bench/device_loop.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_part.sh
new_root /tmp/loop
record_gpu
part gpu_tests 150 env SPARSE_ATTN_TUNE=first python3 -m pytest -q -rs -m gpu tests/test_gpu_kernels.py \
  -k "ahead" -p no:cacheprovider
part loop 360 python3 bench/hopper.py --plan loop --shapes wan14b --skip-tests --no-flex --budget 330 \
  --out "$root/loop"
tar czf "$OUT/loop.tar.gz" -C /tmp loop
ls -la "$OUT"
