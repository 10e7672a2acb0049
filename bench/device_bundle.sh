#!/usr/bin/env bash
# Build a bundle (git-ignored; ~38 MB): a ComfyUI source tree and the wheels the H200 lacks (torchsde +
# trampoline for ComfyUI's samplers, comfy-kitchen for Sol-Attn (CUDA backend only), and comfy-aimdo where the
# tree requires it, as ComfyUI 0.33.0 does; versions as the tree's requirements.txt pins them).
#   COMFYUI_PATH=/path/to/ComfyUI [BUNDLE=.carry/bundle.tar.xz] bash bench/device_bundle.sh
# Then on the device (carry: [".carry"]): [BUNDLE=...] bash bench/device_e2e.sh [e2e.py arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
: "${COMFYUI_PATH:?set COMFYUI_PATH to a ComfyUI source tree}"
BUNDLE=${BUNDLE:-.carry/bundle.tar.xz}
source bench/wheels.sh
pin() {  # pin NAME DEFAULT: NAME==version as the tree's requirements.txt pins it, else NAME==DEFAULT ("" = skip)
  local v
  v=$(sed -n "s/^$1==\([0-9.]*\).*/\1/p" "$COMFYUI_PATH/requirements.txt" 2>/dev/null | head -n1)
  v=${v:-$2}
  [ -n "$v" ] && echo "$1==$v"
  return 0
}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# shellcheck disable=SC2046
fetch_wheels "$work/x/site" $(pin comfy-kitchen 0.2.40) $(pin comfy-aimdo "") torchsde==0.2.6 trampoline==0.1.2
rm -f "$work/x/site/comfy_aimdo/aimdo_rocm.so"  # ROCm only, as comfy_kitchen's hip backend
cp -r "$COMFYUI_PATH" "$work/x/comfyui"
(cd "$work/x/comfyui" && rm -rf tests tests-unit comfy_api_nodes script_examples .git \
  && find . -name __pycache__ -prune -exec rm -rf {} +)
mkdir -p "$(dirname "$BUNDLE")"
tar cJf "$BUNDLE" -C "$work/x" site comfyui
ls -la "$BUNDLE"
