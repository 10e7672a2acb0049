#!/usr/bin/env bash
# On the H200 (carry: [".carry"]; .carry/bundle.tar.xz from bench/device_bundle.sh, and .carry/quality from
# bench/quality_bundle.sh when CALIBRATE=1): whole runs of the presets, every step timed (bench/e2e.py --whole-run),
# for the models in MODELS (default wan14b) over STEPS steps (default 30), block_topk at the preset's density 0.1,
# the dense rows taken from docs/bench-runs/e2e-dense where they are there; then, with CALIBRATE=1, the calibrated
# against uniform comparison on the quality testbed under the presets' schedule (bench/quality_calibration.py).
# Everything lands in $OUT/whole.tar.gz (the device returns at most 8 files).
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_part.sh
[ "${CALIBRATE:-0}" = 1 ] && need_quality_carry  # before any run: a missing carry must not cost the e2e results
new_root /tmp/whole
record_gpu
steps=${STEPS:-30}
runs=docs/bench-runs/e2e-dense/e2e.json
for m in ${MODELS:-wan14b}; do
  dense=""
  python3 -c "import json, sys; sys.exit(not any(r['model'] == '$m' for r in json.load(open('$runs'))['rows']))" \
    && dense="--reuse-dense $runs"
  # shellcheck disable=SC2086  # $dense is empty or two words
  part "e2e-$m" "${E2E_LIMIT:-560}" bash bench/device_e2e.sh --models "$m" --modes "${MODES:-block_topk@0.1}" \
    --whole-run --total-steps "$steps" $dense
done
if [ "${CALIBRATE:-0}" = 1 ]; then
  part calibration "${CAL_LIMIT:-200}" python3 bench/quality_calibration.py --testbed "$b/testbed" \
    --out "$root/calibration" ${CAL_ARGS:-}
fi
tar -czf "$OUT/whole.tar.gz" -C "$root" .
