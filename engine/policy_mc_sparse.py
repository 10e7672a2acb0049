"""MC-Sparse policy (docs/method.md, "MC-Sparse"): query groups of exactly C queries, each with its own exact
token-level KV selection by group attention mass, computed at anchor steps.

Anchor selection = grouping + pass 2 (the group mass of every KV token, given the row LSE of the dense pass)
+ top-K per group. Grouping is "pca" (principal-direction median splits of each head's queries: groups of
similar queries) or "cuboid" (tiles of the latent grid: no work at all, the same groups for every head). Text
query rows are computed densely; text KV tokens are kept for every group when image->text is dense. Memory
stays bounded by running pass 2 over a few heads at a time.
"""

from __future__ import annotations

import torch

from .. import kernels
from .block_geometry import rows_above_threshold, token_coords
from .config import SparseConfig
from .context import TokenLayout
from .policy import Policy
from .selection import TokenSelection

MASS_CHUNK_BYTES = 1 << 30  # fp32 group-mass scratch per pass-2 chunk


def build_mc_sparse(q, k, lse, layout: TokenLayout, cfg: SparseConfig, *, scale=None,
                    backend="auto") -> TokenSelection:
    """q, k: (B, H, N, D); lse: fp32 (B, H, N) row LSE of dense attention. Returns a TokenSelection."""
    b, h, n, _ = q.shape
    dev = q.device
    _, is_text = token_coords(n, layout, dev)
    img_rows = torch.nonzero(~is_text).view(-1)
    text_rows = torch.nonzero(is_text).view(-1)
    n_img, n_txt = img_rows.numel(), text_rows.numel()
    if n_img == 0:  # nothing but text / extra tokens: every row dense
        empty = torch.zeros((b, h, 0, cfg.group_size), dtype=torch.int32, device=dev)
        counts = torch.zeros((b, h, 0), dtype=torch.int32, device=dev)
        return TokenSelection(empty, torch.zeros((b, h, 0, 0), dtype=torch.int16, device=dev),
                              torch.zeros((b, h, 0, 1), dtype=torch.int32, device=dev), counts, text_rows, 1.0)
    if cfg.grouping == "cuboid":
        groups_local = cuboid_groups(layout, n_img, cfg.group_size, dev).expand(b, h, -1, -1)
    else:
        q_img = q[:, :, img_rows] if n_txt else q
        groups_local = kernels.group_queries(q_img, cfg.group_size, backend=backend)
    groups = torch.where(groups_local >= 0, img_rows[groups_local.clamp(min=0).long()].to(torch.int32),
                         groups_local) if n_txt else groups_local
    g = groups.shape[2]
    k_img = max(1, round(cfg.image_density * n_img))
    i2t = cfg.densities.image_to_text
    k_txt = n_txt if i2t >= 1.0 else round(i2t * n_txt)
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (kv_low, seg_ends, counts) per chunk
    per_head = g * n * 4
    step = max(1, MASS_CHUNK_BYTES // max(1, per_head))
    force = torch.zeros(n, dtype=torch.bool, device=dev)
    if i2t >= 1.0:
        force[text_rows] = True
    want = torch.full((b, 1, g), k_img + k_txt, dtype=torch.long, device=dev)
    for h0 in range(0, h, step):
        sl = slice(h0, h0 + step)
        mass = kernels.group_kv_mass(q[:, sl], k[:, sl], lse[:, sl], groups[:, sl],
                                     scale=scale, backend=backend, validate=False)
        if n_txt and i2t < 1.0:
            # separate budgets: the k_txt text tokens of highest mass are forced, other text tokens excluded
            top_txt = text_rows[torch.topk(mass[..., text_rows], k_txt, dim=-1).indices] if k_txt else None
            mass[..., text_rows] = -1.0
            if top_txt is not None:
                mass.scatter_(-1, top_txt, float("inf"))
        else:
            mass.masked_fill_(force, float("inf"))
        hs = mass.shape[1]
        idx, cnt = rows_above_threshold(mass.view(b * hs * g, n), int(want[0, 0, 0]))
        del mass
        idx, cnt = idx.view(b, hs, g, -1), cnt.view(b, hs, g)
        parts.append((*TokenSelection.compact(idx, cnt, n), cnt))  # int16 at once: half the bytes held
        del idx
    width = max(p[0].shape[-1] for p in parts)
    low = torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[-1])) for t, _, _ in parts], dim=1)
    seg_ends = torch.cat([e for _, e, _ in parts], dim=1)
    counts = torch.cat([c for _, _, c in parts], dim=1)
    del parts
    real_q = (groups >= 0).sum(-1).double()
    pairs = float((real_q * counts.double()).sum()) + b * h * n_txt * n
    density = pairs / (b * h * n * n)
    return TokenSelection(groups, low, seg_ends, counts, text_rows if n_txt else None, density)


def cuboid_shape(grid: tuple[int, int, int] | None, c: int) -> tuple[int, int, int]:
    """Tile (frames, rows, cols) of c tokens for a latent grid: rows x cols as square as c allows, frames taking
    the rest (c = 64 -> 1x8x8, c = 128 -> 2x8x8; an image (one frame) -> 1x8x16; a 1-D layout -> 1x1xc)."""
    if grid is None:
        return (1, 1, c)
    side = 1
    while (2 * side) ** 2 <= c:
        side *= 2
    tf = min(c // (side * side), grid[0])
    return (tf, side, c // (tf * side))


def cuboid_groups(layout: TokenLayout, n_img: int, c: int, device) -> torch.Tensor:
    """Groups of c image tokens that are neighbours in the latent grid: int32 (1, 1, ceil(n_img/c), c) of image
    token positions (0-based within the image span; -1 pads the last group). Tokens are ordered tile by tile
    (raster order of tiles, raster order inside a tile) and cut every c tokens, so ragged edge tiles join their
    neighbours."""
    grid = layout.grid if layout.grid is not None and layout.grid[0] * layout.grid[1] * layout.grid[2] == n_img \
        else None
    g = -(-n_img // c)
    pos = torch.arange(n_img, device=device)
    if grid is None:
        order = pos
    else:
        f, hh, w = grid
        tf, th, tw = cuboid_shape(grid, c)
        fi, hi, wi = pos // (hh * w), (pos // w) % hh, pos % w
        nth, ntw = -(-hh // th), -(-w // tw)
        tile = ((fi // tf) * nth + hi // th) * ntw + wi // tw
        inner = ((fi % tf) * th + hi % th) * tw + wi % tw
        order = torch.argsort(tile * (tf * th * tw) + inner)
    out = torch.full((g * c,), -1, dtype=torch.int32, device=device)
    out[:n_img] = order.to(torch.int32)
    return out.view(1, 1, g, c)


class McSparsePolicy(Policy):
    """Exact token-level selection per query group; needs the dense pass's row LSE."""

    name = "mc_sparse"
    needs_lse = True

    def select(self, q, k, lse, layout, cfg, *, scale, backend) -> TokenSelection:
        return build_mc_sparse(q, k, lse, layout, cfg, scale=scale, backend=backend)
