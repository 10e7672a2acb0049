#!/usr/bin/env bash
# On the H200 (carry: [".carry/bundle.tar.xz"], ComfyUI 0.3.75 from bench/device_bundle.sh; BUNDLE names another):
# the presets on small cards (docs/benchmarks.md, "Small cards"): Wan 2.1 1.3B 480p whole 50-step runs
# (bench/e2e.py --whole-run) on simulated 16 GB and 8 GB cards, then Wan 2.1 14B 720p with fp8 weights on a 24 GB
# card timed as anchor, reuse, later anchor, reuse (--pattern ArAr; a whole run does not fit one device call); by
# default host cache capped at 32 GB, density 0.1 (the Wan 14B part's CARD, HOST_GB, WAN14B_MODES and WARMUP_LAYERS
# below change that). PARTS picks some of "wan13b wan14b" (default both). Under
# ComfyUI 0.3.75 the 24 GB card's dense run itself runs out of memory (its loader leaves too little room for
# activations at 720p); 0.33.0 runs it: BUNDLE=.carry/bundle-033.tar.xz PARTS=wan14b.
# Everything in $OUT/small_cards.tar.gz.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_part.sh
new_root /tmp/small_cards
source bench/device_comfyui.sh
unpack_comfyui "${BUNDLE:-.carry/bundle.tar.xz}"
record_gpu
parts=${PARTS:-wan13b wan14b}
if [[ " $parts " == *" wan13b "* ]]; then
  for g in 16 8; do
    part "wan13b-card$g" 150 python3 bench/e2e.py --out "$root/wan13b-card$g" --models wan13b \
      --modes block_topk@0.1 --vram-gb "$g" --host-gb 32 --whole-run
  done
fi
# DENSE: an e2e.json whose dense row to reuse (--reuse-dense), e.g. docs/bench-runs/e2e-card24-wan14b/e2e.json.
# CARD (GB, default 24), HOST_GB (default 32), WAN14B_MODES (default block_topk@0.1) and WARMUP_LAYERS (default: the
# preset's) set the Wan 14B part; the small-VRAM preset's setting on a 16 GB card: CARD=16 HOST_GB=32 (its cap; 16 as
# a smaller host) WAN14B_MODES=block_topk@0.08 WARMUP_LAYERS=0 DENSE=docs/bench-runs/e2e-card16-wan14b/e2e.json.
# PRESET runs that preset's settings (e.g. wan21_t2v_14b_small_vram: its residual_precision "auto" packs the residuals
# that find no room at fp8 to 4 bits; docs/decisions.md, "Residuals at 4 bits") instead of the model's own preset;
# RESIDUAL_PRECISION (fp8, int4, auto) overrides the preset's residual_precision. WHOLE=1 times every step of the
# 30-step run instead (--whole-run; raise WAN14B_LIMIT to ~420).
card=${CARD:-24}
[[ " $parts " == *" wan14b "* ]] && part "wan14b-fp8-card$card" "${WAN14B_LIMIT:-400}" python3 bench/e2e.py \
  --out "$root/wan14b-fp8-card$card" --models wan14b --modes "${WAN14B_MODES:-block_topk@0.1}" --vram-gb "$card" \
  --host-gb "${HOST_GB:-32}" --weights fp8 --pattern ArAr --total-steps 30 ${DENSE:+--reuse-dense "$DENSE"} \
  ${WARMUP_LAYERS:+--warmup-layers "$WARMUP_LAYERS"} ${PRESET:+--preset "$PRESET"} \
  ${RESIDUAL_PRECISION:+--residual-precision "$RESIDUAL_PRECISION"} ${WHOLE:+--whole-run}
tar czf "$OUT/small_cards.tar.gz" -C /tmp small_cards
