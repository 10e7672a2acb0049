set -u
export PYTHONUNBUFFERED=1
a="--heads 24 --frames 1 --height 72 --width 64 --overhead-reps 20 --methods mc_sparse"
b="--heads 24 --frames 2 --height 64 --width 64 --overhead-reps 20 --methods mc_sparse"
for i in 1 2; do
  timeout 100 python3 .carry/base/bench/engine.py --out $OUT/base-4608-$i $a > $OUT/base-4608-$i.log 2>&1
  timeout 100 python3 bench/engine.py --out $OUT/new-4608-$i $a > $OUT/new-4608-$i.log 2>&1
done
timeout 60 python3 .carry/base/bench/engine.py --out $OUT/base-8192 $b > $OUT/base-8192.log 2>&1
timeout 60 python3 bench/engine.py --out $OUT/new-8192 $b > $OUT/new-8192.log 2>&1
python3 - <<'PY'
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/*/engine.json")):
    d = json.load(open(f))
    r = d["mc_sparse"]; print(f.split("/")[-2], "cudnn %.3f" % d["cudnn_dense_ms"], "anchor %.3f grouping %.3f selection %.3f" % (r["anchor_ms"], r["grouping_ms"], r["selection_total_ms"]))
PY
cd $OUT && tar czf /tmp/mc-ab.tgz * && rm -rf $OUT/* && mv /tmp/mc-ab.tgz $OUT/
