"""Static policy: local windows in 1-D/2-D/3-D at block granularity, sink blocks, dense text rows/columns.

The window of each image query block is the set of image KV blocks nearest to it in the latent grid
(Chebyshev distance between block centroids, frames weighted by ``temporal_weight``), sized so the
image->image density matches the configuration: a cuboid for video, a square band for images, a band
around the diagonal for 1-D layouts. Depends only on the shape, so it is built once and reused.
"""

from __future__ import annotations

import torch

from .block_geometry import block_summary, rows_topk
from .config import SparseConfig
from .context import TokenLayout
from .policy import Policy
from .selection import BlockSelection, block_pairs_fraction


def static_scores(n: int, layout: TokenLayout, cfg: SparseConfig, device, image_density: float | None = None):
    """Block scores (nqb, nkb) (+inf = forced) and per-row counts for the static pattern."""
    bq, bk = cfg.block_q, cfg.block_k
    cq, text_q = block_summary(n, bq, layout, device)
    ck, text_k = block_summary(n, bk, layout, device)
    dens = cfg.image_density if image_density is None else image_density
    weight = torch.tensor([cfg.temporal_weight, 1.0, 1.0], device=device)
    dist = ((cq.unsqueeze(1) - ck.unsqueeze(0)).abs() * weight).amax(-1)
    scores = -dist - 1e-6 * torch.arange(ck.shape[0], device=device)  # deterministic ties: lower index
    img_k = ~text_k
    n_img_k = int(img_k.sum())
    forced = torch.zeros_like(scores, dtype=torch.bool)
    forced[text_q] = True  # text rows dense
    if cfg.densities.image_to_text >= 1.0:
        forced[:, text_k] = True
    sinks = torch.nonzero(img_k).view(-1)[:cfg.sink_blocks]
    forced[:, sinks] = True
    scores = torch.where(img_k.unsqueeze(0), scores, scores - 1e9)  # text columns beyond forcing: last
    scores = torch.where(forced, torch.full_like(scores, float("inf")), scores)
    # image budget (sinks are image blocks, so they count in it) + text columns (all, or their own share)
    k_img = max(1, len(sinks), round(dens * n_img_k))
    n_txt_k = int(text_k.sum())
    k_txt = n_txt_k if cfg.densities.image_to_text >= 1.0 else round(cfg.densities.image_to_text * n_txt_k)
    counts = torch.full((cq.shape[0],), k_img + k_txt, device=device, dtype=torch.long)
    counts[text_q] = ck.shape[0]
    return scores, counts


def build_static(b: int, h: int, n: int, layout: TokenLayout, cfg: SparseConfig, device) -> BlockSelection:
    """The static block selection for (B, H, N) tokens; the same pattern for every batch item and head."""
    scores, counts = static_scores(n, layout, cfg, device)
    idx, cnt = rows_topk(scores, counts)
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
