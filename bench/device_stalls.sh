#!/usr/bin/env bash
# One H200 call (carry: [".carry/bundle.tar.xz"], built by bench/device_bundle.sh): after the token kernel's autotune
# key was capped and its lists 16-aligned — the GPU tests of token-sparse attention and the engine, then Wan 14B
# mc_sparse 0.15 with two anchors back to back (pattern AAr, the case whose reuse step stalled on Triton
# re-tuning) with every Triton compilation and tuning logged. All packed into $OUT/stalls.tar.gz.
#   bash bench/device_stalls.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_part.sh
[ -f .carry/bundle.tar.xz ] || { echo "no .carry/bundle.tar.xz: run bench/device_bundle.sh and carry it" >&2; exit 2; }
new_root /tmp/stalls
record_gpu
part gpu_tests 150 env SPARSE_ATTN_TUNE=first python3 -m pytest -q -rs -m gpu tests/test_gpu_kernels.py \
  -k "token or engine" -p no:cacheprovider
part aar 330 env TRITON_PRINT_AUTOTUNING=1 bash bench/device_e2e.sh --models wan14b --modes mc_sparse@0.15 \
  --reuse-dense docs/bench-runs/e2e-dense/e2e.json --pattern AAr --log-compiles --budget-s 300
tar czf "$OUT/stalls.tar.gz" -C /tmp stalls
ls -la "$OUT"
