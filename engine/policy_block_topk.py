"""block_topk policy: pooled block scores, top-k or cumulative mass per query block and key segment
(docs/method.md, "Block selection").

``build_block_topk(..., hybrid=True)`` is also the hybrid policy's selection (policy_hybrid.py): the static
structure (window + sinks + text, with half the budget) united with dynamic top-k for the rest.
"""

from __future__ import annotations

import torch

from .. import kernels
from .block_geometry import BlockPlan, block_plan, block_sizes, kept_plan, rows_topk_by_segment, with_forced
from .config import SparseConfig
from .context import TokenLayout
from .policy import Policy
from .policy_static import static_window
from .selection import BlockSelection, block_pairs_on_device


def build_block_topk(q, k, layout: TokenLayout, cfg: SparseConfig, *, hybrid: bool = False,
                     scale=None) -> BlockSelection:
    """q, k: (B, H, N, D). Returns a BlockSelection whose query blocks keep, in every key segment, the density
    of their modality pair times that segment's blocks (forced dense pairs and sinks included)."""
    b, h, n, _ = q.shape
    dev = q.device
    # weighted by each key block's size: a 1-token ragged last block must not win the top-k on its mean
    pooled = size_weighted(kernels.pooled_block_scores(q, k, block_q=cfg.block_q, block_k=cfg.block_k, scale=scale),
                           k.shape[2], cfg.block_k)
    plan = hybrid_plan(n, layout, cfg, dev) if hybrid else block_plan(n, layout, cfg, dev)
    forced = plan.forced
    counts = plan.counts  # (nqb, S): the plan's own forced blocks are in them already
    counts = counts.view(1, 1, *counts.shape).expand(b, h, -1, -1)
    f4 = forced.view(1, 1, *forced.shape)
    if cfg.mass is not None and not hybrid:
        # per key segment: the smallest set of its free blocks reaching the mass share, plus its forced ones
        need = []
        for s in range(counts.shape[-1]):
            cols = plan.seg_cols[s]  # read once when the plan was built
            free = torch.where(f4[..., cols], torch.zeros_like(pooled[..., cols]), pooled[..., cols])
            share = torch.sort(free, -1, descending=True).values.cumsum(-1) / \
                free.sum(-1, keepdim=True).clamp(min=1e-30)
            n_forced = f4[..., cols].sum(-1)
            keep = torch.minimum(n_forced + (share < cfg.mass).sum(-1) + 1, torch.full_like(n_forced, cols.numel()))
            dense = plan.dense_pair[:, s].bool().view(1, 1, -1)
            need.append(torch.where(dense, torch.full_like(keep, cols.numel()), keep))
        counts = torch.stack(need, -1)
    scores = torch.where(f4, torch.full_like(pooled, float("inf")), pooled)
    # plain top-k keeps the plan's own counts (they include its forced blocks; the hybrid's plan, its windows' too),
    # whose widths the plan read once: no host synchronisation on the anchor's path (docs/kernel_notes.md, "v27")
    # (with mass the counts follow the scores: the widths are read, the segments' columns still come from the plan)
    own = hybrid or cfg.mass is None
    idx, cnt = rows_topk_by_segment(scores, plan.owner, counts.contiguous(), plan, plan_counts=own)
    return BlockSelection(idx.contiguous(), cnt.contiguous(), cfg.block_q, cfg.block_k,
                          block_pairs_on_device(idx, cnt, n, n, cfg.block_q, cfg.block_k), plan.density)


def hybrid_plan(n: int, layout: TokenLayout, cfg: SparseConfig, device) -> BlockPlan:
    """The hybrid policy's plan: the block plan with the static half's windows (``static_window`` at half the
    densities) forced too. Like the plan it depends on the geometry and configuration alone, so it is built once and
    kept (``kept_plan``): its widths and density are read once, not at every anchor (docs/kernel_notes.md, "v28")."""

    def build() -> BlockPlan:
        plan = block_plan(n, layout, cfg, device)
        win_idx, win_cnt = static_window(n, layout, cfg, device, scale=0.5)
        valid = torch.arange(win_idx.shape[-1], device=win_idx.device) < win_cnt.unsqueeze(-1)
        rows = torch.arange(plan.forced.shape[0], device=win_idx.device).unsqueeze(-1).expand_as(win_idx)
        forced = plan.forced.clone()
        forced[rows[valid], win_idx[valid].long()] = True
        return with_forced(plan, forced, n, cfg.block_q, cfg.block_k)

    return kept_plan("hybrid", n, layout, cfg, device, 1.0, build)


def size_weighted(pooled: torch.Tensor, n_k: int, block_k: int) -> torch.Tensor:
    """Pooled block probabilities (B, H, nqb, nkb) weighted by each KV block's token count, rows renormalised.

    A block's attention mass is about its size times exp(q_mean . k_mean); the pooled softmax leaves the size
    out, which only matters for a ragged last block: one key alone is not averaged, so its pooled score
    spreads far wider than a 64-key mean's and at N = 513 it won the top-k of 44 % of the query blocks."""
    if n_k % block_k == 0:
        return pooled
    out = pooled * (block_sizes(n_k, block_k, pooled.device) / block_k).to(pooled.dtype)
    return out / out.sum(-1, keepdim=True).clamp(min=1e-30)


class BlockTopkPolicy(Policy):
    """Pooled block scores at anchors (or at every step with ``select_every_step``)."""

    name = "block_topk"

    def reselects(self, cfg: SparseConfig) -> bool:
        return cfg.select_every_step

    def select(self, q, k, lse, layout, cfg, *, scale, backend) -> BlockSelection:
        return build_block_topk(q, k, layout, cfg, scale=scale)
