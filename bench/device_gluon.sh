#!/usr/bin/env bash
# On the H100/H200 (nothing to carry: the image has torch and Triton 3.6 with Gluon): the Gluon probe of
# bench/gluon_attention.py — checks against the twins at real sizes, then dense and block-sparse timings against cuDNN
# and our TMA kernels (docs/kernel_notes.md, "v17"; its compiler report is made offline with --compile-only).
# Each configuration is first checked in its own process under CHECK_LIMIT seconds (default 90): the kernel has not
# run on a GPU before, and one whose barriers deadlock must cost its own timeout, not the run; only configurations
# whose check passed are timed.
# SHAPES (default wan14b,hyv,wan13b), BUDGET (seconds for the timings, default 240), LIMIT (seconds for the whole
# script, default 420: a kernel that never returns is killed and its log so far comes back), CONFIGS (e.g.
# "BN128 s2 split,BN128 s2 w8"; default all), DENSITIES (block-sparse densities, default 0.25,0.1,0.5; "" for dense
# only). Output in $OUT/gluon/ (gluon.log line by line, gluon.json, gpu.csv).
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p "$OUT/gluon"
start=$(date +%s)
limit=${LIMIT:-420}
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > "$OUT/gluon/gpu.csv" 2>&1
if [ -n "${CONFIGS:-}" ]; then
  IFS=',' read -r -a wanted <<< "$CONFIGS"
else
  mapfile -t wanted < <(python3 bench/gluon_attention.py --list-configs)
fi
passed=()
for cfg in "${wanted[@]}"; do
  cfg="$(echo "$cfg" | xargs)"
  left=$(( limit - ($(date +%s) - start) ))
  [ "$left" -gt 30 ] || { echo "no time left to check $cfg"; break; }
  t=$(( left < ${CHECK_LIMIT:-90} ? left : ${CHECK_LIMIT:-90} ))
  timeout "$t" python3 bench/gluon_attention.py --out "$OUT/gluon" --check-only --configs "$cfg" 2>&1 | tail -20
  rc=${PIPESTATUS[0]}
  echo "check of $cfg: exit $rc$([ "$rc" = 124 ] && echo ' (timed out: a hang)')" | tee -a "$OUT/gluon/gluon.log"
  [ "$rc" = 0 ] && passed+=("$cfg")
done
[ "${#passed[@]}" -gt 0 ] || { echo "no configuration passed its check: nothing timed"; exit 1; }
list="$(IFS=','; echo "${passed[*]}")"
left=$(( limit - ($(date +%s) - start) ))
budget=${BUDGET:-240}
budget=$(( budget < left - 60 ? budget : left - 60 ))
[ "$budget" -gt 10 ] || { echo "no time left for the timings"; exit 1; }
timeout "$left" python3 bench/gluon_attention.py --out "$OUT/gluon" --budget "$budget" \
  --shapes "${SHAPES:-wan14b,hyv,wan13b}" --configs "$list" --densities "${DENSITIES-0.25,0.1,0.5}" 2>&1 |
  tail -150
