"""Selection primitives of the PyTorch backend: pooled block scores, exact group KV mass, top-k."""

from __future__ import annotations

import math

import torch

from ._checks import check_block_size, check_key_padding_mask, check_qkv, check_scale
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
    """Cheap block-importance estimate: softmax of mean-pooled Q against mean-pooled K (seed 000).

    q: (B, H, Nq, D); k: (B, H, Nk, D). Ragged last blocks are averaged over their real tokens.
    Returns fp32 (B, H, ceil(Nq/block_q), ceil(Nk/block_k)); each row sums to 1.
    """
    _, _, _, _, d = check_qkv(q, k, k)
    scale = check_scale(scale, d)
    check_block_size("block_q", block_q)
    check_block_size("block_k", block_k)
    s = torch.matmul(_block_means(q, block_q), _block_means(k, block_k).transpose(-1, -2)) * scale
    return torch.softmax(s, dim=-1)


def check_mass_args(q, k, lse, q_groups, granularity, block_k, scale, key_padding_mask, validate):
    """Validate group_kv_mass arguments; returns (B, H, Nq, Nk, D, scale, G, C)."""
    b, h, nq, nk, d = check_qkv(q, k, k)
    scale = check_scale(scale, d)
    if granularity not in ("token", "block"):
        raise ValueError(f"granularity must be 'token' or 'block', got {granularity!r}")
    if granularity == "block":
        check_block_size("block_k", block_k)
    if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != (b, h, nq) or lse.device != q.device:
        raise ValueError(f"lse must be a tensor of shape {(b, h, nq)} on {q.device}")
    check_key_padding_mask(key_padding_mask, b, nk, q.device)
    g, c = check_query_groups(q_groups, b, h, nq, q.device, validate)
    return b, h, nq, nk, d, scale, g, c


def group_kv_mass(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, q_groups: torch.Tensor, *,
                  granularity: str = "token", block_k: int | None = None, scale: float | None = None,
                  key_padding_mask: torch.Tensor | None = None, validate: bool = True) -> torch.Tensor:
    """Exact attention mass each KV token (or block) receives from each query group (pass 2).

    mass[b, h, g, j] = sum over queries i of group g of exp(scale * q_i . k_j - lse_i).
    q: (B, H, Nq, D); k: (B, H, Nk, D); lse: fp32 (B, H, Nq) natural-log row LSE from pass 1 (rows
    with lse = -inf contribute nothing); q_groups: int32 (B, H, G, C), -1 pads.
    granularity "token" -> fp32 (B, H, G, Nk); "block" -> fp32 (B, H, G, ceil(Nk/block_k)).
    key_padding_mask: bool (B, Nk), False keys receive 0. Chunked over groups: memory is bounded
    by the output plus ~256 MiB of scores.
    """
    b, h, nq, nk, d, scale, g, c = check_mass_args(q, k, lse, q_groups, granularity, block_k, scale,
                                                   key_padding_mask, validate)
    nkb = math.ceil(nk / block_k) if granularity == "block" else nk
    out = torch.zeros((b * h, g, nkb), dtype=torch.float32, device=q.device)
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
        keep = None if key_padding_mask is None else key_padding_mask[bh // h].float()
        for g0 in range(0, g, step):
            sl = slice(g0, g0 + step)
            s = torch.matmul(gather_rows(qr, qsrc[bh, sl]), kf.t()) * scale
            p = torch.exp(s - lse_g[bh, sl].unsqueeze(-1)).sum(1)
            if keep is not None:
                p = p * keep
            if granularity == "block":
                pad = nkb * block_k - nk
                p = torch.nn.functional.pad(p, (0, pad)).view(p.shape[0], nkb, block_k).sum(-1)
            out[bh, sl] = p
    return out.view(b, h, g, nkb)


def topk_per_row(scores: torch.Tensor, k: int | None = None, mass: float | None = None):
    """Select the highest-scoring entries of each row, returned sorted by index.

    scores: (..., L) float. Exactly one of ``k`` (a fixed count, clamped to L) or ``mass`` (the
    smallest set whose share of the row's total reaches ``mass`` in (0, 1]; scores must be >= 0; a row
    whose total is 0 selects nothing).
    Returns (indices int32 (..., K), counts int32 (...)): each row's first ``counts`` entries are
    strictly increasing indices, the rest -1. K = k, or the largest count over rows for ``mass``.
    """
    if not isinstance(scores, torch.Tensor) or not scores.is_floating_point() or scores.dim() < 1:
        raise ValueError("scores must be a floating tensor of shape (..., L)")
    if (k is None) == (mass is None):
        raise ValueError("give exactly one of k or mass")
    length = scores.shape[-1]
    if torch.isnan(scores).any():
        raise ValueError("scores contains NaN")
    if k is not None:
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ValueError(f"k must be a non-negative int, got {k!r}")
        width = min(k, length)
        top = torch.topk(scores, width, dim=-1, sorted=False).indices
        idx = torch.sort(top, dim=-1).values
        counts = torch.full(scores.shape[:-1], width, dtype=torch.int32, device=scores.device)
        return idx.to(torch.int32), counts
    mass = float(mass)
    if not (0.0 < mass <= 1.0):
        raise ValueError(f"mass must lie in (0, 1], got {mass}")
    if bool((scores < 0).any()):
        raise ValueError("scores must be non-negative when selecting by mass")
    vals, order = torch.sort(scores.float(), dim=-1, descending=True)
    total = vals.sum(-1, keepdim=True)
    share = torch.cumsum(vals, -1) / torch.where(total > 0, total, torch.ones_like(total))
    # entries needed: 1 + number of prefixes still short of the target; a row with no mass selects nothing
    counts = ((share < mass - 1e-7).sum(-1) + 1).clamp(max=length)
    counts = torch.where(total.squeeze(-1) > 0, counts, torch.zeros_like(counts))
    width = int(counts.max()) if counts.numel() else 0
    chosen = order[..., :width]
    keep = torch.arange(width, device=scores.device) < counts.unsqueeze(-1)
    chosen = torch.where(keep, chosen, torch.full_like(chosen, length))
    idx = torch.sort(chosen, dim=-1).values
    idx = torch.where(idx == length, torch.full_like(idx, -1), idx)
    return idx.to(torch.int32), counts.to(torch.int32)
