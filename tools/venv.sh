#!/usr/bin/env bash
# Sourced by tools/test.sh and tools/demo.sh: make sure $VENV exists with torch and the pack's requirements.
ROOT=${ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
VENV=${VENV:-$ROOT/.venv}
PY=${PYTHON:-python3}
log() { echo "[$(basename "$0") $(date +%H:%M:%S)] $*"; }
if [ ! -x "$VENV/bin/python" ]; then
  log "creating venv $VENV"
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
if ! "$VENV/bin/python" -c "import torch, torchvision" 2>/dev/null; then
  log "installing torch 2.14.1 / torchvision 0.29.1"
  $PIP install -q torch==2.14.1 torchvision==0.29.1
fi
log "installing the pack's requirements"
$PIP install -q -r "$ROOT/requirements.txt" "numpy<2.5"
