"""MC-Sparse policy (docs/method.md, "MC-Sparse"): query groups of exactly C queries, each with its own exact
token-level KV selection by group attention mass, computed at anchor steps.

Anchor selection = grouping + pass 2 (the group mass of every KV token, given the row LSE of the dense pass)
+ top-K per group and key segment. Groups never mix segments: each segment whose queries are sparse for some
key modality is grouped on its own, by "pca" (principal-direction median splits of each head's queries:
groups of similar queries) or "cuboid" (tiles of the segment's grid: no work at all, the same groups for
every head). A group keeps, in every key segment, the density of its modality pair times that segment's
tokens (all of them for a dense pair); the rows of segments dense for every key modality (text, by default)
are computed densely. Memory stays bounded by running pass 2 over a few heads at a time.
"""

from __future__ import annotations

import torch

from .. import kernels
from .block_geometry import SAMPLE, keep_bound, keep_top
from .config import SparseConfig
from .context import Span, TokenLayout
from .modalities import MODALITIES
from .policy import Policy
from .selection import LOW_PAD, SEGMENT, TokenSelection

MASS_CHUNK_BYTES = 1 << 30  # fp32 group-mass scratch per pass-2 chunk


def sparse_spans(n: int, layout: TokenLayout, cfg: SparseConfig) -> tuple[list[Span], list[list[float]], list[int]]:
    """The spans of n tokens, the density of each (query span, key span) pair, and the indices of the query spans
    that are sparse for some key span (those grouped)."""
    spans = layout.spans(n)
    table = cfg.densities.table(cfg.density)
    dens = [[table[MODALITIES.index(a.segment.modality)][MODALITIES.index(c.segment.modality)] for c in spans]
            for a in spans]  # [query segment][key segment]
    return spans, dens, [i for i, sp in enumerate(spans) if sp.length and min(dens[i]) < 1.0]


def build_mc_sparse(q, k, lse, layout: TokenLayout, cfg: SparseConfig, *, scale=None, backend="auto",
                    groups: dict | None = None, cap: bool = True) -> TokenSelection:
    """q, k: (B, H, N, D); lse: fp32 (B, H, N) row LSE of dense attention; groups: the query groups of sparse spans
    already made, {(start, stop): int32 (B or 1, H or 1, G, C)} as ``segment_groups`` returns them, or None (spans
    not in it are grouped here); cap: keep_top's cap on long rows (``keep_bound``), which makes the lists' width known
    on the host (the engine's way; False only for bench/threshold_cap.py's baseline). Returns a TokenSelection."""
    b, h, n, _ = q.shape
    dev = q.device
    spans, dens, sparse = sparse_spans(n, layout, cfg)
    dense_rows = torch.cat([torch.arange(sp.start, sp.stop, device=dev) for i, sp in enumerate(spans)
                            if i not in sparse] or [torch.zeros(0, dtype=torch.long, device=dev)])
    n_dense = dense_rows.numel()
    if not sparse:  # nothing but dense segments (text, references): every row dense
        empty = torch.zeros((b, h, 0, cfg.group_size), dtype=torch.int32, device=dev)
        counts = torch.zeros((b, h, 0), dtype=torch.int32, device=dev)
        return TokenSelection(empty, torch.zeros((b, h, 0, 0), dtype=torch.int16, device=dev),
                              torch.zeros((b, h, 0, max(1, -(-n // SEGMENT))), dtype=torch.int32, device=dev), counts,
                              dense_rows, 1.0, covers_all=True)
    parts_g, ranges = [], []  # groups per sparse query segment, and the group range each one takes
    for i in sparse:
        g_seg = (groups or {}).get((spans[i].start, spans[i].stop))
        if g_seg is None:
            g_seg = segment_groups(q, spans[i], cfg, backend)
        ranges.append((i, sum(p.shape[2] for p in parts_g), g_seg.shape[2]))
        parts_g.append(g_seg.expand(b, h, -1, -1))
    groups = torch.cat(parts_g, dim=2).contiguous()
    g = groups.shape[2]
    ranking = ranking_queries(groups, cfg)
    budgets = {(i, j): (None if dens[i][j] >= 1.0 else max(1, round(dens[i][j] * sp.length)))
               for i, _, _ in ranges for j, sp in enumerate(spans) if sp.length}
    # the most keys a group can keep (keep_top's keep_bound per key segment, a dense pair counting the whole segment):
    # the lists' width known on the host, so the selection never reads the counts back (docs/kernel_notes.md, "v27";
    # long key segments, L > 4 * SAMPLE, are capped at it by keep_top). cap=False: long rows uncapped, their width
    # read back once per chunk of heads (the baseline bench/threshold_cap.py times)
    bounds = [[sp.length if budgets[(i, j)] is None else
               keep_bound(budgets[(i, j)], sp.length) if cap or sp.length <= 4 * SAMPLE else None
               for j, sp in enumerate(spans) if sp.length] for i, _, _ in ranges]
    bound = None if any(x is None for row in bounds for x in row) else max(map(sum, bounds))
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (kv_low, seg_ends, counts) per chunk
    step = max(1, MASS_CHUNK_BYTES // max(1, g * n * 4))
    for h0 in range(0, h, step):
        sl = slice(h0, h0 + step)
        mass = kernels.group_kv_mass(q[:, sl], k[:, sl], lse[:, sl], ranking[:, sl],
                                     scale=scale, backend=backend, validate=False)
        regions = [(slice(g0, g0 + gn), slice(sp.start, sp.stop), budgets[(i, j)])
                   for i, g0, gn in ranges for j, sp in enumerate(spans) if sp.length]
        if len(regions) == 1 and regions[0][2] is not None:  # one segment (video alone): its mask is the whole
            keep = keep_top(mass, regions[0][2], backend=backend, cap=cap)  # no copy into a mask of the whole (~1.5 ms)
        else:
            keep = torch.empty(mass.shape, dtype=torch.bool, device=dev)
            for rows, cols, budget in regions:
                keep[:, :, rows, cols] = True if budget is None else keep_top(mass[:, :, rows, cols], budget,
                                                                               backend=backend, cap=cap)
        del mass
        parts.append(kernels.compact_keep(keep, segment=SEGMENT, width=bound, backend=backend))  # int16 lists at once
        del keep
    width = max(p[0].shape[-1] for p in parts)
    low = torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[-1]), value=LOW_PAD) for t, _, _ in parts],
                    dim=1)
    seg_ends = torch.cat([e for _, e, _ in parts], dim=1)
    counts = torch.cat([c for _, _, c in parts], dim=1)
    del parts
    real_q = (groups >= 0).sum(-1).double()
    density = ((real_q * counts.double()).sum() + b * h * n_dense * n) / (b * h * n * n)  # 0-d, left on the device
    # every span is grouped whole (segment_groups partitions it) or listed in dense_rows: every row is written
    return TokenSelection(groups, low, seg_ends, counts, dense_rows if n_dense else None, density, covers_all=True)


def ranking_queries(groups: torch.Tensor, cfg: SparseConfig) -> torch.Tensor:
    """The queries pass 2 sums to rank each group's keys: int32 (B, H, G, C) groups -> every (C / mass_queries)-th
    query of each group, int32 (B, H, G, mass_queries) (the groups themselves for mass_queries 0)."""
    return groups if not cfg.mass_queries else groups[..., ::cfg.group_size // cfg.mass_queries].contiguous()


def segment_groups(q, span: Span, cfg: SparseConfig, backend: str) -> torch.Tensor:
    """Query groups of one segment: int32 (B or 1, H or 1, G, C) of sequence positions inside the span, -1 pads
    (the last group of the segment is the only one padded)."""
    length, c = span.length, cfg.group_size
    if cfg.grouping == "cuboid":
        local = cuboid_order(span.segment.grid, length, c, q.device)
    else:
        local = kernels.group_queries(q[:, :, span.start:span.stop], c, dims=cfg.grouping_dims, backend=backend)
    return torch.where(local >= 0, local + span.start, local).to(torch.int32)


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


def cuboid_order(grid: tuple[int, int, int] | None, n_img: int, c: int, device) -> torch.Tensor:
    """Groups of c tokens of one segment that are neighbours in its grid: int32 (1, 1, ceil(n_img/c), c) of token
    positions (0-based within the segment; -1 pads the last group). Tokens are ordered tile by tile (raster order
    of tiles, raster order inside a tile) and cut every c tokens, so ragged edge tiles join their neighbours; a
    segment without a grid (or whose grid does not hold n_img tokens) is cut in sequence order."""
    grid = grid if grid is not None and grid[0] * grid[1] * grid[2] == n_img else None
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


def cuboid_groups(layout: TokenLayout, n_img: int, c: int, device) -> torch.Tensor:
    """cuboid_order over the grid of the layout's largest image segment (see cuboid_order)."""
    return cuboid_order(layout.grid, n_img, c, device)


class McSparsePolicy(Policy):
    """Exact token-level selection per query group; needs the dense pass's row LSE."""

    name = "mc_sparse"
    needs_lse = True

    def prepare(self, q, layout, cfg, *, backend) -> "PreparedGroups | None":
        """The "pca" query groups of every sparse span, made on a side stream while the anchor's dense call runs:
        their launches follow the dense call's, at ``select`` (docs/kernel_notes.md, "v23"); None for "cuboid" groups
        (no work) or no sparse span."""
        if cfg.grouping != "pca":
            return None
        spans, _, sparse = sparse_spans(q.shape[2], layout, cfg)
        if not sparse:
            return None
        # the spans are grouped one after the other: the longest one's scratch is what the work needs at most
        b, h, _, d = q.shape
        need = max(kernels.group_queries_scratch((b, h, spans[i].length, d), cfg.group_size, cfg.grouping_dims,
                                                 q.is_cuda) for i in sparse)
        return PreparedGroups(kernels.beside(
            lambda: {(spans[i].start, spans[i].stop): segment_groups(q, spans[i], cfg, backend) for i in sparse}, q,
            need_bytes=need))

    def select(self, q, k, lse, layout, cfg, *, scale, backend, prepared=None) -> TokenSelection:
        return build_mc_sparse(q, k, lse, layout, cfg, scale=scale, backend=backend,
                               groups=None if prepared is None else prepared.groups())


class PreparedGroups:
    """McSparsePolicy.prepare's query groups: ``groups()`` joins the side stream that makes them
    (kernels/side_stream.py) and returns {(start, stop): int32 (B, H, G, C)}, of the heads ``heads(index)`` chose
    (all of them by default)."""

    def __init__(self, pending, heads=None):
        self._pending, self._heads = pending, heads

    def heads(self, index) -> "PreparedGroups":
        """The groups of the heads ``index`` (a slice or an int64 index tensor over all the heads)."""
        if self._heads is not None:
            raise ValueError("PreparedGroups.heads: already a subset of the heads")
        return PreparedGroups(self._pending, index)

    def groups(self) -> dict:
        made = self._pending.result()
        if self._heads is None:
            return made
        return {span: g[:, self._heads] for span, g in made.items()}
