"""Selection primitives of the PyTorch backend: pooled block scores and exact group KV mass."""

from __future__ import annotations

import torch

from . import _torch_softmax
from ._checks import check_block_size, check_qkv, check_scale
from ._gather import flat_rows, head_offsets
from .token_sparse_torch import check_query_groups


def _block_means(x: torch.Tensor, block: int) -> torch.Tensor:
    """(B, H, N, D) -> (B, H, ceil(N/block), D) fp32 means over each block's real tokens.

    Sums in fp32 straight from x's dtype (no fp32 copy of x); a ragged last block is averaged over its
    own tokens. Ops: view/reshape, sum(dtype=float32), cat.
    """
    b, h, n, d = x.shape
    full = n // block
    parts = []
    if full:
        parts.append(x[:, :, :full * block].reshape(b, h, full, block, d).sum(3, dtype=torch.float32) / block)
    if full * block < n:
        parts.append(x[:, :, full * block:].sum(2, keepdim=True, dtype=torch.float32) / (n - full * block))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def pooled_block_scores(q: torch.Tensor, k: torch.Tensor, *, block_q: int, block_k: int,
                        scale: float | None = None) -> torch.Tensor:
    """Cheap block-importance estimate: softmax of mean-pooled Q against mean-pooled K (docs/method.md).

    q: (B, H, Nq, D); k: (B, H, Nk, D). Ragged last blocks are averaged over their real tokens.
    Returns fp32 (B, H, ceil(Nq/block_q), ceil(Nk/block_k)); each row sums to 1.
    One batched pass: block sums in fp32 straight from the inputs' dtype, one matmul of the
    (nqb x nkb) pooled scores, softmax. Ops: sum(dtype=float32), cat, matmul, softmax (CPU, CUDA, MPS).
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


_half_bmm_ok = {"cuda": True}  # whether bmm(out_dtype=float32) ran (set False after it fails once)


def _shifted_scores(qg: torch.Tensor, kt: torch.Tensor, scale: float, neg_lse: torch.Tensor) -> torch.Tensor:
    """scale * q . k - lse in fp32: qg (S, M, D), kt (S, D, Nk), neg_lse = -lse fp32 (S, M, 1) -> (S, M, Nk).

    fp16/bf16 products are exact in fp32, so upcasting equals an fp32-accumulating half matmul (what the
    Triton kernel computes). Half ``kt`` (CUDA): ``bmm(out_dtype=float32)`` on the half inputs, then scale
    and shift. fp32 ``kt``: ``qg`` comes already upcast and scaled, and one ``baddbmm`` adds the shift.
    """
    if kt.dtype != torch.float32:
        return torch.bmm(qg, kt, out_dtype=torch.float32).mul_(scale).add_(neg_lse)
    return torch.baddbmm(neg_lse, qg, kt)


def _half_bmm(t: torch.Tensor) -> bool:
    """Whether to try ``bmm(out_dtype=float32)`` on half tensors of t's device (CUDA only)."""
    return t.dtype != torch.float32 and _half_bmm_ok.get(t.device.type, False)


def group_kv_mass(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, q_groups: torch.Tensor, *,
                  scale: float | None = None, validate: bool = True) -> torch.Tensor:
    """Exact attention mass each KV token receives from each query group (pass 2 of exact selection).

    mass[b, h, g, j] = sum over queries i of group g of exp(min(scale * q_i . k_j - lse_i, 0)).
    q: (B, H, Nq, D); k: (B, H, Nk, D); lse: fp32 (B, H, Nq) natural-log row LSE from pass 1;
    q_groups: int32 (B, H, G, C), -1 pads. Returns fp32 (B, H, G, Nk).

    With the true LSE every term is a probability (<= 1) and the clamp changes nothing; an inconsistent
    LSE (smaller than the true one) cannot overflow to inf or NaN: a term is capped at 1. Rows with
    lse = -inf or NaN (empty rows) and pad slots contribute nothing.
    How: batched fp32 score matmuls (``baddbmm`` folding in the LSE) over (heads x groups x keys) chunks
    of ``_torch_softmax.score_budget`` scores (cache-sized on CPU, where one head's scores already exceed
    the cache; all heads at once elsewhere when they fit, at most ``CHUNK_ELEMS``), clamped and
    exponentiated in place and summed over each group's C queries. Ops: index_select, gather, baddbmm /
    bmm, clamp_, exp_, sum.
    """
    b, h, nq, nk, d, scale, g, c = check_mass_args(q, k, lse, q_groups, scale, validate)
    bh = b * h
    dev = q.device
    out = torch.empty((bh, g, nk), dtype=torch.float32, device=dev)
    if g == 0 or c == 0:
        return out.view(b, h, g, nk)
    qidx = q_groups.reshape(bh, g * c).long()
    lse_g = lse.reshape(bh, nq).float().gather(1, qidx.clamp(min=0))
    skip = (qidx < 0) | torch.isneginf(lse_g) | torch.isnan(lse_g)
    lse_g = torch.where(skip, torch.full_like(lse_g, float("inf")), lse_g)  # term = exp(-inf) = 0
    qsrc = qidx.clamp(min=0) + head_offsets(b, h, nq, dev)
    qr = flat_rows(q)
    k3 = k.reshape(bh, nk, d)
    budget = _torch_softmax.score_budget(dev)
    heads = max(1, min(bh, budget // max(1, g * c * nk)))  # whole heads per chunk when they fit
    groups = g if heads > 1 else max(1, min(g, budget // max(1, c * nk)))
    keys = nk if groups > 1 or heads > 1 else max(1, min(nk, budget // c))
    for h0 in range(0, bh, heads):
        h1 = min(bh, h0 + heads)
        kt = k3[h0:h1].transpose(1, 2)
        kt = kt if _half_bmm(kt) else kt.float()  # upcast once per head chunk, not per group chunk
        for g0 in range(0, g, groups):
            g1 = min(g, g0 + groups)
            qg = qr.index_select(0, qsrc[h0:h1, g0 * c:g1 * c].reshape(-1)).view(h1 - h0, (g1 - g0) * c, d)
            if kt.dtype == torch.float32:
                qg = qg.float().mul_(scale)  # index_select made a fresh tensor: scaling it in place is safe
            neg_lse = lse_g[h0:h1, g0 * c:g1 * c].neg().unsqueeze(-1)
            for j0 in range(0, nk, keys):
                j1 = min(nk, j0 + keys)
                try:
                    s = _shifted_scores(qg, kt[:, :, j0:j1], scale, neg_lse)
                except (TypeError, RuntimeError, NotImplementedError):  # no half bmm with fp32 output here
                    _half_bmm_ok[kt.device.type] = False
                    kt, qg = kt.float(), qg.float().mul_(scale)
                    s = _shifted_scores(qg, kt[:, :, j0:j1], scale, neg_lse)
                s.clamp_(max=0.0).exp_()
                dst = out[h0:h1, g0:g1, j0:j1]
                if dst.is_contiguous():  # sum straight into the output (no temporary)
                    torch.sum(s.view(h1 - h0, g1 - g0, c, j1 - j0), dim=2, out=dst)
                else:
                    dst.copy_(s.view(h1 - h0, g1 - g0, c, j1 - j0).sum(2))
    return out.view(b, h, g, nk)
