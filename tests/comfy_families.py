"""Tiny random-weight models of the model families that ComfyUI 0.33.0 adds or changes (runs inside a ComfyUI
child, see comfy_subprocess.py), and a recording attention override that captures every call the override
hook sees. docs/families.md documents the token layout of each family's self-attention; the builders here
are the configurations it names.

Each builder returns ``(ModelPatcher, latent, positive, negative)`` ready for ``comfy.sample.sample``;
``latent`` is a tensor, or a NestedTensor for the audio-video families. Random weights (N(0, 0.05)), fp32,
CPU, a forward in well under a second.
"""

from __future__ import annotations

import dataclasses
import importlib

import torch
from comfy_child import _fill_missing, _finish

# family -> (module, attribute) that the ComfyUI tree must have for the builder to apply
REQUIRES: dict[str, tuple[str, str]] = {}
BUILDERS = {}


def family(name: str, module: str, attr: str):
    def register(fn):
        REQUIRES[name] = (module, attr)
        BUILDERS[name] = fn
        return fn
    return register


def missing(name: str) -> str | None:
    """Why this ComfyUI tree cannot build ``name`` (None when it can)."""
    module, attr = REQUIRES[name]
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        return f"{module} does not import ({exc})"
    return None if hasattr(mod, attr) else f"{module}.{attr} does not exist in this ComfyUI"


def build(name: str, seed: int = 0):
    """(ModelPatcher, latent, positive, negative) of the tiny ``name`` model."""
    return BUILDERS[name](seed)


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _cond(seed, length, dim, **extra):
    g = _g(seed)
    out = {}
    for key, value in extra.items():
        out[key] = torch.randn(value, generator=g) if isinstance(value, tuple) else value
    return [[torch.randn(1, length, dim, generator=g), out]]


def _pair(seed, length, dim, **extra):
    return _cond(seed + 2, length, dim, **extra), _cond(seed + 3, length, dim, **extra)


# --- the recording override ------------------------------------------------------------------------------

def recording_override(log: list):
    """An override that records each call (layout, shapes, mask, transformer_options facts) and runs the
    dense ``func``. Entries are JSON-ready dicts; see ``describe``."""
    def override(func, *args, **kwargs):
        log.append(describe(args, kwargs))
        return func(*args, **kwargs)
    return override


def describe(args, kwargs) -> dict:
    q, k = args[0], args[1]
    heads = args[3] if len(args) > 3 else kwargs.get("heads")
    mask = args[4] if len(args) > 4 else kwargs.get("mask")
    to = kwargs.get("transformer_options") or {}
    skip = bool(kwargs.get("skip_reshape", False))
    tok = 2 if skip else 1
    entry = {
        "q": list(q.shape), "k": list(k.shape), "heads": heads, "skip_reshape": skip,
        "skip_output_reshape": bool(kwargs.get("skip_output_reshape", False)),
        "nq": int(q.shape[tok]), "nk": int(k.shape[tok]),
        "mask": None if mask is None else list(mask.shape),
        "mask_dtype": None if mask is None else str(mask.dtype),
        "mask_positional": len(args) > 4,
        "kwargs": sorted(k for k in kwargs if k not in ("transformer_options", "_inside_attn_wrapper")),
        "to_keys": sorted(str(k) for k in to),
        "block_index": to.get("block_index"), "block_type": to.get("block_type"),
        "total_blocks": to.get("total_blocks"),
        "cond_or_uncond": list(to.get("cond_or_uncond", []) or []),
    }
    for key in ("grid_sizes", "img_slice", "reference_image_num_tokens"):
        if key in to:
            value = to[key]
            entry[key] = [int(v) for v in value] if isinstance(value, (list, tuple, torch.Size)) else value
    return entry


def forward_recorder(log: list):
    """APPLY_MODEL wrapper that marks the start of each model forward in ``log`` with the latent's shape."""
    def wrapper(executor, x, t, *args, **kwargs):
        shape = [list(s.shape) for s in x.unbind()] if getattr(x, "is_nested", False) else list(x.shape)
        shapes = kwargs.get("latent_shapes")  # packed audio-video latents: one (B, 1, N) tensor plus the shapes
        log.append({"forward": shape, "latent_shapes": [list(s) for s in shapes] if shapes else None})
        return executor(x, t, *args, **kwargs)
    return wrapper


def sample(model, latent, positive, negative, steps=2, cfg=3.0, seed=0):
    """comfy.sample.sample with euler/simple; ``latent`` a tensor or a NestedTensor (audio-video)."""
    import comfy.sample

    noise = comfy.sample.prepare_noise(latent, seed)
    return comfy.sample.sample(model, noise, steps, cfg, "euler", "simple", positive, negative, latent,
                               denoise=1.0, disable_pbar=True, seed=seed)


def record(model, latent, positive, negative, steps=2, cfg=3.0):
    """Sample with a recording override and forward markers; returns (output, log)."""
    import comfy.patcher_extension as pe

    log: list = []
    m = model.clone()
    m.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = recording_override(log)
    m.add_wrapper_with_key(pe.WrappersMP.APPLY_MODEL, "families_test", forward_recorder(log))
    out = sample(m, latent, positive, negative, steps=steps, cfg=cfg)
    return out, log


def forwards(log: list) -> list[dict]:
    """The log split per forward: [{"x": latent shape, "calls": [entries]}]."""
    out = []
    for e in log:
        if "forward" in e:
            out.append({"x": e["forward"], "latent_shapes": e.get("latent_shapes"), "calls": []})
        elif out:
            out[-1]["calls"].append(e)
    return out


# --- builders --------------------------------------------------------------------------------------------
# Latent shapes are small on purpose: every grid side > 1 so that row-major token order is observable.

def _chroma_params(module, **over):
    """Chroma's tiny configuration (Chroma Radiance adds its fields), the dataclass's other fields neutral."""
    params = {"image_model": "chroma", "in_channels": 64, "out_channels": 64, "context_in_dim": 48, "hidden_size": 64,
              "mlp_ratio": 2.0, "num_heads": 2, "depth": 2, "depth_single_blocks": 2, "axes_dim": [8, 12, 12],
              "theta": 10000, "patch_size": 2, "qkv_bias": True, "in_dim": 64, "out_dim": 64, "hidden_dim": 64,
              "n_layers": 1, "txt_ids_dims": [], "vec_in_dim": None}
    params.update(over)
    _fill_missing(params, module)
    return params


@family("chroma", "comfy.supported_models", "Chroma")
def _chroma(seed):
    import comfy.ldm.chroma.model as chroma
    import comfy.supported_models as sm
    pos, neg = _pair(seed, 7, 48)
    return (_finish(sm.Chroma(_chroma_params(chroma.ChromaParams)), seed),
            torch.randn(1, 16, 12, 16, generator=_g(seed + 1)), pos, neg)


@family("chroma_radiance", "comfy.supported_models", "ChromaRadiance")
def _chroma_radiance(seed):
    """Chroma Radiance: Chroma's blocks on 16x16 pixel patches (no VAE), a NeRF head per patch."""
    import comfy.ldm.chroma_radiance.model as radiance
    import comfy.supported_models as sm
    params = _chroma_params(radiance.ChromaRadianceParams, image_model="chroma_radiance", in_channels=3,
                            out_channels=3, patch_size=16, nerf_hidden_size=16, nerf_mlp_ratio=2, nerf_depth=1,
                            nerf_max_freqs=4, nerf_tile_size=0, nerf_final_head_type="linear",
                            nerf_embedder_dtype=None, use_x0=False, use_sequential_txt_ids=False)
    pos, neg = _pair(seed, 7, 48)
    return _finish(sm.ChromaRadiance(params), seed), torch.randn(1, 3, 96, 128, generator=_g(seed + 1)), pos, neg


@family("mochi", "comfy.supported_models", "GenmoMochi")
def _mochi(seed):
    """Mochi: video tokens (1x2x2 patches) then the valid text tokens in one joint self-attention per block."""
    import comfy.supported_models as sm
    config = {"image_model": "mochi_preview", "patch_size": 2, "in_channels": 12, "hidden_size_x": 64,
              "hidden_size_y": 32, "depth": 2, "num_heads": 2, "mlp_ratio_x": 192.0, "mlp_ratio_y": 2.0, "use_t5": True,
              "t5_feat_dim": 48, "t5_token_length": 7, "learn_sigma": False, "qk_norm": True, "qkv_bias": False,
              "out_bias": True, "attn_drop": 0.0, "patch_embed_bias": True, "posenc_preserve_area": True,
              "timestep_mlp_bias": True, "attend_to_padding": False, "timestep_scale": 1000.0, "rope_theta": 10000.0}
    # the fields model_detection sets for Mochi Preview, at toy sizes (its blocks assert an MLP of 12 288)
    pos, neg = _pair(seed, 7, 48, attention_mask=torch.ones(1, 7, dtype=torch.long))  # T5 mask: 7 valid
    return _finish(sm.GenmoMochi(config), seed), torch.randn(1, 12, 3, 12, 16, generator=_g(seed + 1)), pos, neg


@family("auraflow", "comfy.supported_models", "AuraFlow")
def _auraflow(seed):
    """AuraFlow: [8 register tokens | text] then the image (2x2 patches); 2 double (MMDiT) + 2 single layers."""
    import comfy.supported_models as sm
    # model_detection sets max_seq, cond_seq_dim, n_double_layers, n_layers; the rest are MMDiT's defaults
    cfg = sm.AuraFlow({"in_channels": 4, "out_channels": 4, "patch_size": 2, "dim": 64, "n_layers": 4,
                       "n_double_layers": 2, "n_heads": 2, "global_conddim": 64, "cond_seq_dim": 48, "max_seq": 64})
    pos, neg = _pair(seed, 7, 48)
    return _finish(cfg, seed), torch.randn(1, 4, 12, 16, generator=_g(seed + 1)), pos, neg


@family("ideogram4", "comfy.supported_models", "Ideogram4")
def _ideogram4(seed, valid=7):
    """Ideogram 4: [text | image], one token per latent cell (the 128 channels are 2x2 x 32 packed)."""
    import comfy.supported_models as sm
    cfg = sm.Ideogram4({"image_model": "ideogram4", "in_channels": 128, "num_layers": 2})
    # unet_extra_config pins the released widths: overwrite them after construction
    cfg.unet_config.update({"num_attention_heads": 2, "attention_head_dim": 32, "intermediate_size": 128,
                            "adaln_dim": 32, "llm_features_dim": 48, "rope_theta": 10000, "mrope_section": [6, 5, 5]})
    mask = torch.zeros(1, 7, dtype=torch.long)
    mask[:, :valid] = 1  # all ones: model_base drops it (no mask reaches attention)
    pos, neg = _pair(seed, 7, 48, attention_mask=mask)
    return _finish(cfg, seed), torch.randn(1, 128, 6, 8, generator=_g(seed + 1)), pos, neg


@family("mage_flow", "comfy.supported_models", "MageFlow")
def _mage_flow(seed, refs=True):
    """Mage Flow: Qwen-Image blocks, [text | image | refs], one token per latent cell (patch 1)."""
    import comfy.supported_models as sm
    cfg = sm.MageFlow({"image_model": "mage_flow", "in_channels": 128, "out_channels": 128, "num_layers": 2,
                       "attention_head_dim": 32, "num_attention_heads": 2, "joint_attention_dim": 48,
                       "axes_dims_rope": [8, 12, 12]})
    extra = {"reference_latents": [torch.randn(1, 128, 4, 4, generator=_g(seed + 5))]} if refs else {}
    pos, neg = _pair(seed, 7, 48, **extra)
    return _finish(cfg, seed), torch.randn(1, 128, 6, 8, generator=_g(seed + 1)), pos, neg


@family("joyimage", "comfy.supported_models", "JoyImage")
def _joyimage(seed, refs=False):
    """JoyImage: [target image | reference images | text] per block (Wan 2.1 latent, 1x2x2 patches)."""
    import comfy.supported_models as sm
    cfg = sm.JoyImage({"image_model": "joyimage", "in_channels": 16, "hidden_size": 64, "patch_size": [1, 2, 2],
                       "num_layers": 2, "num_attention_heads": 2, "text_dim": 48})
    cfg.unet_config["rope_dim_list"] = [8, 12, 12]  # unet_extra_config pins [16, 56, 56] (head dim 128)
    extra = {"reference_latents": [torch.randn(1, 16, 1, 8, 8, generator=_g(seed + 5))]} if refs else {}
    pos, neg = _pair(seed, 7, 48, **extra)
    return _finish(cfg, seed), torch.randn(1, 16, 1, 12, 16, generator=_g(seed + 1)), pos, neg


def _pixeldit_params(**over):
    params = {"image_model": "pixeldit_t2i", "in_channels": 3, "num_groups": 2, "hidden_size": 64,
              "pixel_hidden_size": 8, "pixel_attn_hidden_size": 48, "pixel_num_groups": 2, "patch_depth": 2,
              "pixel_depth": 2, "patch_size": 16, "txt_embed_dim": 48, "txt_max_length": 300}
    params.update(over)
    return params


@family("pixeldit", "comfy.supported_models", "PixelDiTT2I")
def _pixeldit(seed):
    """PixelDiT T2I (pixel space): patch blocks over [text | 16x16 patches], then pixel blocks whose
    self-attention runs over the patches alone (another head width)."""
    import comfy.supported_models as sm
    pos, neg = _pair(seed, 7, 48)
    return (_finish(sm.PixelDiTT2I(_pixeldit_params()), seed), torch.randn(1, 3, 96, 128, generator=_g(seed + 1)),
            pos, neg)


@family("pid", "comfy.supported_models", "PiD")
def _pid(seed):
    """PiD: PixelDiT plus a low-quality latent branch (lq_latent: a Flux latent, 4x upscale)."""
    import comfy.supported_models as sm
    params = _pixeldit_params(image_model="pid", lq_latent_channels=16, lq_hidden_dim=16, lq_num_res_blocks=1,
                              lq_interval=2, latent_spatial_down_factor=8)
    lq = torch.randn(1, 16, 3, 4, generator=_g(seed + 5))  # 96x128 pixels / (4 x 8)
    pos, neg = _pair(seed, 7, 48, lq_latent=lq, degrade_sigma=torch.tensor([0.0]))
    return _finish(sm.PiD(params), seed), torch.randn(1, 3, 96, 128, generator=_g(seed + 1)), pos, neg


def _omnigen2_config(cls, **over):
    params = {"image_model": "omnigen2", "patch_size": 2, "in_channels": 16, "hidden_size": 64, "num_layers": 2,
              "num_refiner_layers": 1, "num_attention_heads": 2, "num_kv_heads": 2, "multiple_of": 16,
              "ffn_dim_multiplier": None, "norm_eps": 1e-5, "axes_dim_rope": [8, 12, 12], "axes_lens": [300, 512, 512],
              "text_feat_dim": 48, "timestep_scale": 1000.0}
    params.update(over)
    return cls(params)


def _omnigen2_cond(seed, refs=None):
    # num_tokens comes from the text attention mask (model_base.Omnigen2.extra_conds); all ones -> no mask passed on
    extra = {"attention_mask": torch.ones(1, 7, dtype=torch.long)}
    if refs is not None:
        extra["reference_latents"] = refs
    return _pair(seed, 7, 48, **extra)


@family("omnigen2", "comfy.supported_models", "Omnigen2")
def _omnigen2(seed, kv_heads=2, refs=False):
    """OmniGen2: refiners (caption; image; reference images) then joint layers over [text | refs | image]."""
    import comfy.supported_models as sm
    refs = [torch.randn(1, 16, 8, 8, generator=_g(seed + 5))] if refs else None  # one reference: 4x4 tokens
    pos, neg = _omnigen2_cond(seed, refs)
    cfg = _omnigen2_config(sm.Omnigen2, num_kv_heads=kv_heads)
    return _finish(cfg, seed), torch.randn(1, 16, 12, 16, generator=_g(seed + 1)), pos, neg


@family("omnigen2_ref", "comfy.supported_models", "Omnigen2")
def _omnigen2_ref(seed):
    return _omnigen2(seed, refs=True)


@family("omnigen2_ref_same", "comfy.supported_models", "Omnigen2")
def _omnigen2_ref_same(seed):
    """An edit whose reference has the target's token count (transposed: 8x6 tokens against 6x8)."""
    import comfy.supported_models as sm
    pos, neg = _omnigen2_cond(seed, [torch.randn(1, 16, 16, 12, generator=_g(seed + 5))])
    return _finish(_omnigen2_config(sm.Omnigen2), seed), torch.randn(1, 16, 12, 16, generator=_g(seed + 1)), pos, neg


@family("omnigen2_gqa", "comfy.supported_models", "Omnigen2")
def _omnigen2_gqa(seed):
    """As released (21 query heads, 7 kv heads): k/v reach the override with fewer heads and enable_gqa=True."""
    return _omnigen2(seed, kv_heads=1)


@family("boogu", "comfy.supported_models", "Boogu")
def _boogu(seed, refs=False):
    """Boogu: OmniGen2's refiners, then double-stream blocks (joint [text | refs | image] + image-only
    self-attention each), then single-stream blocks over [text | refs | image]."""
    import comfy.supported_models as sm
    cfg = sm.Boogu({"image_model": "boogu", "patch_size": 2, "in_channels": 16, "hidden_size": 64, "num_layers": 2,
                    "num_double_stream_layers": 2, "num_refiner_layers": 1, "num_attention_heads": 2,
                    "num_kv_heads": 2, "multiple_of": 16, "axes_dim_rope": [8, 12, 12],
                    "axes_lens": [300, 512, 512], "instruction_feat_dim": 48, "timestep_scale": 1000.0})
    refs = [torch.randn(1, 16, 8, 8, generator=_g(seed + 5))] if refs else None
    pos, neg = _omnigen2_cond(seed, refs)
    return _finish(cfg, seed), torch.randn(1, 16, 12, 16, generator=_g(seed + 1)), pos, neg


@family("boogu_ref", "comfy.supported_models", "Boogu")
def _boogu_ref(seed):
    return _boogu(seed, refs=True)


@family("lens", "comfy.supported_models", "Lens")
def _lens(seed, valid=None):
    """Lens: [image | text] per block, one token per latent cell (Flux 2 latent, 128 channels); an additive
    key mask (B, 1, 1, N) is always passed, built from the text mask (``valid`` tokens of 7; None: no mask)."""
    import comfy.supported_models as sm
    cfg = sm.Lens({"image_model": "lens", "in_channels": 128, "out_channels": 32, "num_layers": 2,
                   "attention_head_dim": 32, "num_attention_heads": 2, "enc_hidden_dim": 48,
                   "axes_dims_rope": [8, 12, 12], "multi_layer_encoder_feature": False, "selected_layer_index": [0]})
    extra = {}
    if valid is not None:
        extra["attention_mask"] = (torch.arange(7) < valid).long().unsqueeze(0)
    pos, neg = _pair(seed, 7, 48, **extra)
    return _finish(cfg, seed), torch.randn(1, 128, 6, 8, generator=_g(seed + 1)), pos, neg


@family("lens_padded", "comfy.supported_models", "Lens")
def _lens_padded(seed):
    """Lens with a padded text mask (5 of 7 tokens valid): its calls' key mask is real, they run dense."""
    return _lens(seed, valid=5)


def _lumina_params(**over):
    params = {"image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 64, "cap_feat_dim": 48,
              "n_layers": 2, "n_refiner_layers": 1, "n_heads": 4, "n_kv_heads": 2, "qk_norm": True,
              "axes_dims": [4, 6, 6], "axes_lens": [300, 512, 512], "rope_theta": 10000.0,
              "ffn_dim_multiplier": 1.0, "multiple_of": 16}
    params.update(over)
    return params


@family("lumina2", "comfy.supported_models", "Lumina2")
def _lumina2(seed):
    import comfy.supported_models as sm
    pos, neg = _pair(seed, 7, 48)
    return (_finish(sm.Lumina2(_lumina_params()), seed), torch.randn(1, 16, 12, 16, generator=_g(seed + 1)),
            pos, neg)


@family("z_image", "comfy.supported_models", "ZImage")
def _z_image(seed):
    import comfy.supported_models as sm
    # z_image_modulation sizes its adaLN input at min(dim, 256): dim 256 is the smallest consistent width
    params = _lumina_params(dim=256, n_heads=2, n_kv_heads=2, axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512],
                            rope_theta=256.0, ffn_dim_multiplier=8.0 / 3.0, z_image_modulation=True,
                            time_scale=1000.0, pad_tokens_multiple=32)
    pos, neg = _pair(seed, 7, 48)
    return (_finish(sm.ZImage(params), seed), torch.randn(1, 16, 12, 16, generator=_g(seed + 1)), pos, neg)


@family("hunyuan_video_1_5", "comfy.supported_models", "HunyuanVideo15")
def _hunyuan_video_15(seed):
    import comfy.ldm.hunyuan_video.model as hv
    import comfy.supported_models as sm
    params = {"image_model": "hunyuan_video", "in_channels": 65, "out_channels": 32, "patch_size": [1, 1, 1],
              "vec_in_dim": None, "axes_dim": [16, 24, 24], "meanflow": False, "context_in_dim": 48,
              "hidden_size": 128, "mlp_ratio": 2.0, "num_heads": 2, "depth": 1, "depth_single_blocks": 1,
              "theta": 256, "qkv_bias": True, "byt5": False, "guidance_embed": False,
              "use_cond_type_embedding": True, "vision_in_dim": 1152, "meanflow_sum": True}
    _fill_missing(params, hv.HunyuanVideoParams)
    # I2V-style conditioning: 5 vision tokens (SigLIP features, dim 1152); T2V ComfyUI passes pooled_output None
    vision = _Vision(torch.randn(1, 5, 1152, generator=_g(seed + 4)))
    pos, neg = _pair(seed, 7, 48, pooled_output=None, clip_vision_output=vision)
    return (_finish(sm.HunyuanVideo15(params), seed), torch.randn(1, 32, 3, 6, 8, generator=_g(seed + 1)), pos, neg)


@family("kandinsky5", "comfy.supported_models", "Kandinsky5")
def _kandinsky5(seed):
    import comfy.supported_models as sm
    params = {"image_model": "kandinsky5", "model_dim": 128, "axes_dims": (16, 24, 24), "time_dim": 64,
              "ff_dim": 256, "visual_embed_dim": 132, "num_text_blocks": 1, "num_visual_blocks": 2,
              "in_text_dim": 48, "in_text_dim2": 32}
    pos, neg = _pair(seed, 7, 48, pooled_output=(1, 32))
    return (_finish(sm.Kandinsky5(params), seed), torch.randn(1, 16, 3, 12, 16, generator=_g(seed + 1)), pos, neg)


@family("cogvideox", "comfy.supported_models", "CogVideoX_T2V")
def _cogvideox(seed):
    import comfy.supported_models as sm
    params = {"image_model": "cogvideox", "num_attention_heads": 2, "attention_head_dim": 64, "time_embed_dim": 64,
              "num_layers": 2, "in_channels": 16, "patch_size": 2, "text_embed_dim": 48,
              "use_learned_positional_embeddings": False, "use_rotary_positional_embeddings": True}
    pos, neg = _pair(seed, 7, 48)
    return (_finish(sm.CogVideoX_T2V(params), seed), torch.randn(1, 16, 3, 12, 16, generator=_g(seed + 1)),
            pos, neg)


@dataclasses.dataclass
class _Vision:
    """Stands for a CLIP-vision output (the fields the models read)."""
    last_hidden_state: torch.Tensor

    @property
    def penultimate_hidden_states(self):
        return self.last_hidden_state


@family("qwen_image_edit", "comfy.supported_models", "QwenImage")
def _qwen_image_edit(seed):
    import comfy.supported_models as sm
    cfg = sm.QwenImage({"image_model": "qwen_image", "patch_size": 2, "in_channels": 64, "out_channels": 16,
                        "num_layers": 2, "attention_head_dim": 64, "num_attention_heads": 2,
                        "joint_attention_dim": 48, "axes_dims_rope": (16, 24, 24)})
    # two reference images (the edit model's ReferenceLatent inputs): 8x8 and 4x12 latents
    refs = [torch.randn(1, 16, 1, 8, 8, generator=_g(seed + 5)), torch.randn(1, 16, 1, 4, 12, generator=_g(seed + 6))]
    pos, neg = _pair(seed, 7, 48, reference_latents=refs, reference_latents_method="index")
    return _finish(cfg, seed), torch.randn(1, 16, 1, 12, 16, generator=_g(seed + 1)), pos, neg


@family("hidream_e1", "comfy.supported_models", "HiDream")
def _hidream_e1(seed):
    import comfy.supported_models as sm
    cfg = sm.HiDream({"image_model": "hidream", "attention_head_dim": 32, "axes_dims_rope": [16, 8, 8],
                      "caption_channels": [40, 48], "max_resolution": [32, 32], "in_channels": 16, "out_channels": 16,
                      "llama_layers": [0, 1, 1, 1], "num_attention_heads": 2, "num_routed_experts": 2,
                      "num_activated_experts": 1, "num_layers": 2, "num_single_layers": 2, "patch_size": 2,
                      "text_emb_dim": 32})

    def cond(s):
        g = _g(s)
        # T5 tokens (1, 5, 40); llama3 hidden states of 2 layers (1, 2, 6, 48); pooled CLIP (1, 32); the E1 edit
        # image latent rides as concat_latent_image and is joined along the width
        return [[torch.randn(1, 5, 40, generator=g),
                 {"pooled_output": torch.randn(1, 32, generator=g),
                  "conditioning_llama3": torch.randn(1, 2, 6, 48, generator=g),
                  "concat_latent_image": torch.randn(1, 16, 12, 16, generator=_g(seed + 7))}]]
    return _finish(cfg, seed), torch.randn(1, 16, 12, 16, generator=_g(seed + 1)), cond(seed + 2), cond(seed + 3)


def _wan_params(**over):
    params = {"image_model": "wan2.1", "model_type": "t2v", "dim": 128, "ffn_dim": 256, "freq_dim": 64, "text_dim": 64,
              "in_dim": 16, "out_dim": 16, "num_heads": 2, "num_layers": 2, "patch_size": (1, 2, 2), "text_len": 12}
    params.update(over)
    return params


@family("wan22_ti2v_5b", "comfy.supported_models", "WAN22_T2V")
def _wan22_ti2v(seed):
    import comfy.supported_models as sm
    cfg = sm.WAN22_T2V(_wan_params(in_dim=48, out_dim=48))
    pos, neg = _pair(seed, 12, 64)
    return _finish(cfg, seed), torch.randn(1, 48, 3, 12, 16, generator=_g(seed + 1)), pos, neg


@family("wan_fun_ref", "comfy.supported_models", "WAN21_FunControl2V")
def _wan_fun_ref(seed):
    import comfy.supported_models as sm
    # Wan 2.1 Fun 1.1 control: 16 noise + 32 control channels, and a reference image through ref_conv
    cfg = sm.WAN21_FunControl2V(_wan_params(model_type="i2v", in_dim=48, in_dim_ref_conv=16))
    ref = torch.randn(1, 16, 1, 12, 16, generator=_g(seed + 5))
    pos, neg = _pair(seed, 12, 64, reference_latents=[ref])
    for c in (pos, neg):  # I2V cross-attention needs CLIP-vision tokens (257 x 1280 in the real model)
        c[0][1]["clip_vision_output"] = _Vision(torch.randn(1, 3, 1280, generator=_g(seed + 6)))
    return _finish(cfg, seed), torch.randn(1, 16, 3, 12, 16, generator=_g(seed + 1)), pos, neg


@family("ltx2_av", "comfy.supported_models", "LTXAV")
def _ltx2_av(seed, audio_frames=20):
    import comfy.nested_tensor
    import comfy.supported_models as sm
    cfg = sm.LTXAV({"image_model": "ltxav", "num_layers": 2, "attention_head_dim": 64, "num_attention_heads": 2,
                    "cross_attention_dim": 128, "audio_attention_head_dim": 32, "audio_num_attention_heads": 2,
                    "audio_cross_attention_dim": 64, "caption_channels": 64, "connector_attention_head_dim": 32,
                    "connector_num_attention_heads": 2, "connector_num_layers": 1,
                    "use_keyframes_abs_pos_embedding": False})

    def cond(s):
        g = _g(s)
        return [[torch.randn(1, 7, 64, generator=g), {}]]
    video = torch.randn(1, 128, 3, 6, 8, generator=_g(seed + 1))     # 144 video tokens (patch 1x1x1)
    audio = torch.randn(1, 8, audio_frames, 16, generator=_g(seed + 4))  # audio frames x (8 ch x 16 bins)
    latent = comfy.nested_tensor.NestedTensor([video, audio])
    return _finish(cfg, seed), latent, cond(seed + 2), cond(seed + 3)


@family("ltx2_av_equal", "comfy.supported_models", "LTXAV")
def _ltx2_av_equal(seed):
    """LTX-2 with as many audio frames as video tokens (144): audio<->video cross-attention is self-shaped."""
    return _ltx2_av(seed, audio_frames=3 * 6 * 8)


@family("minimax_h3", "comfy.supported_models", "MiniMaxH3")
def _minimax_h3(seed):
    import comfy.nested_tensor
    import comfy.supported_models as sm
    cfg = sm.MiniMaxH3({"image_model": "minimax_h3", "hidden_size": 128, "num_layers": 2, "token_refiner_num_layers": 1,
                        "num_attention_heads": 2, "attention_head_dim": 64, "ffn_hidden_size": 256,
                        "latents_dim": 24, "audio_latents_dim": 32, "text_dim": 48, "timestep_input_dim": 64,
                        "time_embed_hidden_size": 128, "time_embed_dim": 64, "rope_inv_freq_len": 8})
    video = torch.randn(1, 24, 3, 12, 16, generator=_g(seed + 1))   # 3 x 6 x 8 = 144 video tokens (patch 1x2x2)
    audio = torch.randn(1, 32, 2, 10, generator=_g(seed + 4))       # stereo: 2 x 10 = 20 audio tokens
    pos, neg = _pair(seed, 7, 48)
    model = _finish(cfg, seed)
    # the RoPE frequencies are a torch.empty buffer until a checkpoint loads: the standard 1 / 10000^(i/n)
    inv = model.model.diffusion_model.rope.inv_freq
    inv.copy_(1.0 / 10000.0 ** (torch.arange(inv.shape[0], dtype=torch.float32) / inv.shape[0]))
    return model, comfy.nested_tensor.NestedTensor([video, audio]), pos, neg


@family("krea2", "comfy.supported_models", "Krea2")
def _krea2(seed):
    import comfy.supported_models as sm
    # one text layer of width 48 fused by the model's own text transformer (a self-attention over the text)
    cfg = sm.Krea2({"image_model": "krea2", "features": 128, "tdim": 64, "txtdim": 48, "heads": 2, "kvheads": 2,
                    "multiplier": 2, "layers": 2, "patch": 2, "channels": 16, "txtlayers": 1, "txtheads": 2,
                    "txtkvheads": 2})
    refs = [torch.randn(1, 16, 1, 8, 8, generator=_g(seed + 5))]  # one reference image: 4 x 4 tokens
    pos, neg = _pair(seed, 7, 48, reference_latents=refs, reference_latents_method="index")
    return _finish(cfg, seed), torch.randn(1, 16, 1, 12, 16, generator=_g(seed + 1)), pos, neg


def _trellis2_config():
    import comfy.supported_models as sm
    # one block per stage model (structure 16^3 dense, shape 512/1024 sparse); the config class pins 12 heads
    # (unet_extra_config), so 192 channels give heads of 16
    return sm.Trellis2({"image_model": "trellis2", "resolution": 64, "model_channels": 192, "cond_channels": 48,
                        "num_blocks": 1, "mlp_ratio": 2.0})


@family("trellis2", "comfy.supported_models", "Trellis2")
def _trellis2(seed):
    """Stage 1 (sparse structure): a dense 16^3 voxel grid of 4096 tokens."""
    def cond(s):
        g = _g(s)
        image = torch.randn(1, 6, 48, generator=g)   # DINOv3 image tokens stand-in
        return [[image, {"embeds": image}]]
    latent = torch.randn(1, 32, 16, 16, 16, generator=_g(seed + 1))
    return _finish(_trellis2_config(), seed), latent, cond(seed + 2), cond(seed + 3)


@family("trellis2_shape", "comfy.supported_models", "Trellis2")
def _trellis2_shape(seed):
    """Stage 2 (shape): a sparse set of 40 active voxels (coords (N, 4): batch, x, y, z)."""
    g = _g(seed + 5)
    n = 40
    flat = torch.randperm(64 ** 3, generator=g)[:n].sort().values
    coords = torch.stack([torch.zeros(n, dtype=torch.long), flat // 4096, (flat // 64) % 64, flat % 64], dim=1)

    def cond(s):
        gg = _g(s)
        image = torch.randn(1, 6, 48, generator=gg)
        return [[image, {"embeds": image, "trellis2_generation_mode": "shape_generation",
                         "trellis2_coords": coords.int(), "trellis2_coord_counts": torch.tensor([n])}]]
    latent = torch.randn(1, 32, n, 1, generator=_g(seed + 1))
    return _finish(_trellis2_config(), seed), latent, cond(seed + 2), cond(seed + 3)
