"""Static policy: local windows in 1-D/2-D/3-D at block granularity, sink blocks, dense text rows/columns.

The window of each query block is, in every key segment, the set of that segment's KV blocks nearest to it
(engine/block_geometry.py: Chebyshev distance between block centroids in the segment's grid, frames weighted
by ``temporal_weight``; across segments, positions as shares of each segment's extent), sized so each
modality pair keeps its density: a cuboid for video, a square band for images, a band around the diagonal
for 1-D segments. Depends only on the shape, so it is built once and reused.
"""

from __future__ import annotations

import torch

from .block_geometry import block_plan, rows_topk_by_segment
from .config import SparseConfig
from .context import TokenLayout
from .policy import Policy
from .selection import BlockSelection, block_pairs_fraction


def static_window(n: int, layout: TokenLayout, cfg: SparseConfig, device, scale: float = 1.0):
    """The static pattern's KV blocks per query block: (indices int32 (nqb, K) sorted, -1 past each count, counts
    int32 (nqb,)); ``scale`` multiplies every density below 1 (the hybrid policy's static half)."""
    plan = block_plan(n, layout, cfg, device, scale=scale)
    scores = torch.where(plan.forced, torch.full_like(plan.near, float("inf")), plan.near)
    scores = scores - 1e-6 * torch.arange(scores.shape[-1], device=device)  # deterministic ties: lower index
    return rows_topk_by_segment(scores, plan.owner, plan.counts, plan)


def build_static(b: int, h: int, n: int, layout: TokenLayout, cfg: SparseConfig, device) -> BlockSelection:
    """The static block selection for (B, H, N) tokens; the same pattern for every batch item and head."""
    idx, cnt = static_window(n, layout, cfg, device)
    idx = idx.view(1, 1, *idx.shape).expand(b, h, -1, -1).contiguous()
    cnt = cnt.view(1, 1, -1).expand(b, h, -1).contiguous()
    return BlockSelection(idx, cnt, cfg.block_q, cfg.block_k,
                          block_pairs_fraction(idx, cnt, n, n, cfg.block_q, cfg.block_k))


class StaticPolicy(Policy):
    """Shape-only windows: built once per (B, H, N, layout, device) and reused by the engine."""

    name = "static"
    shape_only = True

    def select(self, q, k, lse, layout, cfg, *, scale, backend) -> BlockSelection:
        b, h, n, _ = q.shape
        return build_static(b, h, n, layout, cfg, q.device)
