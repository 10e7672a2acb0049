"""Run a snippet inside a real ComfyUI (in a child process, so ComfyUI's global state stays out of pytest).

The snippet runs with the ComfyUI tree as working directory and first on ``sys.path`` (test code
only; the pack itself never edits ``sys.path``), with ``--cpu`` parsed by ComfyUI's own options.
It must print one JSON line prefixed with ``RESULT:``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

PRELUDE = """
import sys, json, logging
sys.argv = ["main.py", "--cpu", "--disable-api-nodes"]
sys.path.insert(0, {root!r})
import comfy.options
comfy.options.enable_args_parsing()
def emit(obj):
    print("RESULT:" + json.dumps(obj), flush=True)
"""


def run_in_comfyui(comfy_root: Path, body: str, timeout: int = 600) -> dict:
    """Execute ``body`` in a child Python inside ``comfy_root``; return the RESULT JSON it printed."""
    code = PRELUDE.format(root=str(comfy_root)) + textwrap.dedent(body)
    env = dict(os.environ)
    env.setdefault("CUDA_VISIBLE_DEVICES", "")
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(comfy_root), env=env, capture_output=True,
                          text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT:")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"ComfyUI child failed (rc={proc.returncode})\nstdout:\n{proc.stdout[-4000:]}\n"
                             f"stderr:\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1][len("RESULT:"):])
