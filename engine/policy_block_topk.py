"""block_topk policy: pooled block scores, top-k or cumulative mass per query block (docs/method.md,
"Block selection").

``build_block_topk(..., hybrid=True)`` is also the hybrid policy's selection (policy_hybrid.py): the static
structure (window + sinks + text, with half the budget) united with dynamic top-k for the rest.
"""

from __future__ import annotations

import torch

from .. import kernels
from .block_geometry import rows_topk
from .config import SparseConfig
from .context import TokenLayout
from .policy import Policy
from .policy_static import static_scores
from .selection import BlockSelection, block_pairs_fraction


def build_block_topk(q, k, layout: TokenLayout, cfg: SparseConfig, *, hybrid: bool = False,
                     scale=None) -> BlockSelection:
    """q, k: (B, H, N, D). Returns a BlockSelection whose image rows keep density * image blocks."""
    b, h, n, _ = q.shape
    pooled = size_weighted(kernels.pooled_block_scores(q, k, block_q=cfg.block_q, block_k=cfg.block_k, scale=scale),
                           k.shape[2], cfg.block_k)
    if hybrid:
        base, counts = static_scores(n, layout, cfg, q.device, image_density=cfg.image_density / 2)
        forced = torch.isinf(base)
        # the static half: window blocks become forced too
        win_idx, win_cnt = rows_topk(base, counts)
        valid = torch.arange(win_idx.shape[-1], device=q.device) < win_cnt.unsqueeze(-1)
        forced = forced.clone()
        rows = torch.arange(forced.shape[0], device=q.device).unsqueeze(-1).expand_as(win_idx)
        forced[rows[valid], win_idx[valid].long()] = True
        full_counts = static_scores(n, layout, cfg, q.device)[1]
    else:
        base, full_counts = static_scores(n, layout, cfg, q.device)
        forced = torch.isinf(base)  # text rows/columns and sink blocks
    scores = torch.where(forced.view(1, 1, *forced.shape), torch.full_like(pooled, float("inf")), pooled)
    counts = full_counts.view(1, 1, -1).expand(b, h, -1)
    if cfg.mass is not None and not hybrid:
        # smallest set reaching the mass among non-forced blocks, plus the forced ones
        free = torch.where(forced.view(1, 1, *forced.shape), torch.zeros_like(pooled), pooled)
        share = torch.sort(free, -1, descending=True).values.cumsum(-1) / free.sum(-1, keepdim=True).clamp(min=1e-30)
        need = (share < cfg.mass).sum(-1) + 1
        counts = forced.sum(-1).view(1, 1, -1) + need
        counts = torch.where(forced.all(-1).view(1, 1, -1), torch.full_like(counts, forced.shape[1]), counts)
    idx, cnt = rows_topk(scores, counts.contiguous())
    return BlockSelection(idx.contiguous(), cnt.contiguous(), cfg.block_q, cfg.block_k,
                          block_pairs_fraction(idx, cnt, n, n, cfg.block_q, cfg.block_k))


def size_weighted(pooled: torch.Tensor, n_k: int, block_k: int) -> torch.Tensor:
    """Pooled block probabilities (B, H, nqb, nkb) weighted by each KV block's token count, rows renormalised.

    A block's attention mass is about its size times exp(q_mean . k_mean); the pooled softmax leaves the size
    out, which only matters for a ragged last block: one key alone is not averaged, so its pooled score
    spreads far wider than a 64-key mean's and at N = 513 it won the top-k of 44 % of the query blocks."""
    last = n_k - (pooled.shape[-1] - 1) * block_k
    if last == block_k:
        return pooled
    weight = torch.ones(pooled.shape[-1], dtype=pooled.dtype, device=pooled.device)
    weight[-1] = last / block_k
    out = pooled * weight
    return out / out.sum(-1, keepdim=True).clamp(min=1e-30)


class BlockTopkPolicy(Policy):
    """Pooled block scores at anchors (or at every step with ``select_every_step``)."""

    name = "block_topk"

    def reselects(self, cfg: SparseConfig) -> bool:
        return cfg.select_every_step

    def select(self, q, k, lse, layout, cfg, *, scale, backend) -> BlockSelection:
        return build_block_topk(q, k, layout, cfg, scale=scale)
