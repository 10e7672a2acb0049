#!/usr/bin/env bash
# On the H100/H200 (nothing to carry): the Gluon one-pass block anchor (kernels/anchor_gluon.py, docs/kernel_notes.md
# "v29").
# 1. GPU tests: the Gluon anchor against the twin, the anchors' other paths, the automatic dispatch, the engine's
#    anchor and reuse calls (TESTS_K selects).
# 2. bench/hopper.py --plan gluon_anchor: the Gluon anchor, the Gluon dense call + the TMA residual epilogue (the path
#    before it) and above FUSED_ANCHOR_ABOVE the TMA fused pass, alternated REPEATS times at DENSITIES, against cuDNN.
# Output: $OUT/gluon-anchor/ (tests.log, hopper.json / hopper.md / hopper.log).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 SPARSE_ATTN_TUNE=first
res="$OUT/gluon-anchor"
mkdir -p "$res"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$res/gpu.txt"
k=${TESTS_K-gluon_anchor or anchor_matches or anchor_residual_epilogue or auto_takes or engine_reuse or whole_anchor}
timeout ${TESTS_TIMEOUT:-150} python3 -m pytest -q -m gpu tests/test_gpu_kernels.py -p no:cacheprovider -k "$k" \
  > "$res/tests.log" 2>&1
echo "tests: rc $? $(tail -1 "$res/tests.log")"
grep -E "^(FAILED|ERROR)|Error|assert" "$res/tests.log" | head -30
timeout ${BENCH_TIMEOUT:-330} python3 bench/hopper.py --plan gluon_anchor --skip-tests --no-flex \
  --shapes ${SHAPES:-wan14b,hyv,wan13b} --densities ${DENSITIES:-0.08,0.15,0.25,0.05} --repeats ${REPEATS:-3} \
  --budget ${BUDGET:-280} --out "$res" > "$res/hopper.log" 2>&1
echo "bench: rc $?"
grep "anchor d=\|FAILED\|failed\|Error" "$res/hopper.log"
