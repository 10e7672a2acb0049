"""Gather helpers of the PyTorch backend: rows of a (B, H, N, D) tensor picked by per-head indices."""

from __future__ import annotations

import torch


def flat_rows(x: torch.Tensor) -> torch.Tensor:
    """(B, H, N, D) -> (B*H*N, D) view (contiguous copy only when needed)."""
    return x.reshape(-1, x.shape[-1])


def head_offsets(b: int, h: int, n: int, device: torch.device) -> torch.Tensor:
    """(B*H, 1) int64 offsets of each head's first row in the flattened (B*H*N, D) tensor."""
    return (torch.arange(b * h, device=device, dtype=torch.int64) * n).view(b * h, 1)


def gather_rows(rows: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """rows: (R, D); idx: (..., L) int64 in [0, R). Returns (..., L, D) fp32."""
    flat = idx.reshape(-1)
    return rows.index_select(0, flat).float().view(*idx.shape, rows.shape[-1])
