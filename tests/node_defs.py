"""ComfyUI's node definitions in /object_info form, generated from the ComfyUI tree under test.

A child process starts ComfyUI the way ``main.py`` does — ``PromptServer``, then ``nodes.init_extra_nodes``
(core nodes, ``comfy_extras``, ``comfy_api_nodes`` where they import, and this pack as a custom node) —
and calls the server's own ``GET /object_info`` handler, so the definitions are exactly what that
ComfyUI's frontend would receive. No network, no port: the handler is called directly.
"""

from __future__ import annotations

import json
from pathlib import Path

from comfy_subprocess import run_in_comfyui
from conftest import ROOT

BODY = """
import asyncio, logging, io, os
base = {base!r}
# the prelude parsed no ComfyUI options yet (comfy.cli_args is imported lazily): set them like main.py
sys.argv = ["main.py", "--cpu", "--base-directory", base]
stream = io.StringIO()
logging.getLogger().addHandler(logging.StreamHandler(stream))
logging.getLogger().setLevel(logging.INFO)
import utils.extra_config  # first, as main.py does: a later import puts comfy/ (with a utils.py) on sys.path
import server, nodes
loop = asyncio.new_event_loop()
asyncio.set_event_loop(loop)
prompt_server = server.PromptServer(loop)
failed = loop.run_until_complete(nodes.init_extra_nodes(init_custom_nodes=True, init_api_nodes=True))
handler = next(r.handler for r in prompt_server.routes if r.method == "GET" and r.path == "/object_info")
response = loop.run_until_complete(handler(None))
with open({out!r}, "w") as f:
    f.write(response.text)
log = stream.getvalue()
emit(dict(failed=list(failed or []), import_failed=[ln.split("IMPORT FAILED:", 1)[1].strip()
                                                    for ln in log.splitlines() if "IMPORT FAILED:" in ln],
          cannot_import=[ln for ln in log.splitlines() if "Cannot import" in ln]))
"""


def generate(comfy_root: Path, workdir: Path) -> tuple[dict, dict]:
    """(node definitions {type: /object_info entry}, import report) of the ComfyUI at ``comfy_root``, with
    this pack installed as ``custom_nodes/comfyui-sparse-attention``; ``workdir``: an empty scratch folder
    (ComfyUI's base directory and the output file)."""
    base = workdir / "base"
    (base / "custom_nodes").mkdir(parents=True)
    (base / "custom_nodes" / "comfyui-sparse-attention").symlink_to(ROOT, target_is_directory=True)
    out = workdir / "object_info.json"
    report = run_in_comfyui(comfy_root, BODY.format(base=str(base), out=str(out)), timeout=600)
    return json.loads(out.read_text()), report
