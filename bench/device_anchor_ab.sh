#!/usr/bin/env bash
# One H200 call: anchors (and reuse calls) of bench/engine.py from an older commit and from this tree, alternating, at
# 24 heads x 4 608 tokens (twice) and 8 192 (once). Build the older copy first and carry it:
#   git archive REV | tar -x -C .carry/base        carry [".carry/base"]
#   METHODS=mc_sparse,block_topk PROFILE=1 bash bench/device_anchor_ab.sh   (anchor-plan-1: the block plan kept)
#   METHODS=mc_sparse bash bench/device_anchor_ab.sh                      (anchor-plan-1/mc-ab: the grouping)
# METHODS: bench/engine.py --methods (the 8 192-token runs take the last); PROFILE=1 adds --host-profile to this tree's
# 4 608-token runs. Prints each run's anchor_ms (and mc_sparse's grouping and selection), packs $OUT into one file.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
[ -d .carry/base/bench ] || { echo "no .carry/base: git archive REV | tar -x -C .carry/base, and carry it" >&2; exit 2; }
methods=${METHODS:-block_topk,mc_sparse}
reps="--overhead-reps 20"
a="--heads 24 --frames 1 --height 72 --width 64 $reps --methods $methods"
b="--heads 24 --frames 2 --height 64 --width 64 $reps --methods ${methods##*,}"
profile=${PROFILE:+--host-profile}
for i in 1 2; do
  timeout 100 python3 .carry/base/bench/engine.py --out "$OUT/base-4608-$i" $a > "$OUT/base-4608-$i.log" 2>&1
  timeout 100 python3 bench/engine.py --out "$OUT/new-4608-$i" $a $profile > "$OUT/new-4608-$i.log" 2>&1
done
timeout 60 python3 .carry/base/bench/engine.py --out "$OUT/base-8192" $b > "$OUT/base-8192.log" 2>&1
timeout 60 python3 bench/engine.py --out "$OUT/new-8192" $b > "$OUT/new-8192.log" 2>&1
python3 - <<'PY'
import glob, json, os
for f in sorted(glob.glob(os.environ["OUT"] + "/*/engine.json")):
    d = json.load(open(f))
    cols = []
    for m in ("block_topk", "mc_sparse"):
        if m in d:
            r = d[m]
            cols.append(f"{m} anchor {r['anchor_ms']:.3f}" + (f" grouping {r['grouping_ms']:.3f} selection "
                                                            f"{r['selection_total_ms']:.3f}" if "grouping_ms" in r else ""))
    print(f.split("/")[-2], f"cudnn {d['cudnn_dense_ms']:.3f}", "; ".join(cols))
PY
cd "$OUT" && tar czf /tmp/anchor-ab.tgz -- * && rm -rf -- "${OUT:?}"/* && mv /tmp/anchor-ab.tgz "$OUT/"
