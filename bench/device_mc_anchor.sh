#!/usr/bin/env bash
# On the H100/H200 (nothing to carry): the mc_sparse anchor's cost at Wan 2.1 14B (40 heads x 75 600 tokens,
# d 0.15, bench/engine.py) with the defaults and the variants of bench/grids/mc_anchor_cost.yaml: pass 2 on all,
# 16 or 32 queries of each group (mass_queries), cuboid groups (no grouping pass). VARIANTS: space-separated
# KEY=VALUE,... lists ("-" = the defaults). TESTS_K: first the GPU tests pytest -k selects (none when empty).
# ENGINE_ARGS: more bench/engine.py arguments (e.g. "--batch 2").
# Output: $OUT/mc-anchor/<variant>/engine.json and a summary.
set -uo pipefail
cd "$(dirname "$0")/.."
out="$OUT/mc-anchor"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
if [ -n "${TESTS_K:-}" ]; then
  SPARSE_ATTN_TUNE=first timeout 300 python3 -m pytest -q -rs -m gpu tests/test_gpu_kernels.py -p no:cacheprovider \
    -k "$TESTS_K" > "$out/gpu-tests.log" 2>&1
  tail -4 "$out/gpu-tests.log"
fi
for v in ${VARIANTS:-- mass_queries=0 mass_queries=32 grouping=cuboid}; do
  name=${v//[=,]/_}
  cfg=$([ "$v" = - ] && echo "" || echo "$v")
  python3 bench/engine.py --out "$out/$name" --methods mc_sparse --overhead-reps 5 --config "$cfg" ${ENGINE_ARGS:-} \
    > "$out/$name.log" 2>&1 || { echo "$v: failed"; tail -5 "$out/$name.log"; continue; }
  python3 - "$out/$name" "$v" <<'PY'
import json, sys, pathlib
d = json.loads((pathlib.Path(sys.argv[1]) / "engine.json").read_text())
m = d["mc_sparse"]
keys = ("anchor_ms", "anchor_x_cudnn", "dense_lse_ms", "grouping_ms", "mass_ms", "selection_total_ms", "reuse_ms",
        "density", "kernel_call_unfilled_ms", "kernel_compact_no_residual_ms", "kernel_int32_lists_ms")
print(sys.argv[2], "cudnn", round(d["cudnn_dense_ms"], 2), {k: round(m[k], 3) for k in keys if k in m})
print(sys.argv[2], "memory MB", {k: round(v) for k, v in m.get("anchor_memory", {}).items()})
PY
done
