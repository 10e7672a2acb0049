#!/usr/bin/env bash
# One device call (carry: [".carry/bundle-033.tar.xz", ".carry/quality"]; the bundle from
# `COMFYUI_PATH=.cache/comfyui-0.33.0 BUNDLE=.carry/bundle-033.tar.xz bash bench/device_bundle.sh`):
# 1. issue 18: the searched allocations on 16 more videos no search has seen (seeds 16-31; docs/calibration.md);
# 2. the small-VRAM preset (residual_precision "auto") on a simulated 16 GB card with a 16 GB host cache, Wan 2.1 14B
#    720p fp8 weights under ComfyUI 0.33.0, dense measured on the same card (docs/decisions.md, "Residuals at 4 bits");
# 3. with FP8=1, the same preset with fp8 residuals (as before "auto"), reusing part 2's dense row (the H200's
#    fp8 row, docs/bench-runs/small-cards-7/host16, gave 1.55x against its own dense).
# Each part's archive lands in $OUT as soon as it ends.
#   [FP8=1] [CARDS=0: part 1 only] bash bench/device_int4_cards.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_part.sh
need_quality_carry
new_root /tmp/alloc_check
python3 - > /tmp/allocs.txt <<'PY'
import json
for name, path in (("quadratic search", "docs/bench-runs/search-model-1/mc_quadratic/search.json"),
                   ("greedy search", "docs/bench-runs/search-2/search.json")):
    print(f"{name}={json.load(open(path))['result']['layer_densities']}")
PY
mapfile -t allocs < /tmp/allocs.txt
r5=$(python3 bench/search_model.py docs/bench-runs/search-1/mc_sparse/search.json --factors 0.5)
part mc_heldout 120 python3 bench/quality_allocations.py --testbed "$b/testbed" --out "$root/mc_heldout" \
  --method mc_sparse --density 0.1 --seeds 16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31 --batch 8 \
  --alloc "${allocs[0]}" --alloc "${allocs[1]}" --alloc "model r0.5=$r5"
tar czf "$OUT/alloc_check.tar.gz" -C /tmp alloc_check
[ "${CARDS:-1}" = 1 ] || exit 0
export BUNDLE=.carry/bundle-033.tar.xz PARTS=wan14b CARD=16 HOST_GB=16 WAN14B_MODES=block_topk@0.08 WARMUP_LAYERS=0 \
  PRESET=wan21_t2v_14b_small_vram WAN14B_LIMIT=${WAN14B_LIMIT:-330}
RESIDUAL_PRECISION=auto bash bench/device_small_cards_whole.sh
mv "$OUT/small_cards.tar.gz" "$OUT/small_cards_auto.tar.gz"
dense=/tmp/small_cards/wan14b-fp8-card16/e2e.json
cp "$dense" /tmp/dense-card16.json 2>/dev/null
[ "${FP8:-0}" = 1 ] || exit 0
[ -f /tmp/dense-card16.json ] || { echo "no dense row from part 2: part 3 skipped"; exit 0; }
DENSE=/tmp/dense-card16.json RESIDUAL_PRECISION=fp8 bash bench/device_small_cards_whole.sh
mv "$OUT/small_cards.tar.gz" "$OUT/small_cards_fp8.tar.gz"
ls -la "$OUT"
