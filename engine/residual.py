"""Cached residuals R = O_dense - O_sparse, stored in the model's dtype or in fp8 (docs/method.md, "Anchors,
reuse and the residual").

The residual is the largest cached tensor (one (B, H, N, D) output per layer: 1.55 GB at Wan 14B 720p
with CFG), so by default it is stored as float8_e4m3fn with one fp32 scale per (batch, head, token)
row (amax / 448): half the bytes of bf16 plus 1/32 for the scales. The rounding error (3 mantissa bits,
≤ 2^-4 of each value) lands on R, itself a few per cent of the output, so the output moves by
≤ 2^-4 × |R| (docs/decisions.md has the measurement).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .. import kernels
from ..kernels._residual import FP8, encode_residual
from .config import RESIDUAL_PRECISIONS as PRECISIONS

log = logging.getLogger(__name__)

CHUNK_ELEMS = 1 << 26  # elements converted at a time (bounds the fp32 scratch to 256 MiB)
_warned = False


def weighs_by_mass(cfg, step: int, q: torch.Tensor) -> bool:
    """Whether an anchor at ``step`` (0-based sampling step) of configuration ``cfg`` (SparseConfig) writes its
    residual's mass, so reuse calls weight the residual by it (SparseConfig.residual_weighting): not for anchors
    at the run's first step, where the input is pure noise — measured on the quality testbed, the weighting gains
    1.7-5.4 dB after anchors at later steps and loses up to 2.7 dB after step-0 anchors at density 0.1
    (docs/method.md, "The residual weighted by the mass"); under "auto" only where the block-sparse kernels run on
    Triton (the PyTorch twin pays a second score pass for the LSE). q: the call's (B, H, N, D) queries (their
    device and dtype decide the backend). Only block selections carry a mass; callers check the selection."""
    if not cfg.residual or cfg.residual_weighting == "fixed" or step == 0:
        return False
    return cfg.residual_weighting == "mass" or kernels.block_sparse_on_triton(q, cfg.backend)


def fp8_supported(device: torch.device) -> bool:
    """fp8 storage needs torch's float8_e4m3fn and a CUDA or CPU tensor (elementwise casts)."""
    return FP8 is not None and device.type in ("cuda", "cpu")


def residual_precision(precision: str, device: torch.device) -> str:
    """The storage a residual gets on ``device``: "fp8" where supported (else "model", logged once)."""
    global _warned
    if precision == "fp8" and not fp8_supported(device):
        if not _warned:
            _warned = True
            log.info("sparse attention: fp8 residuals are not available on %s; stored in the model's dtype",
                     device.type)
        return "model"
    return precision


def _head_chunks(x: torch.Tensor):
    """Slices over dim 1 (heads) of a (B, H, N, D) tensor, each at most ~CHUNK_ELEMS elements."""
    per_head = max(1, x.numel() // max(1, x.shape[1]))
    step = max(1, CHUNK_ELEMS // per_head)
    for h0 in range(0, x.shape[1], step):
        yield slice(h0, h0 + step)


@dataclass
class Residual:
    """data: (B, H, N, D) in the model's dtype, or float8_e4m3fn; scale: fp32 (B, H, N, 1) per-row scale
    when data is fp8, else None; mass: fp32 (B, H, N, 2) per-row (log Z_C, log beta) of the anchor when reuse
    calls weight the residual by the selected keys' mass (kernels/_residual.py), else None."""

    data: torch.Tensor
    scale: torch.Tensor | None = None
    mass: torch.Tensor | None = None

    @staticmethod
    def encode(diff: torch.Tensor, precision: str = "fp8") -> "Residual":
        """Store ``diff`` (B, H, N, D), any float dtype. precision "fp8" (falls back to "model", logged
        once, where fp8 is unsupported) or "model" (kept as is)."""
        global _warned
        if precision not in PRECISIONS:
            raise ValueError(f"residual precision must be one of {PRECISIONS}, got {precision!r}")
        if precision == "model" or not fp8_supported(diff.device):
            if precision == "fp8" and not _warned:
                _warned = True
                log.info("sparse attention: fp8 residuals are not available on %s; stored in %s",
                         diff.device.type, diff.dtype)
            return Residual(diff)
        # the kernels' encoder (the Triton epilogue decodes what it writes): a per-row scale from the row's finite
        # values, so an inf or NaN (non-finite model input) stays in its own element, as in the dense output
        data, scale = encode_residual(diff, "fp8", diff.dtype)
        return Residual(data, scale)

    def add_to(self, out: torch.Tensor) -> torch.Tensor:
        """out (B, H, N, D) += the residual, in place; returns out. fp8 rows are decoded in fp32 (an fp16 copy of
        a small row's scale would be subnormal or zero)."""
        if self.scale is None:
            return out.add_(self.data)
        for sl in _head_chunks(out):
            out[:, sl] = out[:, sl].float().addcmul_(self.data[:, sl].float(), self.scale[:, sl]).to(out.dtype)
        return out

    def norm(self) -> float:
        """L2 norm of the decoded residual, accumulated in fp32 one head chunk at a time."""
        total = 0.0
        for sl in _head_chunks(self.data):
            x = self.data[:, sl].float()
            if self.scale is not None:
                x = x * self.scale[:, sl]
            total += float(torch.linalg.vector_norm(x)) ** 2
        return total ** 0.5

    def decode(self, dtype: torch.dtype) -> torch.Tensor:
        """The residual as a (B, H, N, D) tensor of ``dtype``."""
        if self.scale is None:
            return self.data.to(dtype)
        return (self.data.float() * self.scale).to(dtype)

    def tensors(self):
        return tuple(t for t in (self.data, self.scale, self.mass) if t is not None)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def map(self, fn) -> "Residual":
        """A copy with ``fn`` applied to every tensor (device moves, pinned copies)."""
        return Residual(fn(self.data), None if self.scale is None else fn(self.scale),
                        None if self.mass is None else fn(self.mass))

    def batch_slice(self, start: int, stop: int) -> "Residual":
        """Batch rows [start, stop) (views)."""
        return Residual(self.data[start:stop], None if self.scale is None else self.scale[start:stop],
                        None if self.mass is None else self.mass[start:stop])
