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


def test_validation_errors_name_the_input_that_is_wrong(tmp_path):
    """Through ComfyUI's own execution code. Prompt validation: a bad number is ComfyUI's range error on that
    input, a bad text field the node's check on the text inputs only (never on `model` or every widget), an unknown
    preset one error on `preset`. The execution cache: the Preset node's fingerprint is its preset file's (every
    file's for auto)."""
    custom = tmp_path / "custom_nodes"
    custom.mkdir()
    pack = custom / "comfyui-sparse-attention"
    pack.symlink_to(ROOT, target_is_directory=True)
    result = run_in_comfyui(comfyui_path(), f"""
        import asyncio
        import execution, nodes
        assert asyncio.run(nodes.load_custom_node({str(pack)!r}))

        class FakeModel:
            @classmethod
            def INPUT_TYPES(cls):
                return {{"required": {{}}}}
            RETURN_TYPES, FUNCTION = ("MODEL",), "f"

        class FakeLatent(FakeModel):
            RETURN_TYPES = ("LATENT",)
        nodes.NODE_CLASS_MAPPINGS.update(QAFakeModel=FakeModel, QAFakeLatent=FakeLatent)
        widgets = dict(method="block_topk", density=0.08, block_size="128", query_group_size="128",
                       warmup_steps="0", warmup_layers=0, dense_layers="", anchor_steps="20%, 53%",
                       residual_caching=True, cache_offload=True, min_tokens=8192, backend="auto",
                       layer_densities="")

        def errors(node, **inputs):
            prompt = {{"1": {{"class_type": "QAFakeModel", "inputs": {{}}}},
                       "2": {{"class_type": "QAFakeLatent", "inputs": {{}}}},
                       "3": {{"class_type": node, "inputs": dict(model=["1", 0], **inputs)}},
                       "4": {{"class_type": "SparseAttn_Report",
                              "inputs": {{"model": ["3", 0], "samples": ["2", 0], "layer": -1}}}}}}
            out = asyncio.run(execution.validate_prompt("p", prompt, None))
            node_errors = out[3] if len(out) > 3 else {{}}
            return [(e["extra_info"].get("input_name"), e["type"], e.get("details", ""))
                    for e in node_errors.get("3", {{}}).get("errors", [])]
        import sys
        from comfy_execution.graph import DynamicPrompt
        node_module = sys.modules[nodes.NODE_CLASS_MAPPINGS["SparseAttn_Preset"].__module__]
        preset_fingerprint = node_module.preset_fingerprint

        def fingerprint(preset):  # what ComfyUI's execution cache keys the Preset node on, besides its inputs
            prompt = {{"1": {{"class_type": "QAFakeModel", "inputs": {{}}}},
                       "3": {{"class_type": "SparseAttn_Preset",
                              "inputs": {{"model": ["1", 0], "preset": preset, "density_override": 0.0}}}}}}
            return asyncio.run(execution.IsChangedCache("p", DynamicPrompt(prompt), None).get("3"))
        emit(dict(fingerprints=[fingerprint("balanced"), fingerprint(node_module.AUTO_PRESET)],
                  expected=[[list(map(list, preset_fingerprint("balanced")))],
                            [list(map(list, preset_fingerprint(None)))]],
                  good=errors("SparseAttn_Patch", **widgets),
                  density=errors("SparseAttn_Patch", **{{**widgets, "density": 0.0}}),
                  anchors=errors("SparseAttn_Patch", **{{**widgets, "anchor_steps": "ten"}}),
                  factors=errors("SparseAttn_Patch", **{{**widgets, "anchor_density_factors": "1.5, x"}}),
                  factors_ok=errors("SparseAttn_Patch", **{{**widgets, "anchor_density_factors": "1.5, 0.8"}}),
                  preset=errors("SparseAttn_Preset", preset="nope", density_override=0.0),
                  override=errors("SparseAttn_Preset", preset="balanced", density_override=1.5)))
    """)
    assert result["good"] == [] == result["factors_ok"], result  # the optional input may be left out or given
    assert result["fingerprints"] == result["expected"], result  # an edited preset file makes the node run again
    assert [(name, kind) for name, kind, _ in result["density"]] == [("density", "value_smaller_than_min")], result
    texts = {"warmup_steps", "dense_layers", "anchor_steps", "layer_densities"}
    assert {name for name, _, _ in result["anchors"]} == texts, result
    assert all("anchor_steps" in details for _, _, details in result["anchors"]), result
    assert {name for name, _, _ in result["factors"]} == texts | {"anchor_density_factors"}, result
    assert all("anchor_density_factors" in details for _, _, details in result["factors"]), result
    assert [name for name, _, _ in result["preset"]] == ["preset"], result
    assert "not one of the" in result["preset"][0][2] and str(ROOT) not in result["preset"][0][2], result
    assert [(name, kind) for name, kind, _ in result["override"]] == [("density_override", "value_bigger_than_max")]
