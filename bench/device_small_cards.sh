#!/usr/bin/env bash
# On an H200 (carry: .carry/bundle-033.tar.xz as for bench/device_multigpu.sh): the engine's per-call host
# overhead on reuse calls at 4 608 tokens (bench/engine.py), then Wan 2.1 14B 720p with fp8 weights on simulated
# 24 GB and 16 GB cards with a 32 GB host cache cap (bench/e2e.py --vram-gb/--host-gb/--weights fp8).
# Results packed into $OUT/small_cards.tar.gz.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_part.sh
new_root /tmp/small_cards
source bench/device_comfyui.sh
unpack_comfyui .carry/bundle-033.tar.xz
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
record_gpu
part overhead-flux 45 python3 bench/engine.py --out "$root/overhead-flux" \
  --heads 24 --frames 1 --height 72 --width 64
part overhead-wan13b 45 python3 bench/engine.py --out "$root/overhead-wan13b" \
  --heads 12 --frames 2 --height 48 --width 48
part card24 240 python3 bench/e2e.py --out "$root/card24" --models wan14b --modes block_topk@0.15 \
  --vram-gb 24 --host-gb 32 --weights fp8 --budget-s 230
part card16 240 python3 bench/e2e.py --out "$root/card16" --models wan14b --modes block_topk@0.15 \
  --vram-gb 16 --host-gb 32 --weights fp8 --budget-s 230
tar czf "$OUT/small_cards.tar.gz" -C /tmp small_cards
ls -la "$OUT"
