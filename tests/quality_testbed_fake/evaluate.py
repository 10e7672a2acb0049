"""A tiny stand-in for the quality testbed's evaluate.py: make_noise, sample (Euler, CONTEXT "step" and
"batch_offset" set per step), psnr and ssim with the real one's signatures (see model.py here)."""
from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import model as M  # noqa: E402


def make_noise(cfg, seeds):
    return torch.stack([torch.randn(cfg.in_channels, cfg.frames, cfg.height, cfg.width,
                                    generator=torch.Generator().manual_seed(int(s))) for s in seeds])


@torch.no_grad()
def sample(net, noise, labels, steps=30, shift=3.0, cfg_scale=1.0, batch=8, attn=None, device="cpu"):
    """Euler from t = 1 to 0 on a shifted grid. Returns (B, 3, T, H, W) float32 on the CPU."""
    u = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    ts = shift * u / (1 + (shift - 1) * u)
    prev = M.set_attention(attn)
    outs = []
    try:
        for b0 in range(0, noise.shape[0], batch):
            x = noise[b0:b0 + batch].to(device)
            y = labels[b0:b0 + batch].to(device)
            M.CONTEXT["batch_offset"] = b0
            for i in range(steps):
                M.CONTEXT["step"] = i
                v = net(x, torch.full((x.shape[0],), float(ts[i]), device=device), y)
                x = x + float(ts[i + 1] - ts[i]) * v
            outs.append(x.clamp(-1, 1).cpu())
    finally:
        M.set_attention(prev)
        M.CONTEXT["step"] = None
        M.CONTEXT["batch_offset"] = 0
    return torch.cat(outs)


def psnr(a, b, cap=100.0):
    mse = (((a.float().clamp(-1, 1) - b.float().clamp(-1, 1)) / 2) ** 2).flatten(1).mean(1)
    return [cap if m <= 10 ** (-cap / 10) else -10 * math.log10(m) for m in mse.tolist()]


def ssim(a, b):
    """Global (single-window) SSIM per video; the real testbed uses a Gaussian window."""
    x, y = (a.float().flatten(1) + 1) / 2, (b.float().flatten(1) + 1) / 2
    mx, my = x.mean(1), y.mean(1)
    sxx, syy = x.var(1, unbiased=False), y.var(1, unbiased=False)
    sxy = ((x - mx[:, None]) * (y - my[:, None])).mean(1)
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    return (((2 * mx * my + c1) * (2 * sxy + c2)) / ((mx ** 2 + my ** 2 + c1) * (sxx + syy + c2))).tolist()
