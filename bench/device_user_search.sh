#!/usr/bin/env bash
# On the H100/H200 (carry: [".carry/quality"], built by bench/quality_bundle.sh --no-sol): can a search on the output
# that a user could afford reach issue 18's target (docs/calibration.md, "A search a user can afford")? The quadratic
# search (bench/quality_search.py --mode quadratic) fitted on ONE video (a user calibrates on their own prompt), then
# checked on the 24 held-out videos 8-31; issue 18's setting (mc_sparse at 0.10, 30 steps, warm-up 2, anchors 2 and
# 10, groups of 64, residual on). PARTS names them, in order (default all):
#   one          per head, one round: the model's optimum (radius 0.5) fitted on video 0, uniform anchors
#                (the 8-video fit gave +1.17 dB held-out) (ONE_S, 90)
#   one-split    per head, rounds until no move gains 0.05 dB, radius 0.75, under the split 1.3 / 0.8895 (SPLIT_S, 150)
#   layer-split  the same per layer (every head of a layer alike: 2 x layers runs a round) (LAYER_S, 90)
#   seed-split   one-split fitted on video 1 instead (another prompt) (SEED_S, 150)
# Results under $OUT/user-search/<part>/ (search.json, search.md, run.log), packed into $OUT/user-search.tar.gz.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_part.sh
need_quality_carry
new_root /tmp/user-search
record_gpu
check=$(seq -s, 8 31)
split=1.3,0.8895
s=(python3 bench/quality_search.py --testbed "$b/testbed" --method mc_sparse --density 0.1 --mode quadratic
   --check-seeds "$check")
for p in ${PARTS:-one one-split layer-split seed-split}; do
  case $p in
    one) part one "${ONE_S:-90}" "${s[@]}" --out "$root/one" --fit-seeds 0 --radius 0.5 --rounds 1 \
      --budget-s $(( ${ONE_S:-90} - 15 )) ;;
    one-split) part one-split "${SPLIT_S:-150}" "${s[@]}" --out "$root/one-split" --fit-seeds 0 --radius 0.75 \
      --anchor-factors "$split" --budget-s $(( ${SPLIT_S:-150} - 20 )) ;;
    layer-split) part layer-split "${LAYER_S:-90}" "${s[@]}" --out "$root/layer-split" --fit-seeds 0 --radius 0.75 \
      --scope layer --anchor-factors "$split" --budget-s $(( ${LAYER_S:-90} - 20 )) ;;
    seed-split) part seed-split "${SEED_S:-150}" "${s[@]}" --out "$root/seed-split" --fit-seeds 1 --radius 0.75 \
      --anchor-factors "$split" --budget-s $(( ${SEED_S:-150} - 20 )) ;;
    *) echo "unknown part $p" >&2 ;;
  esac
done
for d in "$root"/*/; do [ -f "$d/search.md" ] && { echo "## $(basename "$d")"; cat "$d/search.md"; }; done
tar czf "$OUT/user-search.tar.gz" -C /tmp user-search
ls -la "$OUT"
