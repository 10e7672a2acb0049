"""The pack's ComfyUI nodes (V3 schema): Sparse Attention, Sparse Attention (Preset), Sparse Attention Report.

Node ids are permanent string literals (workflows and ComfyUI Manager refer to them).
"""

from __future__ import annotations

import logging

from comfy_api.latest import io

from ..engine.presets import list_presets, load_preset, preset_fingerprint
from ..engine.widgets import WIDGETS, config_from_widgets
from .families import family_of
from .patch import find_patch, install
from .report import render_report

log = logging.getLogger(__name__)
CATEGORY = "model_patches/sparse_attention"
AUTO_PRESET = "auto (detect the model)"


def widget_input(w):
    """A ComfyUI input for an engine widget declaration (engine/widgets.py)."""
    common = dict(default=w.default_value(), tooltip=w.tooltip, optional=w.optional)
    if w.kind == "combo":
        return io.Combo.Input(w.name, options=w.option_values(), **common)
    if w.kind == "float":
        return io.Float.Input(w.name, min=w.minimum, max=w.maximum, step=w.step, **common)
    if w.kind == "int":
        return io.Int.Input(w.name, min=int(w.minimum), max=int(w.maximum), **common)
    if w.kind == "bool":
        return io.Boolean.Input(w.name, **common)
    return io.String.Input(w.name, **common)


class SparseAttention(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SparseAttn_Patch",
            display_name="Sparse Attention",
            category=CATEGORY,
            description=("Runs the model's long self-attention sparsely (Triton kernels on NVIDIA, PyTorch elsewhere). "
                         "Place it between the model loader and the sampler."),
            inputs=[io.Model.Input("model", tooltip="The diffusion model to patch (Wan, HunyuanVideo, Flux, "
                                                    "Qwen-Image, LTX-Video, SD3.5, Hunyuan3D, ...).")]
                   + [widget_input(w) for w in WIDGETS],
            outputs=[io.Model.Output(tooltip="The model with sparse attention; connect it to the sampler.")],
        )

    @classmethod
    def validate_inputs(cls, warmup_steps=None, dense_layers=None, anchor_steps=None, layer_densities=None,
                        anchor_density_factors=None):
        # ComfyUI checks the numbers' ranges and the lists itself for every input not named here, and reports a
        # failure of this check on each input it names: so it names the free-text inputs only (a linked one is
        # not given and is checked when the node runs)
        texts = dict(warmup_steps=warmup_steps, dense_layers=dense_layers, anchor_steps=anchor_steps,
                     layer_densities=layer_densities, anchor_density_factors=anchor_density_factors)
        try:
            config_from_widgets({k: v for k, v in texts.items() if v is not None})
        except ValueError as exc:
            return str(exc)
        return True

    @classmethod
    def execute(cls, model, *widget_values, **values) -> io.NodeOutput:
        values.update(zip((w.name for w in WIDGETS), widget_values))  # positional: in declaration order
        patched, _ = install(model, config_from_widgets(values))
        return io.NodeOutput(patched)


class SparseAttentionPreset(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        names = list_presets()
        return io.Schema(
            node_id="SparseAttn_Preset",
            display_name="Sparse Attention (Preset)",
            category=CATEGORY,
            description="Sparse attention with the settings of a preset for your model family (presets/*.yaml).",
            inputs=[
                io.Model.Input("model", tooltip="The diffusion model to patch."),
                io.Combo.Input("preset", options=names + [AUTO_PRESET],
                               default="balanced" if "balanced" in names else names[0],
                               tooltip="Settings for a model family (source of each value in the YAML file). "
                                       f"'{AUTO_PRESET}' picks the preset of the connected model's family "
                                       "(for Wan 14B and MiniMax H3 their 4- or 8-step preset on runs of up to 5 "
                                       "or 12 steps)."),
                io.Float.Input("density_override", default=0.0, min=0.0, max=1.0, step=0.01,
                               tooltip="0 keeps the preset's density; otherwise the fraction of keys kept."),
            ],
            outputs=[io.Model.Output(tooltip="The model with sparse attention; connect it to the sampler.")],
        )

    @classmethod
    def validate_inputs(cls, preset="balanced"):
        # ComfyUI leaves the inputs named here to this check (no list check of its own) and checks the others itself
        # (density_override's range): a failure here is reported on `preset` alone
        if preset == AUTO_PRESET:
            return True
        try:
            load_preset(preset)
        except ValueError as exc:
            return str(exc)
        return True

    @classmethod
    def fingerprint_inputs(cls, preset="balanced", **_):
        """What makes ComfyUI run the node again although its inputs did not change: the preset file edited on
        disk (its contents; every preset's for `auto`). Without it an edit is ignored until the server restarts."""
        return preset_fingerprint(None if preset == AUTO_PRESET else preset)

    @classmethod
    def execute(cls, model, preset, density_override) -> io.NodeOutput:
        overrides, by_steps = _density_override(density_override), ()
        if preset == AUTO_PRESET:
            dm = model.get_model_object("diffusion_model")
            family = family_of(dm)
            preset = family.preset_for(dm)
            # a distilled 4- or 8-step run takes the family's few-step preset, chosen when the run's length is known
            by_steps = tuple((most, load_preset(name, overrides), name) for most, name in family.presets_by_steps(dm))
            log.info("sparse attention: preset %s for this %s model%s", preset, family.name,
                     "".join(f"; {name} for runs of up to {most} steps" for most, _, name in by_steps))
        cfg = load_preset(preset, overrides)
        patched, _ = install(model, cfg, by_steps)
        return io.NodeOutput(patched)


def _density_override(value) -> dict | None:
    """The preset overrides of the Preset node's ``density_override`` (0: none); ValueError outside [0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"density_override: must be 0 (the preset's density) or a fraction in (0, 1], got "
                         f"{str(value)[:60]}")
    return {"density": float(value)} if value > 0 else None


class SparseAttentionReport(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SparseAttn_Report",
            display_name="Sparse Attention Report",
            category=CATEGORY,
            description="After sampling: the run's sparse-attention statistics as text, and a picture of one "
                        "layer's selection with the density of every layer.",
            inputs=[
                io.Model.Input("model", tooltip="The model output of a Sparse Attention node (the patched model)."),
                io.Latent.Input("samples", tooltip="The sampler's output: the report shows the run that produced "
                                                   "it (and runs after sampling)."),
                io.Int.Input("layer", default=-1, min=-1, max=10_000,
                             tooltip="Layer whose selection is drawn; -1 picks the first sparse layer."),
            ],
            outputs=[io.String.Output(display_name="report", tooltip="Statistics of the last sampling run."),
                     io.Image.Output(display_name="selection", tooltip="Left: the layer's selection map (block "
                                     "map, or selected tokens per query group). Right: density per layer.")],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, model, samples, layer) -> io.NodeOutput:
        patch = find_patch(model)
        latent = samples.get("samples") if isinstance(samples, dict) else None
        text, image = render_report(patch, layer, latent)
        return io.NodeOutput(text, image, ui={"text": [text]})  # shown on the node itself, as the Compare node does


NODES = [SparseAttention, SparseAttentionPreset, SparseAttentionReport]
