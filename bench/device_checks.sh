#!/usr/bin/env bash
# One H200 call when device time is short (carry: [".carry/bundle.tar.xz"] from bench/device_bundle.sh, and
# .carry/quality from bench/quality_bundle.sh --no-sol with QUALITY=1): the GPU tests the code since the last device
# run touches (FIRST: a pytest -k expression; default the engine, the fast launch and the replay, the fp8 residual read
# as bytes, the TMA variants), then a ComfyUI run of Wan 2.1 1.3B 480p x 81 (E2E_MODELS: the bench/e2e.py models, in
# turn) with the presets' block_topk 0.08 schedule, every step timed through comfy.sample with a step callback, then
# (QUALITY=1) the presets' setting on the quality testbed at 30 steps (bench/grids/preset_check.yaml). Packed into
# $OUT/checks.tar.gz. E2E_ARGS: more bench/e2e.py arguments for every model (e.g. --log-compiles).
#   [FIRST=...] [E2E_MODELS="wan13b wan14b"] [E2E_S=...] [E2E_ARGS=...] [QUALITY=1] bash bench/device_checks.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_part.sh
[ "${QUALITY:-0}" = 1 ] && need_quality_carry  # before any run: a missing carry must not cost the other results
new_root /tmp/checks
record_gpu
first="${FIRST:-engine or fp8 or on_cuda or variants_match_twin or anchor_residual or mass_weighted or fast_launch or dispatch or packed}"
part gpu-tests "${TESTS_S:-150}" env SPARSE_ATTN_TUNE=first python3 -m pytest -q -rs -m gpu \
  tests/test_gpu_kernels.py tests/test_torch_backend.py tests/test_residual_packing.py -p no:cacheprovider -k "$first"
for m in ${E2E_MODELS:-wan13b}; do  # E2E_S: each model's limit (Wan 14B's whole run takes ~400 s)
  part "e2e-$m" "${E2E_S:-210}" env BUNDLE=.carry/bundle.tar.xz bash bench/device_e2e.sh --models "$m" \
    --modes block_topk@0.08 --warmup-layers 0 --whole-run --total-steps 30 ${E2E_ARGS:-}
done
[ "${QUALITY:-0}" = 1 ] && part quality-presets "${QUALITY_S:-200}" bash bench/device_quality.sh \
  --grid bench/grids/preset_check.yaml --steps 30 --budget-s "$(( ${QUALITY_S:-200} - 40 ))"
tar czf "$OUT/checks.tar.gz" -C /tmp checks
ls -la "$OUT"
