"""Helpers that run inside a ComfyUI child process (see comfy_subprocess.py): tiny random-weight models
built through ComfyUI's own classes, and a real sampling run with comfy.sample.sample."""

from __future__ import annotations

import sys

import torch

def load_pack():
    """The pack, imported by conftest as ``comfyui_sparse_attention``."""
    import conftest
    return sys.modules[conftest.PACKAGE]


def _finish(model_config, seed):
    import comfy.model_patcher

    model_config.set_inference_dtype(torch.float32, None)
    model = model_config.get_model({}, "", torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.diffusion_model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        for name, buf in model.diffusion_model.named_buffers():
            if name.endswith("pos_embed") and buf.is_floating_point():  # SD3: torch.empty until weights load
                buf.copy_(torch.randn(buf.shape, generator=g) * 0.05)
    model.diffusion_model.to(torch.float32)
    return comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))


def _fill_missing(params: dict, params_class) -> None:
    """Neutral values for fields a ComfyUI version adds to a model's params dataclass (off / empty)."""
    import dataclasses
    for f in dataclasses.fields(params_class):
        if f.name not in params and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
            params[f.name] = False if kind == "bool" else [] if kind == "list" else None


def build(family: str, seed: int = 0):
    """(ModelPatcher, latent, positive, negative) for a tiny model of ``family``."""
    import comfy.supported_models as sm

    if family == "wan":
        cfg = sm.WAN21_T2V({"image_model": "wan2.1", "model_type": "t2v", "dim": 128, "ffn_dim": 256, "freq_dim": 64,
                            "text_dim": 64, "in_dim": 16, "out_dim": 16, "num_heads": 2, "num_layers": 2,
                            "patch_size": (1, 2, 2), "text_len": 12})
        latent = torch.randn(1, 16, 3, 16, 16, generator=torch.Generator().manual_seed(seed + 1))
        ctx = lambda s: torch.randn(1, 12, 64, generator=torch.Generator().manual_seed(s))  # noqa: E731
        return _finish(cfg, seed), latent, [[ctx(seed + 2), {}]], [[ctx(seed + 3), {}]]
    if family == "flux":
        params = {"image_model": "flux", "in_channels": 16, "out_channels": 16, "vec_in_dim": 32, "context_in_dim": 48,
                  "hidden_size": 128, "mlp_ratio": 2.0, "num_heads": 2, "depth": 2, "depth_single_blocks": 2,
                  "axes_dim": [16, 24, 24], "theta": 10000, "qkv_bias": True, "guidance_embed": False,
                  "patch_size": 2}
        import comfy.ldm.flux.model as flux_model
        _fill_missing(params, flux_model.FluxParams)  # e.g. txt_ids_dims on newer ComfyUI
        cfg = sm.Flux(params)
        latent = torch.randn(1, 16, 32, 32, generator=torch.Generator().manual_seed(seed + 1))

        def cond(s):
            g = torch.Generator().manual_seed(s)
            return [[torch.randn(1, 7, 48, generator=g), {"pooled_output": torch.randn(1, 32, generator=g)}]]
        return _finish(cfg, seed), latent, cond(seed + 2), cond(seed + 3)
    def cond(s, length=7, dim=48, pooled=None):
        g = torch.Generator().manual_seed(s)
        extra = {"pooled_output": torch.randn(1, pooled, generator=g)} if pooled else {}
        return [[torch.randn(1, length, dim, generator=g), extra]]
    lat_gen = torch.Generator().manual_seed(seed + 1)
    if family == "sd3":
        cfg = sm.SD3({"in_channels": 16, "pos_embed_scaling_factor": None, "depth": 2, "patch_size": 2,
                      "out_channels": 16, "adm_in_channels": 32, "pos_embed_max_size": 32, "num_patches": 1024,
                      "context_embedder_config": {"target": "torch.nn.Linear",
                                                  "params": {"in_features": 48, "out_features": 128}}})
        return (_finish(cfg, seed), torch.randn(1, 16, 32, 32, generator=lat_gen), cond(seed + 2, pooled=32),
                cond(seed + 3, pooled=32))
    if family == "qwen_image":
        cfg = sm.QwenImage({"image_model": "qwen_image", "patch_size": 2, "in_channels": 64, "out_channels": 16,
                            "num_layers": 2, "attention_head_dim": 64, "num_attention_heads": 2,
                            "joint_attention_dim": 48, "axes_dims_rope": (16, 24, 24)})
        return _finish(cfg, seed), torch.randn(1, 16, 1, 32, 32, generator=lat_gen), cond(seed + 2), cond(seed + 3)
    if family == "hunyuan_video":
        import comfy.ldm.hunyuan_video.model as hv
        params = {"image_model": "hunyuan_video", "in_channels": 16, "out_channels": 16, "vec_in_dim": 32,
                  "context_in_dim": 48, "hidden_size": 128, "mlp_ratio": 2.0, "num_heads": 2, "depth": 1,
                  "depth_single_blocks": 1, "axes_dim": [16, 24, 24], "theta": 256, "patch_size": [1, 2, 2],
                  "qkv_bias": True, "guidance_embed": False}
        _fill_missing(params, hv.HunyuanVideoParams)
        cfg = sm.HunyuanVideo(params)
        return (_finish(cfg, seed), torch.randn(1, 16, 3, 16, 16, generator=lat_gen), cond(seed + 2, pooled=32),
                cond(seed + 3, pooled=32))
    if family == "hunyuan3d":
        cfg = sm.Hunyuan3Dv2({"image_model": "hunyuan3d2", "in_channels": 64, "context_in_dim": 48,
                              "hidden_size": 128, "num_heads": 2, "depth": 1, "depth_single_blocks": 2})
        return _finish(cfg, seed), torch.randn(1, 64, 512, generator=lat_gen), cond(seed + 2), cond(seed + 3)
    if family == "ltxv":  # one token per latent voxel; text via cross-attention with an integer mask
        cfg = sm.LTXV({"image_model": "ltxv", "in_channels": 128, "cross_attention_dim": 128, "attention_head_dim": 64,
                       "num_attention_heads": 2, "caption_channels": 48, "num_layers": 2})

        def ltx_cond(s):
            g = torch.Generator().manual_seed(s)
            return [[torch.randn(1, 7, 48, generator=g), {"attention_mask": torch.ones(1, 7, dtype=torch.long)}]]
        return (_finish(cfg, seed), torch.randn(1, 128, 3, 8, 8, generator=lat_gen), ltx_cond(seed + 2),
                ltx_cond(seed + 3))
    if family == "hunyuan3d_2_1":  # its attention calls bypass the override hook
        cfg = sm.Hunyuan3Dv2_1({"image_model": "hunyuan3d2_1", "in_channels": 64, "hidden_size": 128,
                                "context_dim": 48, "depth": 2, "num_heads": 2, "num_moe_layers": 1, "num_experts": 2,
                                "moe_top_k": 1, "guidance_cond_proj_dim": None})
        return _finish(cfg, seed), torch.randn(1, 64, 512, generator=lat_gen), cond(seed + 2), cond(seed + 3)
    raise ValueError(family)


def sample(model, latent, positive, negative, steps=3, cfg=3.0, sampler="euler", seed=0):
    import comfy.sample

    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(seed))
    return comfy.sample.sample(model, noise, steps, cfg, sampler, "simple", positive, negative, latent,
                               denoise=1.0, disable_pbar=True, seed=seed)


def recording_override(log: list):
    """An override that records every call and runs the dense function (stands for SageAttention & co)."""
    def override(func, *args, **kwargs):
        log.append(tuple(args[0].shape))
        return func(*args, **kwargs)
    return override


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def log_layer0_decisions(record) -> list:
    """Record ``record(ctx, decision)`` for every engine decision on layer 0 (the engine is patched for the child's
    lifetime); returns the list the records go to."""
    from comfyui_sparse_attention.engine import engine as E

    calls, decide = [], E.SparseEngine.decide

    def logged(self, ctx, n):
        d = decide(self, ctx, n)
        if ctx.layer == 0:
            calls.append(record(ctx, d))
        return d
    E.SparseEngine.decide = logged
    return calls
