"""Image-quality metrics for the Compare node: PSNR, SSIM and a difference image between two IMAGE batches.

Plain torch (no ComfyUI import): ComfyUI IMAGE tensors are float (B, H, W, C) in [0, 1]; a video is a batch of
frames. The definitions match the quality testbed's (docs/quality.md): PSNR on [0, 1] pixels, capped at 100 dB;
SSIM with an 11 x 11 Gaussian window (sigma 1.5), data range 1, averaged over channels and pixels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

CAP_DB = 100.0


@dataclass
class Comparison:
    """Per-frame PSNR (dB) and SSIM of B against A, and the difference image (B, H, W, C) in [0, 1]."""

    psnr: list[float]
    ssim: list[float]
    difference: torch.Tensor

    def text(self) -> str:
        """A short report: mean and worst frame, PSNR and SSIM."""
        n = len(self.psnr)
        worst = min(range(n), key=lambda i: self.psnr[i])
        return (f"PSNR {sum(self.psnr) / n:.2f} dB (worst frame {worst}: {self.psnr[worst]:.2f} dB), "
                f"SSIM {sum(self.ssim) / n:.4f} (min {min(self.ssim):.4f}) over {n} frame(s). "
                "Above ~35 dB differences are hard to see; below ~30 dB look at the difference image.")


def check_images(a, b) -> None:
    """ValueError naming the problem when A and B are not comparable IMAGE batches."""
    for name, x in (("image_a", a), ("image_b", b)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"{name}: expected an IMAGE batch (B, H, W, C), got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if a.shape != b.shape:
        raise ValueError(f"image_a {tuple(a.shape)} and image_b {tuple(b.shape)} differ in shape: compare the same "
                         "resolution and frame count (the dense and the sparse run of one seed)")


def psnr(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    """a, b: (B, H, W, C) in [0, 1]. Per-frame PSNR in dB (CAP_DB for identical frames)."""
    mse = (a.float().clamp(0, 1) - b.float().clamp(0, 1)).pow(2).flatten(1).mean(1)
    return [CAP_DB if m <= 10 ** (-CAP_DB / 10) else -10 * math.log10(m) for m in mse.tolist()]


def ssim(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    """a, b: (B, H, W, C) in [0, 1]. Per-frame SSIM (Gaussian 11 x 11, sigma 1.5; frames smaller than the window
    use a window of their size)."""
    x = a.float().clamp(0, 1).permute(0, 3, 1, 2)
    y = b.float().clamp(0, 1).permute(0, 3, 1, 2)
    c = x.shape[1]
    size = min(11, x.shape[2], x.shape[3])
    g = torch.exp(-((torch.arange(size, dtype=torch.float32, device=x.device) - (size - 1) / 2) ** 2) / (2 * 1.5 ** 2))
    g = g / g.sum()
    win = (g[:, None] * g[None, :]).expand(c, 1, size, size).contiguous()

    def filt(z):
        return F.conv2d(z, win, groups=c)
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    mx, my = filt(x), filt(y)
    sxx, syy, sxy = filt(x * x) - mx * mx, filt(y * y) - my * my, filt(x * y) - mx * my
    s = ((2 * mx * my + c1) * (2 * sxy + c2)) / ((mx * mx + my * my + c1) * (sxx + syy + c2))
    return s.flatten(1).mean(1).tolist()


def compare(a: torch.Tensor, b: torch.Tensor, amplify: float = 4.0) -> Comparison:
    """PSNR/SSIM of b against a and |a - b| * amplify as an image (clamped to [0, 1])."""
    check_images(a, b)
    if not (amplify > 0 and math.isfinite(amplify)):
        raise ValueError(f"amplify: must be a positive number, got {amplify!r}")
    diff = ((a.float() - b.float()).abs() * amplify).clamp(0, 1)
    return Comparison(psnr(a, b), ssim(a, b), diff)
