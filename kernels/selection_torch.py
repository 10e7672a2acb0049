"""Selection primitives of the PyTorch backend: pooled block scores and exact group KV mass."""

from __future__ import annotations

import math

import torch

from ._checks import check_block_size, check_qkv, check_scale
from ._gather import flat_rows, gather_rows, head_offsets
from ._torch_softmax import rows_per_chunk
from .token_sparse_torch import check_query_groups


def _block_means(x: torch.Tensor, block: int) -> torch.Tensor:
    """(B, H, N, D) -> (B, H, ceil(N/block), D) fp32 means over each block's real tokens."""
    b, h, n, d = x.shape
    nb = math.ceil(n / block)
    xp = torch.zeros((b, h, nb * block, d), dtype=torch.float32, device=x.device)
    xp[:, :, :n] = x.float()
    sums = xp.view(b, h, nb, block, d).sum(3)
    counts = torch.full((nb,), float(block), device=x.device)
    counts[-1] = n - (nb - 1) * block
    return sums / counts.view(1, 1, nb, 1)


def pooled_block_scores(q: torch.Tensor, k: torch.Tensor, *, block_q: int, block_k: int,
                        scale: float | None = None) -> torch.Tensor:
    """Cheap block-importance estimate: softmax of mean-pooled Q against mean-pooled K (docs/method.md).

    q: (B, H, Nq, D); k: (B, H, Nk, D). Ragged last blocks are averaged over their real tokens.
    Returns fp32 (B, H, ceil(Nq/block_q), ceil(Nk/block_k)); each row sums to 1.
    """
    _, _, _, _, d = check_qkv(q, k, k)
    scale = check_scale(scale, d)
    check_block_size("block_q", block_q)
    check_block_size("block_k", block_k)
    s = torch.matmul(_block_means(q, block_q), _block_means(k, block_k).transpose(-1, -2)) * scale
    return torch.softmax(s, dim=-1)


def check_mass_args(q, k, lse, q_groups, scale, validate):
    """Validate group_kv_mass arguments; returns (B, H, Nq, Nk, D, scale, G, C)."""
    b, h, nq, nk, d = check_qkv(q, k, k)
    scale = check_scale(scale, d)
    if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != (b, h, nq) or lse.device != q.device:
        raise ValueError(f"lse must be a tensor of shape {(b, h, nq)} on {q.device}")
    g, c = check_query_groups(q_groups, b, h, nq, q.device, validate)
    return b, h, nq, nk, d, scale, g, c


def group_kv_mass(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, q_groups: torch.Tensor, *,
                  scale: float | None = None, validate: bool = True) -> torch.Tensor:
    """Exact attention mass each KV token receives from each query group (pass 2 of exact selection).

    mass[b, h, g, j] = sum over queries i of group g of exp(scale * q_i . k_j - lse_i).
    q: (B, H, Nq, D); k: (B, H, Nk, D); lse: fp32 (B, H, Nq) natural-log row LSE from pass 1 (rows
    with lse = -inf contribute nothing); q_groups: int32 (B, H, G, C), -1 pads.
    Returns fp32 (B, H, G, Nk). Chunked over groups: memory is bounded by the output plus ~256 MiB of scores.
    """
    b, h, nq, nk, d, scale, g, c = check_mass_args(q, k, lse, q_groups, scale, validate)
    out = torch.zeros((b * h, g, nk), dtype=torch.float32, device=q.device)
    qidx = q_groups.reshape(b * h, g * c).long()
    qsrc = (qidx.clamp(min=0) + head_offsets(b, h, nq, q.device)).view(b * h, g, c)
    lse_flat = lse.reshape(-1).float()
    lse_g = torch.where(qidx.view(b * h, g, c) < 0, torch.full_like(qsrc, 0, dtype=torch.float32) + float("inf"),
                        lse_flat[qsrc])
    lse_g = torch.where(torch.isneginf(lse_g), torch.full_like(lse_g, float("inf")), lse_g)
    qr = flat_rows(q)
    step = rows_per_chunk(c * nk * 2, g)
    for bh in range(b * h):
        kf = k[bh // h, bh % h].float()
        for g0 in range(0, g, step):
            sl = slice(g0, g0 + step)
            s = torch.matmul(gather_rows(qr, qsrc[bh, sl]), kf.t()) * scale
            out[bh, sl] = torch.exp(s - lse_g[bh, sl].unsqueeze(-1)).sum(1)
    return out.view(b, h, g, nk)
