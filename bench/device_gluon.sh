#!/usr/bin/env bash
# On the H100/H200 (nothing to carry: the image has torch and Triton 3.6 with Gluon): the Gluon probe of
# bench/gluon_attention.py — checks against the twins at real sizes, then dense and block-sparse timings against cuDNN
# and our TMA kernels (docs/kernel_notes.md, "v17"; its compiler report is made offline with --compile-only).
# SHAPES (default wan14b,hyv,wan13b), BUDGET (seconds for the timings, default 240), LIMIT (seconds for the whole
# script, default 420: a kernel that never returns is killed and its log so far comes back), CONFIGS (e.g.
# "BN128 s2 split,BN128 s2 w8"; default all), DENSITIES (block-sparse densities, default 0.25,0.1,0.5; "" for dense
# only). Output in $OUT/gluon/.
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p "$OUT/gluon"
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > "$OUT/gluon/gpu.csv" 2>&1
timeout "${LIMIT:-420}" python3 bench/gluon_attention.py --out "$OUT/gluon" --budget "${BUDGET:-240}" \
  --shapes "${SHAPES:-wan14b,hyv,wan13b}" --configs "${CONFIGS:-}" --densities "${DENSITIES-0.25,0.1,0.5}" 2>&1 |
  tail -150
