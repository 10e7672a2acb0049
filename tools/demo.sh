#!/usr/bin/env bash
# The demo in one command on a fresh machine (no GPU, no ComfyUI needed): sets up .venv, then runs
# tools/demo.py (arguments pass through; on a CUDA machine it runs a Wan-1.3B-sized problem on Triton).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/tools/venv.sh"
exec "$VENV/bin/python" "$ROOT/tools/demo.py" "$@"
