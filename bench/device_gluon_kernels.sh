#!/usr/bin/env bash
# On the H100/H200 (nothing to carry): the product's Gluon kernel (kernels/attention_gluon.py) — its GPU tests and the
# tests of the paths it now takes (auto dispatch, the engine's replayed reuse calls, the mass-weighted residual, the
# anchor's epilogue), then bench/hopper.py --plan gluon (Gluon against the TMA kernel and cuDNN, FlexAttention live on
# the first shape). BUDGET (timing seconds, default 240), SHAPES (default wan14b,hyv,wan13b), TESTS_TIMEOUT (default
# 200), PLAN (default gluon; "token": the Gluon token kernel, kernels/token_sparse_gluon.py, against the pointer kernel)
# and TESTS_K (pytest -k of the GPU tests, default the block kernel's). Output in $OUT/gluon-kernels/.
set -uo pipefail
cd "$(dirname "$0")/.."
out="$OUT/gluon-kernels"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"
python3 bench/hopper.py --out "$out" --plan "${PLAN:-gluon}" --budget "${BUDGET:-240}" --shapes "${SHAPES:-wan14b,hyv,wan13b}" \
  --tests-timeout "${TESTS_TIMEOUT:-200}" \
  --tests-k "${TESTS_K:-gluon or auto_dense or engine_reuse or mass_weighted or anchor_residual_epilogue or dispatch}" 2>&1 |
  tee "$out/hopper.log" | grep -v "^    regs\|^ *attn_tma\|^ *bsa_pointer\|^ *token \|^ *mass \|^ *dense_pointer" | tail -80
