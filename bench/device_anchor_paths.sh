#!/usr/bin/env bash
# One H200 call (carry: [".carry/quality"] when GRID is set): the GPU tests of the anchor and epilogue kernels, then a
# bench/hopper.py plan on Wan 14B, HunyuanVideo and Wan 1.3B; with GRID, that quality grid on the testbed after them.
# Everything in $OUT/anchor.tar.gz.
#   PLAN=anchor (default): the block anchor's two paths (docs/benchmarks.md, "The anchor as one dense call plus the
#     residual epilogue"): the fused one-pass kernel against cuDNN dense plus the block-sparse kernel forming R in its
#     epilogue, at seven densities.
#   PLAN=epilogue: where the composed anchor's time goes at 0.08 and 0.1 (docs/kernel_notes.md, "v11"): the sparse
#     kernel, the residual epilogue and the reuse call alone, the API's anchor, and its two halves in sequence.
#   PLAN=tilings: the fused anchor on each candidate tiling alone against the composed anchor (docs/kernel_notes.md,
#     "v16").
#   TESTS: the pytest -k selection of tests/test_gpu_kernels.py run first (TESTS_LIMIT seconds); HOPPER_LIMIT: seconds
#     for the timing part (default 250).
#   bash bench/device_anchor_paths.sh           GRID=bench/grids/density_007.yaml bash bench/device_anchor_paths.sh
#   PLAN=epilogue GRID=bench/grids/preset_check.yaml bash bench/device_anchor_paths.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_part.sh
new_root /tmp/anchor
record_gpu
PLAN=${PLAN:-anchor}
part gpu-tests "${TESTS_LIMIT:-170}" python3 -m pytest -q -rs -m gpu tests/test_gpu_kernels.py -p no:cacheprovider \
  -k "${TESTS:-anchor or mass_weighted}"
part hopper "${HOPPER_LIMIT:-250}" python3 bench/hopper.py --skip-tests --plan "$PLAN" --shapes wan14b,hyv,wan13b \
  --budget "$(( ${HOPPER_LIMIT:-250} - 40 ))" \
  --out "$root/hopper"
if [ -n "${GRID:-}" ]; then
  need_quality_carry
  part quality "${QUALITY_LIMIT:-170}" python3 bench/quality.py --testbed "$b/testbed" --out "$root/quality" \
    --grid "$GRID" --steps 20,30,50 --budget-s "$(( ${QUALITY_LIMIT:-170} - 20 ))"
fi
tar -czf "$OUT/anchor.tar.gz" -C "$root" .
