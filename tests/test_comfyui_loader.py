"""ComfyUI's own custom-node loader imports the pack without error (needs COMFYUI_PATH)."""

import pytest
from comfy_subprocess import run_in_comfyui
from conftest import ROOT, comfyui_path

pytestmark = pytest.mark.comfyui


def test_comfyui_loader_imports_pack(tmp_path):
    custom = tmp_path / "custom_nodes"
    custom.mkdir()
    pack = custom / "comfyui-sparse-attention"
    pack.symlink_to(ROOT, target_is_directory=True)
    result = run_in_comfyui(comfyui_path(), f"""
        import asyncio, io
        import nodes
        stream = io.StringIO()
        handler = logging.StreamHandler(stream)
        logging.getLogger().addHandler(handler)
        before = set(nodes.NODE_CLASS_MAPPINGS)
        ok = asyncio.run(nodes.load_custom_node({str(pack)!r}))
        added = sorted(set(nodes.NODE_CLASS_MAPPINGS) - before)
        emit({{"ok": ok, "added": added, "log": stream.getvalue(),
               "web": {{k: v for k, v in nodes.EXTENSION_WEB_DIRS.items()}}}})
    """)
    assert result["ok"] is True, result["log"]
    assert "Traceback" not in result["log"] and "Cannot import" not in result["log"], result["log"]
    assert result["added"] == ["SparseAttn_Calibrate", "SparseAttn_Compare", "SparseAttn_Patch", "SparseAttn_Preset",
                               "SparseAttn_Record",
                               "SparseAttn_Report"], result["log"]
