"""Token and block geometry of a segmented token layout (engine/context.py), and the row-wise selections the
policies share.

Each token belongs to one segment; its position is taken in that segment's own grid. Blocks of the block
policies cut across segment boundaries, so a block is described by the modalities it holds (which decide the
forced, dense pairs: docs/method.md, "Modalities") and by the segment holding most of its tokens (its owner:
the budget it counts in and the position it is measured at). Within one segment, distances are Chebyshev
distances in the grid (frames weighted by ``temporal_weight``); between segments, positions are compared as
shares of each segment's extent along the axes both segments have (frames or time, rows, columns), so a video
block's audio window follows the video's time.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .. import kernels
from .context import Span, TokenLayout
from .modalities import MODALITIES


@dataclass
class TokenMap:
    """Per token of a sequence of N tokens placed by a layout.

    spans: the layout's segments placed in the sequence; seg: int64 (N,) segment index; modality: int64 (N,)
    index into MODALITIES; coords: float32 (N, 3) position (frame, row, col) in its segment's grid (1-D
    segments: (0, 0, position)); unit: float32 (N, 3) the same position as a share of the segment's extent
    along each axis (1-D segments: time on the first axis); axes: bool (S, 3) the axes along which each
    segment extends (a grid axis longer than 1; the first axis of a 1-D segment).
    """

    spans: tuple[Span, ...]
    seg: torch.Tensor
    modality: torch.Tensor
    coords: torch.Tensor
    unit: torch.Tensor
    axes: torch.Tensor

    @property
    def segment_modality(self) -> list[int]:
        return [MODALITIES.index(sp.segment.modality) for sp in self.spans]


def token_map(n: int, layout: TokenLayout, device) -> TokenMap:
    """The TokenMap of n tokens under ``layout`` (ValueError when the layout does not fit n)."""
    spans = layout.spans(n)
    seg = torch.empty(n, dtype=torch.long, device=device)
    modality = torch.empty(n, dtype=torch.long, device=device)
    coords = torch.zeros((n, 3), dtype=torch.float32, device=device)
    unit = torch.zeros((n, 3), dtype=torch.float32, device=device)
    axes = torch.zeros((max(1, len(spans)), 3), dtype=torch.bool, device=device)
    for i, sp in enumerate(spans):
        a, b = sp.start, sp.stop
        seg[a:b] = i
        modality[a:b] = MODALITIES.index(sp.segment.modality)
        pos = torch.arange(b - a, device=device, dtype=torch.float32)
        grid = sp.segment.grid
        if grid is not None:
            f, h, w = grid
            fi, hi, wi = torch.div(pos, h * w, rounding_mode="floor"), torch.div(pos, w, rounding_mode="floor") % h, \
                pos % w
            coords[a:b, 0], coords[a:b, 1], coords[a:b, 2] = fi, hi, wi
            unit[a:b, 0], unit[a:b, 1], unit[a:b, 2] = (fi + 0.5) / f, (hi + 0.5) / h, (wi + 0.5) / w
            axes[i] = torch.tensor([f > 1, h > 1, w > 1], device=device)
        else:
            coords[a:b, 2] = pos
            unit[a:b, 0] = (pos + 0.5) / max(1, b - a)
            axes[i, 0] = True
    return TokenMap(spans, seg, modality, coords, unit, axes)


@dataclass
class Blocks:
    """Blocks of ``size`` tokens over a TokenMap. has: bool (nb, 4) the modalities present in each block;
    owner: int64 (nb,) the segment holding most of its tokens (the first of them on a tie); centre: float32
    (nb, 3) centroid of the owner's tokens in grid coordinates; unit: float32 (nb, 3) the same in shares of
    the owner's extent."""

    has: torch.Tensor
    owner: torch.Tensor
    centre: torch.Tensor
    unit: torch.Tensor


def blocks_of(tm: TokenMap, size: int) -> Blocks:
    n = tm.seg.shape[0]
    nb = math.ceil(n / size)
    pad = nb * size - n
    n_seg = max(1, len(tm.spans))
    seg = torch.nn.functional.pad(tm.seg, (0, pad), value=n_seg)  # padding: a segment of its own, dropped below
    per_seg = torch.nn.functional.one_hot(seg, n_seg + 1)[:, :n_seg].view(nb, size, n_seg).sum(1)
    owner = per_seg.argmax(-1)
    mod = torch.nn.functional.pad(tm.modality, (0, pad), value=len(MODALITIES))
    has = torch.nn.functional.one_hot(mod, len(MODALITIES) + 1)[:, :len(MODALITIES)].view(nb, size, -1).any(1)
    mine = (seg.view(nb, size) == owner.unsqueeze(-1)).float()
    cnt = mine.sum(1, keepdim=True).clamp(min=1)

    def centroid(x):
        x = torch.nn.functional.pad(x, (0, 0, 0, pad)).view(nb, size, 3)
        return (x * mine.unsqueeze(-1)).sum(1) / cnt
    return Blocks(has, owner, centroid(tm.coords), centroid(tm.unit))


def nearness(tm: TokenMap, bq: Blocks, bk: Blocks, temporal_weight: float) -> torch.Tensor:
    """Static proximity score (nqb, nkb), higher = nearer: minus the Chebyshev distance between block centres,
    in grid units with frames weighted by ``temporal_weight`` when both blocks belong to the same segment, in
    shares of each segment's extent along their common axes otherwise (0 when they share no axis)."""
    dev = bq.owner.device
    weight = torch.tensor([temporal_weight, 1.0, 1.0], device=dev)
    same = bq.owner.unsqueeze(1) == bk.owner.unsqueeze(0)
    within = ((bq.centre.unsqueeze(1) - bk.centre.unsqueeze(0)).abs() * weight).amax(-1)
    common = (tm.axes[bq.owner].unsqueeze(1) & tm.axes[bk.owner].unsqueeze(0)).float()
    across = ((bq.unit.unsqueeze(1) - bk.unit.unsqueeze(0)).abs() * common).amax(-1)
    return -torch.where(same, within, across)


@dataclass
class BlockPlan:
    """What the block policies need for one layout: forced bool (nqb, nkb) — pairs kept whatever the scores
    (a dense modality pair present in both blocks, or a sink block); near float32 (nqb, nkb) static proximity
    (higher = nearer); owner int64 (nkb,) the key segment each KV block counts in; counts int64 (nqb, S) KV blocks
    kept per query block and key segment (forced ones included); dense_pair float32 (nqb, S): 1 where the query
    block keeps every block of that key segment.

    Read once when the plan is built, so that no anchor reads them from the device again (docs/kernel_notes.md,
    "v27"): seg_cols, int64 (nkb_s,) the KV blocks of each key segment; seg_widths, the largest of ``counts`` per key
    segment; width, the largest total over the key segments; density, the fraction of (query, key) pairs the counts
    keep, each kept block counted at the mean size of its segment's blocks (exact but for a ragged last block)."""

    forced: torch.Tensor
    near: torch.Tensor
    owner: torch.Tensor
    counts: torch.Tensor
    dense_pair: torch.Tensor
    seg_cols: tuple
    seg_widths: tuple
    width: int
    density: float


PLANS_KEPT = 32  # block plans kept per process (one per token count, layout, block size, density and device) ...
PLAN_BYTES_KEPT = 64 << 20  # ... and at most this many bytes of them besides the newest (a plan at Wan 14B 720p
# with 64-token blocks holds ~7 MB of device memory, mostly the static nearness map)
_plans: OrderedDict = OrderedDict()


def block_plan(n: int, layout: TokenLayout, cfg, device, scale: float = 1.0) -> BlockPlan:
    """The block plan of n tokens under ``layout`` with blocks cfg.block_q x cfg.block_k. Each query block keeps,
    per key segment, the density of its modality pair (the largest over the modalities the block holds) times
    the segment's blocks (at least one); ``scale`` multiplies every density below 1 (the hybrid policy's static
    half).

    The plan depends on the geometry and the configuration alone, not on q or k, and every layer's anchor asks for
    the same one: it is built once and kept, within PLANS_KEPT and PLAN_BYTES_KEPT (its 184 small operations were
    most of a block_topk anchor's host time at a few thousand tokens; docs/benchmarks.md, "The block plan kept").
    Callers must not write into its tensors."""
    return kept_plan("plan", n, layout, cfg, device, scale, lambda: _build_plan(n, layout, cfg, device, scale))


def kept_plan(kind: str, n: int, layout: TokenLayout, cfg, device, scale: float, build) -> BlockPlan:
    """The ``kind`` of plan kept for these arguments, or ``build()``'s, kept from then on within PLANS_KEPT and
    PLAN_BYTES_KEPT (the oldest go first). Of cfg only what a plan depends on is in the key."""
    key = (kind, n, layout, cfg.block_q, cfg.block_k, tuple(map(tuple, cfg.densities.table(cfg.density))),
           cfg.sink_blocks, cfg.temporal_weight, torch.device(device), scale)
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = build()
        while len(_plans) > 1 and (len(_plans) > PLANS_KEPT or sum(map(_plan_bytes, _plans.values())) >
                                   PLAN_BYTES_KEPT + _plan_bytes(plan)):
            _plans.popitem(last=False)
    else:
        _plans.move_to_end(key)
    return plan


def _plan_bytes(plan: "BlockPlan") -> int:
    return sum(t.numel() * t.element_size() for t in (plan.forced, plan.near, plan.owner, plan.counts, plan.dense_pair))


def _build_plan(n: int, layout: TokenLayout, cfg, device, scale: float) -> BlockPlan:
    tm = token_map(n, layout, device)
    bq, bk = blocks_of(tm, cfg.block_q), blocks_of(tm, cfg.block_k)
    table = torch.tensor(cfg.densities.table(cfg.density), dtype=torch.float32, device=device)
    dense_mods = (table >= 1.0).float()
    table = torch.where(table >= 1.0, table, table * scale)
    forced = (bq.has.float() @ dense_mods @ bk.has.float().T) > 0
    n_seg = len(tm.spans)
    seg_mod = torch.tensor(tm.segment_modality, device=device)
    # density per (query block, key segment): the largest over the modalities the query block holds
    d_row = (bq.has.float().unsqueeze(-1) * table[:, seg_mod].unsqueeze(0)).amax(1)
    onehot = torch.nn.functional.one_hot(bk.owner, n_seg).float()  # (nkb, S)
    for s, sp in enumerate(tm.spans):  # sink blocks: the first KV blocks of every image segment, for every query
        if sp.segment.modality == "image" and cfg.sink_blocks:
            sinks = torch.nonzero(bk.owner == s).view(-1)[:cfg.sink_blocks]
            forced[:, sinks] = True
    per_seg = onehot.sum(0)  # (S,) KV blocks owned
    n_forced = forced.float() @ onehot  # (nqb, S)
    dense_pair = (d_row >= 1.0).float()
    budget = torch.where(d_row >= 1.0, per_seg.expand_as(d_row), (d_row * per_seg).round().clamp(min=1))
    counts = torch.minimum(torch.maximum(budget, n_forced), per_seg.expand_as(d_row)).long()
    return BlockPlan(forced, nearness(tm, bq, bk, cfg.temporal_weight), bk.owner, counts, dense_pair,
                     *_host_facts(n, bk.owner, counts, cfg.block_q, cfg.block_k))


def with_forced(plan: BlockPlan, forced: torch.Tensor, n: int, block_q: int, block_k: int) -> BlockPlan:
    """``plan`` with more forced pairs: forced bool (nqb, nkb), a superset of plan.forced; each (query block, key
    segment) keeps at least its forced blocks (counts raised to them where they would not fit: never for the hybrid
    policy's windows, which count the plan's forced blocks at half its density), and the host facts are read again
    (once: callers keep the result, as the hybrid policy does)."""
    onehot = torch.nn.functional.one_hot(plan.owner, plan.counts.shape[-1]).to(torch.float32)  # (nkb, S)
    counts = torch.maximum(plan.counts, (forced.to(onehot.dtype) @ onehot).long())
    return BlockPlan(forced, plan.near, plan.owner, counts, plan.dense_pair,
                     *_host_facts(n, plan.owner, counts, block_q, block_k))


def block_sizes(n: int, block: int, device) -> torch.Tensor:
    """Tokens in each of the ceil(n / block) blocks of n tokens: float64 (nb,), ``block`` but for a ragged last one.
    Made without a host synchronisation (``t[-1] = x`` copies a host scalar onto the device; docs/kernel_notes.md,
    "v27")."""
    nb = -(-n // block)
    sizes = torch.full((nb,), float(block), dtype=torch.float64, device=device)
    return sizes.masked_fill_(torch.arange(nb, device=device) == nb - 1, float(n - (nb - 1) * block))


def _host_facts(n: int, owner: torch.Tensor, counts: torch.Tensor, block_q: int, block_k: int) -> tuple:
    """A plan's (seg_cols, seg_widths, width, density): its few host reads, made once per plan."""
    n_seg, dev = counts.shape[-1], counts.device
    seg_cols = tuple(torch.nonzero(owner == s).view(-1) for s in range(n_seg))
    kv_size = block_sizes(n, block_k, dev)
    mean_block = torch.stack([kv_size[c].mean() if c.numel() else kv_size.new_zeros(()) for c in seg_cols])
    q_rows = block_sizes(n, block_q, dev)
    density = float((q_rows.unsqueeze(-1) * counts.double() * mean_block).sum() / (n * n)) if n else 1.0
    widths = counts.amax(0).tolist() if counts.numel() else [0] * n_seg
    width = int(counts.sum(-1).max()) if counts.numel() else 0
    return seg_cols, tuple(int(w) for w in widths), width, density


def rows_topk_by_segment(scores: torch.Tensor, owner: torch.Tensor, counts: torch.Tensor,
                         plan: BlockPlan | None = None, plan_counts: bool = True):
    """Per row and key segment, the ``counts`` highest-scoring columns of that segment, merged and sorted.

    scores: float (..., R, L) (+inf marks forced entries); owner: int64 (L,) segment of each column; counts:
    int (..., R, S) columns kept per row and segment. Returns (indices int32 (..., R, K) sorted with -1 past
    each count, counts int32 (..., R)). ``plan``: the BlockPlan ``owner`` is the owner of: its segments' columns
    spare a host read each; with ``plan_counts`` (counts equal to its own, expanded over leading dims) its widths
    spare the rest (no synchronisation). None: everything read from the device.
    """
    widths = plan is not None and plan_counts
    n_seg = counts.shape[-1]
    if n_seg == 1:
        return rows_topk(scores, counts[..., 0], plan.seg_widths[0] if widths else None)
    length = scores.shape[-1]
    parts, totals = [], []
    for s in range(n_seg):
        cols = torch.nonzero(owner == s).view(-1) if plan is None else plan.seg_cols[s]
        if cols.numel() == 0:
            continue
        idx, cnt = rows_topk(scores[..., cols], counts[..., s], plan.seg_widths[s] if widths else None)
        parts.append(torch.where(idx >= 0, cols[idx.clamp(min=0).long()].to(torch.int32), idx))
        totals.append(cnt)
    merged = torch.cat(parts, -1)
    total = torch.stack(totals, -1).sum(-1).to(torch.int32)
    merged = torch.sort(torch.where(merged < 0, torch.full_like(merged, length), merged), dim=-1).values
    width = plan.width if widths else (int(total.max()) if total.numel() else 0)
    merged = merged[..., :width]
    return torch.where(merged == length, torch.full_like(merged, -1), merged).contiguous(), total


def rows_topk(scores: torch.Tensor, counts: torch.Tensor,
              width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the ``counts`` highest-scoring columns, sorted ascending.

    scores: float (..., L) (+inf marks forced entries); counts: int (...) in [0, L]; width: max(counts) when the
    caller knows it on the host (no synchronisation), else None (read from the device).
    Returns (indices int32 (..., K) with -1 past each count, counts int32 (...)), K = max(counts).
    """
    length = scores.shape[-1]
    counts = counts.clamp(0, length)
    if width is None:
        width = int(counts.max()) if counts.numel() else 0
    width = min(width, length)
    if width == 0:
        return (torch.full((*scores.shape[:-1], 0), -1, dtype=torch.int32, device=scores.device),
                counts.to(torch.int32))
    top = torch.topk(scores, width, dim=-1, sorted=True).indices
    keep = torch.arange(width, device=scores.device) < counts.unsqueeze(-1)
    idx = torch.sort(torch.where(keep, top, torch.full_like(top, length)), dim=-1).values
    idx = torch.where(idx == length, torch.full_like(idx, -1), idx)
    return idx.to(torch.int32), counts.to(torch.int32)


SAMPLE = 4096
CAP_SIGMAS = 3.0  # keep_top's long rows keep at most k plus this many standard deviations of the sampled count


def _sample_rank(k: int, length: int) -> int:
    """The rank among SAMPLE sampled columns whose value estimates a long row's k-th largest."""
    return max(1, min(SAMPLE, round(k * SAMPLE / length)))


def keep_bound(k: int, length: int) -> int:
    """The most entries ``keep_top(scores, k)`` keeps in a row of ``length`` (+inf entries aside), known on the host:
    k for short rows (L <= 4 * SAMPLE: bisection to exactly k); for long rows k plus CAP_SIGMAS standard deviations
    of a random sample's count (relative deviation 1 / sqrt(rank), rank = k * SAMPLE / L: k * 1.15 at Wan 14B's
    d = 0.1, k * 1.21 at 0.05), which keep_top enforces (a row over it has its threshold raised exactly). It sizes the
    compact lists without reading their counts back (docs/kernel_notes.md, "v27"). The strided sample is not random:
    at Wan 14B the widest uncapped row kept 1.44 k (docs/benchmarks.md, "What the per-layer times showed"), so more
    rows than a random sample's ~0.1 % may meet the cap (bench/threshold_cap.py counts them)."""
    k = max(0, min(int(k), length))
    if length <= 4 * SAMPLE or k in (0, length):
        return k
    return min(length, k + math.ceil(CAP_SIGMAS * k / math.sqrt(_sample_rank(k, length))))


def keep_top(scores: torch.Tensor, k: int, iters: int = 20, *, backend: str = "auto",
             cap: bool = True) -> torch.Tensor:
    """About the ``k`` largest entries of each row, as a mask, without a full top-k.

    scores: float (..., L) >= 0, any strides (+inf marks forced entries). Returns bool (..., L). Each row keeps
    the entries above a threshold: for short rows (L <= 4 * SAMPLE) found by bisection in log space so the
    count is exactly k; for long rows estimated from a fixed sample of SAMPLE columns (the k*SAMPLE/L-th
    largest sampled value), one pass instead of ~20, so the count is k up to sampling noise (a few %), and at most
    ``keep_bound(k, L)``: a row over it keeps its largest entries instead, at most ``keep_bound`` (fewer where values
    tie at the (keep_bound + 1)-th largest; its threshold raised exactly, in the threshold kernel; ``cap=False``
    leaves long rows uncapped, for bench/threshold_cap.py).
    Entries tied at the threshold fill the row up to k in index order (k equal keys beyond the budget keep k
    of them, never none). backend: where long rows apply their threshold (``kernels.keep_at_threshold``: on CUDA
    one Triton pass per row with no host synchronisation, docs/kernel_notes.md, "v21").
    """
    length = scores.shape[-1]
    k = max(0, min(int(k), length))
    if k == 0:
        return torch.isinf(scores)
    if k == length:
        return torch.ones(scores.shape, dtype=torch.bool, device=scores.device)
    if length > 4 * SAMPLE:
        step = length / SAMPLE
        cols = (torch.arange(SAMPLE, device=scores.device, dtype=torch.float64) * step + step / 2).long()
        thresh = torch.topk(scores[..., cols], _sample_rank(k, length), dim=-1).values[..., -1:]
        return kernels.keep_at_threshold(scores, thresh, k, cap=keep_bound(k, length) if cap else None,
                                         backend=backend)
    finite = torch.where(torch.isinf(scores), torch.zeros_like(scores), scores)
    top = finite.amax(-1, keepdim=True).clamp(min=1e-30)
    lo = torch.log(top) - 46.0  # e^-46 ~ 1e-20 of the row's largest value
    hi = torch.log(top)
    for _ in range(iters):
        mid = (lo + hi) / 2
        over = (scores > torch.exp(mid)).sum(-1, keepdim=True) > k
        lo = torch.where(over, mid, lo)
        hi = torch.where(over, hi, mid)
    above = scores > torch.exp(hi)  # at most k entries (or every forced one)
    tied = (scores > torch.exp(lo)) & ~above  # the band the bisection could not split: equal values
    room = (k - above.sum(-1, keepdim=True)).clamp(min=0)
    return above | (tied & (torch.cumsum(tied, dim=-1, dtype=torch.int32) <= room))


def compact_rows(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept columns of each row, in order: keep bool (R, L) -> (indices int32 (R, W) with -1 past each
    count, counts int32 (R,)), W = max count. Compacted with a cumulative sum and a scatter: linear passes
    instead of sorting every row, which matters at L = 75k tokens and thousands of rows."""
    r, length = keep.shape
    pos = torch.cumsum(keep, dim=-1, dtype=torch.int32) - 1
    counts = keep.sum(-1).to(torch.int32)
    width = int(counts.max()) if counts.numel() else 0
    out = torch.full((r, width + 1), -1, dtype=torch.int32, device=keep.device)
    cols = torch.arange(length, dtype=torch.int32, device=keep.device).expand(r, length)
    out.scatter_(1, torch.where(keep, pos, width).long(), cols)
    return out[:, :width].contiguous(), counts


def rows_above_threshold(scores: torch.Tensor, k: int, iters: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    """About the ``k`` largest entries of each row of scores float (R, L) >= 0 (+inf forced), sorted ascending:
    ``keep_top`` then ``compact_rows``."""
    return compact_rows(keep_top(scores, k, iters))
