#!/usr/bin/env bash
# One H200 call (carry: [".carry"]: bench/device_bundle.sh's bundle and bench/quality_bundle.sh --no-sol's testbed):
# the code of the sessions without a device, checked where users run it. A ComfyUI run of Wan 2.1 1.3B 480p x 81 with
# the presets' block_topk 0.08 schedule, every step timed, through comfy.sample with a step callback (the sampler
# progress the engine now places steps by, docs/method.md "Schedule"); then the presets' setting on the quality
# testbed at 30 steps (bench/grids/preset_check.yaml). Packed into $OUT/regression.tar.gz.
#   bash bench/device_regression.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_part.sh
need_quality_carry
new_root /tmp/regression
record_gpu
part e2e-wan13b "${E2E_S:-300}" bash bench/device_e2e.sh --models wan13b --modes block_topk@0.08 --warmup-layers 0 \
  --whole-run --total-steps 30
part quality-presets "${QUALITY_S:-200}" bash bench/device_quality.sh --grid bench/grids/preset_check.yaml --steps 30 \
  --budget-s "$(( ${QUALITY_S:-200} - 40 ))"
tar czf "$OUT/regression.tar.gz" -C /tmp regression
ls -la "$OUT"
