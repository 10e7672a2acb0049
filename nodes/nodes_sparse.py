"""The pack's ComfyUI nodes (V3 schema): Sparse Attention, Sparse Attention (Preset), Sparse Attention Report.

Node ids are permanent string literals (workflows and ComfyUI Manager refer to them).
"""

from __future__ import annotations

import logging

from comfy_api.latest import io

from ..engine import SparseConfig
from ..engine.presets import list_presets, load_preset
from .patch import find_patch, install
from .report import render_report

log = logging.getLogger(__name__)
CATEGORY = "model_patches/sparse_attention"
METHODS = ["mc_sparse", "block_topk", "hybrid", "static", "dense"]


def _config_from_widgets(method, density, block_size, query_group_size, warmup_steps, warmup_layers, dense_layers,
                         anchor_steps, residual_caching, cache_offload, min_tokens, backend) -> SparseConfig:
    return SparseConfig.from_dict(dict(
        method=method, density=density, block_q=int(block_size), block_k=int(block_size),
        group_size=int(query_group_size), warmup_steps=warmup_steps, warmup_layers=warmup_layers,
        dense_layers=dense_layers, anchor_steps=anchor_steps, residual=residual_caching, offload=cache_offload,
        min_tokens=min_tokens, backend=backend), source="Sparse Attention")


class SparseAttention(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SparseAttn_Patch",
            display_name="Sparse Attention",
            category=CATEGORY,
            description=("Runs the model's long self-attention sparsely (Triton kernels on NVIDIA, PyTorch elsewhere). "
                         "Place it between the model loader and the sampler."),
            inputs=[
                io.Model.Input("model", tooltip="The diffusion model to patch (Wan, HunyuanVideo, Flux, Qwen-Image, "
                                                "LTX-Video, SD3.5, Hunyuan3D, ...)."),
                io.Combo.Input("method", options=METHODS, default="mc_sparse",
                               tooltip="mc_sparse: token-level selection for groups of similar queries, exact at "
                                       "anchor steps (best quality). block_topk: pooled block scores. hybrid: local "
                                       "windows + top-k blocks. static: fixed local windows. dense: no sparsity."),
                io.Float.Input("density", default=0.15, min=0.01, max=1.0, step=0.01,
                               tooltip="Fraction of image/video keys each query attends (text stays dense). "
                                       "Lower is faster; 0.1-0.25 is typical."),
                io.Combo.Input("block_size", options=["128", "64"], default="128",
                               tooltip="Block size of the block methods (query and key blocks)."),
                io.Combo.Input("query_group_size", options=["128", "64"], default="128",
                               tooltip="Queries per group for mc_sparse (the kernel's tile). 128 is faster."),
                io.Int.Input("warmup_steps", default=10, min=0, max=1000,
                             tooltip="Dense denoising steps at the start of each run (they fix the layout)."),
                io.Int.Input("warmup_layers", default=1, min=0, max=1000,
                             tooltip="The first N transformer blocks always run dense."),
                io.String.Input("dense_layers", default="",
                                tooltip="Further blocks to keep dense, e.g. '0,1,38-39'."),
                io.String.Input("anchor_steps", default="10,26",
                                tooltip="Steps that recompute the selection (and residual), e.g. '10,26' or "
                                        "'every 5'. The first sparse step is always an anchor."),
                io.Boolean.Input("residual_caching", default=True,
                                 tooltip="Cache dense-minus-sparse at anchors and add it back at the other steps "
                                         "(better quality, one output-sized tensor per layer of memory)."),
                io.Boolean.Input("cache_offload", default=True,
                                 tooltip="Keep caches that do not fit the GPU budget in CPU memory (prefetched "
                                         "before use) instead of dropping them."),
                io.Int.Input("min_tokens", default=8192, min=0, max=10_000_000,
                             tooltip="Attention over fewer tokens stays dense (sparsity does not pay there)."),
                io.Combo.Input("backend", options=["auto", "triton", "torch"], default="auto",
                               tooltip="auto: Triton kernels on NVIDIA GPUs, PyTorch elsewhere."),
            ],
            outputs=[io.Model.Output(tooltip="The model with sparse attention; connect it to the sampler.")],
        )

    @classmethod
    def validate_inputs(cls, method="mc_sparse", density=0.15, block_size="128", query_group_size="128",
                        warmup_steps=0, warmup_layers=0, dense_layers="", anchor_steps="", residual_caching=True,
                        cache_offload=True, min_tokens=0, backend="auto", **_):
        try:
            _config_from_widgets(method, density, block_size, query_group_size, warmup_steps, warmup_layers,
                                 dense_layers, anchor_steps, residual_caching, cache_offload, min_tokens, backend)
        except ValueError as exc:
            return str(exc)
        return True

    @classmethod
    def execute(cls, model, method, density, block_size, query_group_size, warmup_steps, warmup_layers, dense_layers,
                anchor_steps, residual_caching, cache_offload, min_tokens, backend) -> io.NodeOutput:
        cfg = _config_from_widgets(method, density, block_size, query_group_size, warmup_steps, warmup_layers,
                                   dense_layers, anchor_steps, residual_caching, cache_offload, min_tokens, backend)
        patched, _ = install(model, cfg)
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
                io.Combo.Input("preset", options=names, default="balanced" if "balanced" in names else names[0],
                               tooltip="Settings for a model family (source of each value in the YAML file)."),
                io.Float.Input("density_override", default=0.0, min=0.0, max=1.0, step=0.01,
                               tooltip="0 keeps the preset's density; otherwise the fraction of keys kept."),
            ],
            outputs=[io.Model.Output(tooltip="The model with sparse attention; connect it to the sampler.")],
        )

    @classmethod
    def validate_inputs(cls, preset="balanced", density_override=0.0, **_):
        try:
            load_preset(preset, {"density": density_override} if density_override > 0 else None)
        except ValueError as exc:
            return str(exc)
        return True

    @classmethod
    def execute(cls, model, preset, density_override) -> io.NodeOutput:
        cfg = load_preset(preset, {"density": density_override} if density_override > 0 else None)
        patched, _ = install(model, cfg)
        return io.NodeOutput(patched)


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
                io.Latent.Input("samples", tooltip="The sampler's output: connecting it makes the report run "
                                                   "after sampling."),
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
        text, image = render_report(patch, layer)
        return io.NodeOutput(text, image)


NODES = [SparseAttention, SparseAttentionPreset, SparseAttentionReport]
