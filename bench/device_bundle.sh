#!/usr/bin/env bash
# Build .carry/bundle.tar.xz (git-ignored; ~38 MB): a ComfyUI source tree and the wheels the H200 lacks
# (torchsde + trampoline for ComfyUI's samplers, comfy-kitchen 0.2.40 for Sol-Attn, CUDA backend only).
#   COMFYUI_PATH=/path/to/ComfyUI bash bench/device_bundle.sh
# Then on the device (carry: [".carry"]): bash bench/device_e2e.sh [e2e.py arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
: "${COMFYUI_PATH:?set COMFYUI_PATH to a ComfyUI source tree}"
source bench/wheels.sh
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fetch_wheels "$work/x/site" comfy-kitchen==0.2.40 torchsde==0.2.6 trampoline==0.1.2
cp -r "$COMFYUI_PATH" "$work/x/comfyui"
(cd "$work/x/comfyui" && rm -rf tests tests-unit comfy_api_nodes script_examples .git \
  && find . -name __pycache__ -prune -exec rm -rf {} +)
mkdir -p .carry
tar cJf .carry/bundle.tar.xz -C "$work/x" site comfyui
ls -la .carry/bundle.tar.xz
