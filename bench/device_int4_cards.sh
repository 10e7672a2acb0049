#!/usr/bin/env bash
# Device calls (carry: [".carry/bundle-033.tar.xz", ".carry/quality"]; the bundle from
# `COMFYUI_PATH=.cache/comfyui-0.33.0 BUNDLE=.carry/bundle-033.tar.xz bash bench/device_bundle.sh`). Parts, chosen by
# INT4_PARTS (default "heldout auto", about 7 minutes; each part's archive lands in $OUT as soon as it ends):
#   heldout  issue 18: the searched allocations on 16 more videos no search has seen (seeds 16-31;
#            docs/calibration.md), ~1 min, carry .carry/quality only;
#   auto     the small-VRAM preset (residual_precision "auto") on a simulated 16 GB card with a 16 GB host cache,
#            Wan 2.1 14B 720p fp8 weights under ComfyUI 0.33.0, dense measured on the same card (docs/decisions.md,
#            "Residuals at 4 bits"), ~5 min;
#   pool     the page-locked pool's GPU tests (cut buffers, recycling across anchors, a prefetch reading a recycled
#            buffer), ~1 min;
#   whole    the small-VRAM preset ("auto") on the 16 GB card with a 16 GB host cache, a whole 30-step run, every step
#            timed (anchors at steps 0, 6, 16), dense from DENSE (needed), ~7 min with the start;
#   fp8      the same preset with fp8 residuals (as before "auto"), dense taken from DENSE (an e2e.json of the same
#            kind of card, e.g. the auto part's, committed) or from an auto part earlier in the same call; the H200's
#            fp8 row (docs/bench-runs/small-cards-7/host16) gave 1.55x against its own dense.
#   [INT4_PARTS="heldout auto fp8"] [DENSE=.../e2e.json] bash bench/device_int4_cards.sh
# Run once on an H100 (docs/bench-runs/int4-cards-1/, search-heldout-1/); to time `auto` again against that card's dense
# row (after the pool change for later anchors, docs/benchmarks.md, "4-bit residuals on a 16 GB card"):
#   INT4_PARTS=auto DENSE=docs/bench-runs/int4-cards-1/auto/wan14b-fp8-card16/e2e.json bash bench/device_int4_cards.sh
# (twenty-first session: INT4_PARTS="pool auto", then INT4_PARTS=whole, with that DENSE, raw docs/bench-runs/int4-cards-2/
# and int4-cards-3/: the pool cutting fp8 buffers in halves for the packed residuals, and compact packed residuals)
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_part.sh
parts=" ${INT4_PARTS:-heldout auto} "
bundle() {  # bundle PRECISION [DENSE]: the small-cards script's run of the preset, its archive named after PRECISION
  # (or ARCHIVE); WHOLE=1 times every step of the run
  rm -f "$OUT/small_cards.tar.gz"
  BUNDLE=.carry/bundle-033.tar.xz PARTS=wan14b CARD=16 HOST_GB=16 WAN14B_MODES=block_topk@0.08 WARMUP_LAYERS=0 \
    PRESET=wan21_t2v_14b_small_vram WAN14B_LIMIT=${WAN14B_LIMIT:-330} RESIDUAL_PRECISION=$1 DENSE=${2:-} \
    bash bench/device_small_cards_whole.sh
  if [ -f "$OUT/small_cards.tar.gz" ]; then mv "$OUT/small_cards.tar.gz" "$OUT/small_cards_${ARCHIVE:-$1}.tar.gz"; fi
}
if [[ $parts == *" heldout "* ]]; then
  need_quality_carry
  new_root /tmp/alloc_check
  record_gpu
  mapfile -t allocs < <(python3 - <<'PY'
import json
for name, path in (("quadratic search", "docs/bench-runs/search-model-1/mc_quadratic/search.json"),
                   ("greedy search", "docs/bench-runs/search-2/search.json")):
    print(f"{name}={json.load(open(path))['result']['layer_densities']}")
PY
  )
  r5=$(python3 bench/search_model.py docs/bench-runs/search-1/mc_sparse/search.json --factors 0.5)
  if [ "${#allocs[@]}" = 2 ] && [ -n "$r5" ]; then
    part mc_heldout 120 python3 bench/quality_allocations.py --testbed "$b/testbed" --out "$root/mc_heldout" \
      --method mc_sparse --density 0.1 --seeds 16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31 --batch 8 \
      --alloc "${allocs[0]}" --alloc "${allocs[1]}" --alloc "model r0.5=$r5"
  else
    echo "heldout: the searched allocations could not be read (${#allocs[@]} of 2, model: ${r5:-none})"
  fi
  tar czf "$OUT/alloc_check.tar.gz" -C /tmp alloc_check
fi
if [[ $parts == *" pool "* ]]; then
  new_root /tmp/pool_tests
  record_gpu
  part gpu-tests 150 python3 -m pytest -q -rs -m gpu tests/test_gpu_kernels.py -p no:cacheprovider \
    -k "page_lock or host_entries or recycled_host or packed_host_residuals"
  tar czf "$OUT/pool_tests.tar.gz" -C /tmp pool_tests
fi
dense=${DENSE:-}
if [[ $parts == *" auto "* ]]; then
  bundle auto "$dense"
  made=/tmp/small_cards/wan14b-fp8-card16/e2e.json
  if [ -z "$dense" ] && [ -f "$made" ]; then cp "$made" /tmp/dense-card16.json && dense=/tmp/dense-card16.json; fi
fi
if [[ $parts == *" whole "* ]]; then
  if [ -n "$dense" ] && [ -f "$dense" ]; then
    WHOLE=1 ARCHIVE=whole WAN14B_LIMIT=${WAN14B_LIMIT:-420} bundle auto "$dense"
  else
    echo "whole: no dense row (DENSE, or an auto part before it in this call): skipped"
  fi
fi
if [[ $parts == *" fp8 "* ]]; then
  if [ -n "$dense" ] && [ -f "$dense" ]; then
    bundle fp8 "$dense"
  else
    echo "fp8: no dense row (DENSE, or an auto part before it in this call): skipped"
  fi
fi
ls -la "$OUT"
