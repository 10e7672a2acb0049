#!/usr/bin/env bash
# One H200 call (nothing to carry): the GPU kernel tests, eager against lazy rescaling in every TMA / token kernel
# (bench/hopper.py --plan rescale) and the engine's anchor / reuse cost at Wan 14B (bench/engine.py: grouping,
# pass 2, threshold). Each part keeps what it measured; all packed into $OUT/rescale.tar.gz.
#   bash bench/device_rescale.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_part.sh
new_root /tmp/rescale
record_gpu
part gpu_tests 180 env SPARSE_ATTN_TUNE=first python3 -m pytest -q -rs -m gpu tests/test_gpu_kernels.py -p no:cacheprovider
part rescale 250 python3 bench/hopper.py --plan rescale --shapes wan14b,hyv --skip-tests --no-flex --budget 210 --out "$root/rescale"
part engine 100 python3 bench/engine.py --out "$root/engine"
tar czf "$OUT/rescale.tar.gz" -C /tmp rescale
ls -la "$OUT"
