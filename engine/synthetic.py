"""A synthetic video-DiT attention problem with realistic structure, for the demo, tests and benchmarks.

Tokens: a text prefix followed by an F x H x W latent grid in raster order. Each head's queries and keys
combine (1) positional features whose dot products peak for nearby tokens in space and time (local
neighbourhoods), (2) content shared by tokens of the same "object" region (long-range similarity),
(3) a few global sink keys aligned with the mean query, (4) text keys of moderate relevance. Q/K/V
drift slowly over the denoising steps (a small random walk plus a shrinking noise term).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .context import TokenLayout

GLOBAL_FREQUENCY = 0.1  # positional frequencies of ``global_heads`` relative to the others


@dataclass
class SyntheticVideoAttention:
    """Generates q, k, v (B=1, H, N, D) for step t = 0..steps-1 of one layer; deterministic per seed."""

    frames: int = 8
    height: int = 16
    width: int = 16
    text: int = 64
    heads: int = 4
    head_dim: int = 64
    steps: int = 20
    seed: int = 0
    global_heads: tuple = ()
    device: str = "cpu"
    dtype: torch.dtype = torch.float32

    def __post_init__(self):
        g = torch.Generator().manual_seed(self.seed)
        f, hh, w, t, nh, d = self.frames, self.height, self.width, self.text, self.heads, self.head_dim
        n_img = f * hh * w
        self.n = t + n_img
        pos = torch.stack(torch.meshgrid(torch.arange(f), torch.arange(hh), torch.arange(w), indexing="ij"), -1)
        pos = pos.view(n_img, 3).float()
        quarter = d // 4
        # per-head frequencies: sharper in space than in time
        freq = torch.exp(-torch.rand(nh, 3, quarter // 3 + 1, generator=g) * 3.0) * 1.2
        broad = torch.tensor([i in self.global_heads for i in range(nh)])
        freq[broad] *= GLOBAL_FREQUENCY  # global heads: positional features vary slowly -> broad attention
        feats = []
        for axis in range(3):
            ang = pos[:, axis].view(1, -1, 1) * freq[:, axis].view(nh, 1, -1)
            feats += [torch.cos(ang), torch.sin(ang)]
        pf = torch.cat(feats, -1)[..., : d // 2]  # (H, n_img, d/2)
        pf = pf / pf.norm(dim=-1, keepdim=True) * 3.2
        # content: 6 object regions with shared vectors
        centers = torch.randn(nh, 6, d // 2, generator=g) * 0.9
        region = ((pos[:, 1] // max(1, hh // 3)) * 2 + (pos[:, 2] // max(1, w // 2))).long() % 6
        content = centers[:, region]  # (H, n_img, d/2)
        content[broad] = 0.0  # ... and no object regions to concentrate on
        q_img = torch.cat([pf, content], -1) + 0.35 * torch.randn(nh, n_img, d, generator=g)
        k_img = torch.cat([pf, content], -1) + 0.35 * torch.randn(nh, n_img, d, generator=g)
        sinks = torch.randperm(n_img, generator=g)[:4]
        k_img[:, sinks] += q_img.mean(1, keepdim=True) * 2.5
        q_txt = torch.randn(nh, t, d, generator=g)
        k_txt = torch.randn(nh, t, d, generator=g) * 0.5 + q_img.mean(1, keepdim=True) * 0.6
        self._q = torch.cat([q_txt, q_img], 1).unsqueeze(0) * (d ** 0.25) / 2.2
        self._k = torch.cat([k_txt, k_img], 1).unsqueeze(0) * (d ** 0.25) / 2.2
        # values are smooth in space (images are) and shared within an object region, plus noise
        mix = torch.randn(nh, d // 2, d // 2, generator=g) / math.sqrt(d // 2)
        v_centers = torch.randn(nh, 6, d - d // 2, generator=g)
        v_img = torch.cat([torch.matmul(pf, mix) * 0.6, v_centers[:, region]], -1)
        v_img = v_img + 0.5 * torch.randn(nh, n_img, d, generator=g)
        self._v = torch.cat([torch.randn(nh, t, d, generator=g), v_img], 1).unsqueeze(0)
        self._q, self._k, self._v = (x.to(self.device) for x in (self._q, self._k, self._v))
        self._drift: tuple[int, torch.Tensor] | None = None

    def _random(self, index: int) -> torch.Tensor:
        """(3, 1, H, N, D) standard normal draw number ``index``, generated on the problem's device."""
        g = torch.Generator(device=self.device).manual_seed(self.seed * 100003 + index)
        return torch.randn((3, 1, self.heads, self.n, self.head_dim), generator=g, device=self.device)

    def _cumulative_drift(self, step: int) -> torch.Tensor:
        """Sum of the walk's increments 0..step (kept incrementally for sequential steps)."""
        if self._drift is None or self._drift[0] > step:
            self._drift = (-1, torch.zeros((3, 1, self.heads, self.n, self.head_dim), device=self.device))
        s, acc = self._drift
        for i in range(s + 1, step + 1):
            acc = acc + self._random(i)
        self._drift = (step, acc)
        return acc

    @property
    def layout(self) -> TokenLayout:
        return TokenLayout(text_len=self.text, text_first=True, grid=(self.frames, self.height, self.width))

    def qkv(self, step: int):
        """q, k, v at denoising step ``step``: base + cumulative drift + noise shrinking with the step."""
        if not 0 <= step < self.steps:
            raise ValueError(f"step must lie in [0, {self.steps}), got {step}")
        drift = self._cumulative_drift(step) * 0.03
        noise_level = 0.25 * (1.0 - step / max(1, self.steps - 1))
        noise = self._random(10_000 + step) * noise_level
        out = []
        for i, base in enumerate((self._q, self._k, self._v)):
            out.append((base + drift[i] + noise[i] * (0.5 if i < 2 else 1.0)).to(self.device, self.dtype))
        return tuple(out)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))

