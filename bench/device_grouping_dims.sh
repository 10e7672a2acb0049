#!/usr/bin/env bash
# On the H100/H200 (carry: [".carry/quality"], built by bench/quality_bundle.sh): the mc_sparse anchor with the query
# grouping on each head's 16 leading principal directions (SparseConfig.grouping_dims, the default) against the
# grouping on every coordinate (grouping_dims=0): GPU tests (TESTS_K), the anchor's phases at Wan 14B
# (bench/device_mc_anchor.sh), an operator profile of the default's grouping and selection, and the testbed's PSNR
# (bench/grids/grouping_dims.yaml, 16 videos). Everything lands in $OUT/grouping-dims.tgz (one file comes back).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
root=$OUT
res="$root/grouping-dims"
mkdir -p "$res"
if [ -n "${TESTS_K:-}" ]; then
  SPARSE_ATTN_TUNE=first timeout 240 python3 -m pytest -q -rs -m gpu tests/test_gpu_kernels.py -p no:cacheprovider \
    -k "$TESTS_K" > "$res/gpu-tests.log" 2>&1
  tail -3 "$res/gpu-tests.log"
fi
OUT=$res VARIANTS="${VARIANTS:-- grouping_dims=0}" timeout 200 bash bench/device_mc_anchor.sh
timeout 120 python3 bench/engine.py --out "$res/profile" --methods mc_sparse --overhead-reps 3 --profile \
  > "$res/profile.log" 2>&1 || tail -5 "$res/profile.log"
OUT=$res/quality timeout 300 bash bench/device_quality.sh --grid bench/grids/grouping_dims.yaml --steps 30 \
  --budget-s "${QUALITY_BUDGET:-200}" --seeds 0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15 2>&1 | tail -15
tar czf "$root/grouping-dims.tgz" -C "$root" grouping-dims && rm -rf "$res"
