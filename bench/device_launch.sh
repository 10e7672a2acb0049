#!/usr/bin/env bash
# One H200 call (nothing to carry): the GPU kernel tests (the attention kernels launch through kernels/fast_launch.py,
# the engine's reuse calls replay through kernels/replay.py), then the host time of a reuse call with the replay, with
# the direct relaunch alone (SPARSE_ATTN_REPLAY off) and, with AB="--replay-ab 7 --launch-ab 7", with Triton's own
# launch (SPARSE_ATTN_FAST_LAUNCH=0), alternating in one process (bench/engine.py) at 4 608 tokens (24 heads, both
# methods) and 8 192 (block_topk), with cProfile of each. PART=mc adds mc_sparse at Wan 14B (the reuse kernel call
# with and without the fill of rows in no group). Packed into $OUT/launch.tar.gz.
#   bash bench/device_launch.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_part.sh
new_root /tmp/launch
record_gpu
part gpu_tests "${TESTS_S:-330}" env SPARSE_ATTN_TUNE=first python3 -m pytest -q -rs -m gpu tests/test_gpu_kernels.py \
  -p no:cacheprovider ${TESTS_K:+-k "$TESTS_K"}
ab="--host-profile --overhead-reps 200 ${AB:---replay-ab 7}"
part ab-4608 150 python3 bench/engine.py --out "$root/ab-4608" --heads 24 --frames 1 --height 72 --width 64 $ab
part ab-8192 100 python3 bench/engine.py --out "$root/ab-8192" --heads 24 --frames 2 --height 64 --width 64 $ab \
  --methods block_topk
if [ "${PART:-}" = mc ]; then
  part wan14b-mc 200 python3 bench/engine.py --out "$root/wan14b-mc" --methods mc_sparse
fi
tar czf "$OUT/launch.tar.gz" -C /tmp launch
ls -la "$OUT"
