"""A tiny stand-in for the quality testbed's model.py with the same interface (attention hook, CONTEXT, config,
random-init fields, load_model), so bench/quality.py runs end to end in CPU tests without the real testbed.

Video tensors (B, C, T, H, W); patch 1x2x2; tokens in raster order (frame, row, column); every attention call
goes through ``attention(q, k, v)`` with (B, H, N, D) tensors while CONTEXT holds "grid" and "layer".
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch.nn as nn
import torch.nn.functional as F

CONTEXT: dict = {"grid": None, "layer": None, "step": None}


def sdpa_attention(q, k, v):
    """Dense attention. q, k, v: (B, H, N, D)."""
    return F.scaled_dot_product_attention(q, k, v)


_ATTENTION_IMPL = sdpa_attention


def set_attention(fn):
    global _ATTENTION_IMPL
    prev = _ATTENTION_IMPL
    _ATTENTION_IMPL = sdpa_attention if fn is None else fn
    return prev


def attention(q, k, v):
    return _ATTENTION_IMPL(q, k, v)


@dataclass
class DiTConfig:
    frames: int = 2
    height: int = 16
    width: int = 16
    in_channels: int = 3
    patch: tuple = (1, 2, 2)
    dim: int = 64
    num_heads: int = 2
    num_layers: int = 2
    num_classes: int = 8

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def grid(self) -> tuple:
        pt, ph, pw = self.patch
        return (self.frames // pt, self.height // ph, self.width // pw)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["patch"] = list(self.patch)
        return d


def small_config() -> DiTConfig:
    return DiTConfig()


class DiT(nn.Module):
    def __init__(self, cfg: DiTConfig | None = None):
        super().__init__()
        self.cfg = cfg = cfg or DiTConfig()
        pdim = cfg.in_channels * cfg.patch[0] * cfg.patch[1] * cfg.patch[2]
        self.embed = nn.Linear(pdim, cfg.dim)
        self.class_embedding = nn.Embedding(cfg.num_classes + 1, cfg.dim)
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(1, cfg.dim))
        self.qkv = nn.ModuleList([nn.Linear(cfg.dim, 3 * cfg.dim) for _ in range(cfg.num_layers)])
        self.o = nn.ModuleList([nn.Linear(cfg.dim, cfg.dim) for _ in range(cfg.num_layers)])
        self.head = nn.Linear(cfg.dim, pdim)

    def forward(self, x, t, y):
        """x: (B, C, T, H, W); t: (B,); y: (B,) class ids. Returns the velocity, x's shape."""
        b, c, tt, hh, ww = x.shape
        pt, ph, pw = self.cfg.patch
        f, h, w = tt // pt, hh // ph, ww // pw
        tok = x.reshape(b, c, f, pt, h, ph, w, pw).permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(b, f * h * w, -1)
        z = self.embed(tok) + self.class_embedding(y)[:, None] + self.time_projection(t[:, None].float())[:, None]
        CONTEXT["grid"] = (f, h, w)
        nh, hd = self.cfg.num_heads, self.cfg.head_dim
        for i, (qkv, o) in enumerate(zip(self.qkv, self.o)):
            CONTEXT["layer"] = i
            q, k, v = qkv(z).view(b, f * h * w, 3, nh, hd).permute(2, 0, 3, 1, 4)
            z = z + o(attention(q, k, v).transpose(1, 2).reshape(b, f * h * w, -1))
        CONTEXT["layer"] = None
        out = self.head(z).reshape(b, f, h, w, c, pt, ph, pw).permute(0, 4, 1, 5, 2, 6, 3, 7)
        return out.reshape(b, c, tt, hh, ww)


def load_model(path, device="cpu"):
    from safetensors.torch import load_file

    net = DiT()
    net.load_state_dict(load_file(str(path)))
    return net.to(device)
