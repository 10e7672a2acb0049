#!/usr/bin/env bash
# Build .carry/quality/ (git-ignored; ~48 MB, ~14 MB with --no-sol) for bench/device_quality.sh: the quality
# testbed (model.py, evaluate.py, weights.safetensors) and comfy-kitchen 0.2.40 (CUDA backend only, packed)
# for the Sol-Attn rows.
#   bash bench/quality_bundle.sh [--no-sol] [TESTBED_DIR]      (default TESTBED_DIR: /work/shared/quality)
# Then on the device (carry: [".carry/quality"]): bash bench/device_quality.sh [bench/quality.py arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
sol=1
if [ "${1:-}" = "--no-sol" ]; then sol=0; shift; fi
src=${1:-/work/shared/quality}
for f in model.py evaluate.py weights.safetensors; do
  [ -f "$src/$f" ] || { echo "quality_bundle: $src/$f not found (give the testbed folder)" >&2; exit 2; }
done
dest=.carry/quality
rm -rf "$dest"
mkdir -p "$dest/testbed"
cp "$src/model.py" "$src/evaluate.py" "$src/weights.safetensors" "$dest/testbed/"
if [ "$sol" = 1 ]; then
  source bench/wheels.sh
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  fetch_wheels "$work/site" comfy-kitchen==0.2.40
  tar cJf "$dest/site.tar.xz" -C "$work" site
fi
du -sh "$dest"/* "$dest"/testbed/*; du -sh "$dest"
