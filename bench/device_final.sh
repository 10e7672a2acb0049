#!/usr/bin/env bash
# One H200 call for the session's last measurements (carry: .carry/bundle.tar.xz and .carry/quality/testbed):
# calibrated vs uniform density on the quality testbed, the PyTorch backend on CUDA, and Wan 1.3B 480p on simulated
# 16 GB and 8 GB cards. Each part has its own time limit and keeps what it measured; everything is packed into
# $OUT/final.tar.gz (the device returns at most 8 files).
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_part.sh
new_root /tmp/final
part calibration 160 bash bench/device_calibration.sh
part torch_backend 80 python3 bench/torch_backend.py --device cuda --out "$root/torch_backend"
part card16 120 bash bench/device_e2e.sh --models wan13b --modes block_topk@0.15,mc_sparse@0.15 --vram-gb 16 --host-gb 32
part card8 90 bash bench/device_e2e.sh --models wan13b --modes block_topk@0.15 --vram-gb 8 --host-gb 32
tar czf "$OUT/final.tar.gz" -C /tmp final
ls -la "$OUT"
