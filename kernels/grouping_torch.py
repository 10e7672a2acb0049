"""Query grouping: principal-direction divisive partitioning with median splits (docs/method.md, "MC-Sparse")."""

from __future__ import annotations

import contextlib
import math

import torch

from ._torch_softmax import CHUNK_ELEMS

POWER_ITERS = 4  # started from the farthest point, a few iterations find the leading direction
SUBSAMPLE = 1024  # points a long segment's direction is estimated from (see _principal_order)


def _split_plan(n_pad: int, c: int) -> list[list[tuple[int, int]]]:
    """Segments (start, length) per level; every length is a multiple of c; the last level is all c."""
    levels = []
    segs = [(0, n_pad)]
    while any(length > c for _, length in segs):
        levels.append(segs)
        nxt = []
        for start, length in segs:
            if length <= c:
                nxt.append((start, length))
                continue
            left = c * ((length // c) // 2)
            nxt += [(start, left), (start + left, length - left)]
        segs = nxt
    return levels


_LEVELS: dict = {}  # (n_pad, c, device) -> [[(length, pos, count), ...] per level]; see _level_positions


def _level_positions(n_pad: int, c: int, dev: torch.device) -> list[list[tuple[int, torch.Tensor, int]]]:
    """Per level of ``_split_plan(n_pad, c)``: (segment length, int64 positions of every segment of that length
    laid end to end, number of such segments), the positions on ``dev``. Built once per (n_pad, c, device): a
    tensor made from a host list is a copy that waits for the GPU's queue, and the plan is the same for every
    head, layer and step of a run."""
    key = (n_pad, c, str(dev))
    levels = _LEVELS.get(key)
    if levels is None:
        levels = []
        for segs in _split_plan(n_pad, c):
            by_len: dict[int, list[int]] = {}
            for start, length in segs:
                if length > c:
                    by_len.setdefault(length, []).append(start)
            levels.append([(length, (torch.tensor(starts, device=dev).view(-1, 1)
                                     + torch.arange(length, device=dev)).view(-1), len(starts))
                           for length, starts in by_len.items()])
        if len(_LEVELS) >= 64:  # a handful of sequence lengths per run; bounded all the same
            _LEVELS.clear()
        _LEVELS[key] = levels
    return levels


def _project(x: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
    """x (S, L, D) . vec (S, D) -> (S, L): ``einsum("sld,sd->sl")`` as the one batched matmul einsum makes of it,
    without einsum's ten permutes and views around it (host time: at a few thousand tokens the grouping is
    host-bound; docs/benchmarks.md, "The block plan kept"). Bit for bit einsum's result."""
    return torch.bmm(x, vec.unsqueeze(-1)).squeeze(-1)


def _back(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (S, L, D) weighted by w (S, L), summed over L -> (S, D): ``einsum("sld,sl->sd")`` as one batched matmul
    (bit for bit einsum's result, as ``_project``)."""
    return torch.bmm(x.transpose(1, 2), w.unsqueeze(-1)).squeeze(-1)


def _leading_direction(xc: torch.Tensor) -> torch.Tensor:
    """Leading principal direction of each segment's centred points xc fp32 (S, L, D) (padding slots zeroed):
    power iteration started from the point farthest from the mean. Returns fp32 (S, D), unit norm."""
    far = torch.linalg.vector_norm(xc, dim=-1).argmax(1)  # deterministic start
    vec = xc[torch.arange(xc.shape[0], device=xc.device), far]
    for _ in range(POWER_ITERS):
        vec = _back(xc, _project(xc, vec))
        vec = vec / vec.norm(dim=-1, keepdim=True).clamp(min=1e-30)
    return vec


def _principal_order(x: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
    """Order of the points of each segment along its leading principal direction.

    x: (S, L, D) fp32 points; real: bool (S, L), False for padding slots (which sort last), or None when
    every slot is a real point (no masking work). Returns (S, L) int64, a stable argsort of the projections.

    Segments longer than 2 x SUBSAMPLE points take their direction from an even subsample of about SUBSAMPLE
    points and read all their points only twice (the mean, the projection) instead of ~15 times (centring, the
    start point, eight power-iteration products, the projection): the top levels of the partition are most
    of the grouping's memory traffic, and about a thousand points fix the leading direction of a segment of
    75 600 (docs/kernel_notes.md, "v6").
    """
    s, length, _ = x.shape
    w = None if real is None else real.unsqueeze(-1).to(x.dtype)  # (S, L, 1)
    if length <= 2 * SUBSAMPLE:
        if w is None:
            xc = x - x.mean(1, keepdim=True)
        else:
            xc = (x - (x * w).sum(1, keepdim=True) / w.sum(1, keepdim=True).clamp(min=1.0)) * w
        vec = _leading_direction(xc)
        proj = _project(xc, vec)
    else:
        if w is None:
            mean = x.mean(1)
        else:  # one pass: a (1 x L) @ (L x D) product per segment
            mean = (w.transpose(1, 2) @ x).squeeze(1) / w.sum(1).clamp(min=1.0)
        stride = length // SUBSAMPLE
        xs = x[:, ::stride] - mean.unsqueeze(1)
        if w is not None:
            xs = xs * w[:, ::stride]
        vec = _leading_direction(xs)
        # (x - mean) . vec without writing x - mean (the mean's term is one constant per segment). fp32: group_queries
        # turns autocast off; under TF32 matmuls, which neither ComfyUI release turns on, a mean much larger than
        # the spread would cost the uncentred product x . vec precision
        proj = _project(x, vec) - (mean * vec).sum(-1, keepdim=True)
    if real is not None:
        proj = proj.masked_fill(~real, float("inf"))
    return torch.argsort(proj, dim=1, stable=True)


def group_queries(q: torch.Tensor, group_size: int) -> torch.Tensor:
    """Partition each head's queries into groups of exactly ``group_size`` similar queries.

    Recursively projects every group on its leading principal direction (power iteration) and
    splits the sorted queries at a multiple of ``group_size`` next to the median, until each group
    holds ``group_size`` queries. Batched over B*H; deterministic; only the last group is padded.
    q: (B, H, N, D) any float dtype. Returns int32 (B, H, ceil(N/group_size), group_size): query
    indices per group, -1 padding the last group.
    Ops: gather, batched matmuls, norm, argsort(stable=True), index assignment — on q's device
    (CPU, CUDA, MPS); fp32 work (autocast off) in chunks of heads bounded by ``CHUNK_ELEMS``.
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or not q.is_floating_point():
        raise ValueError("q must be a floating tensor of layout (B, H, N, D)")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    with _without_autocast(q.device):  # fp32 products and projections even inside an autocast region
        return _group(q, group_size)


def _without_autocast(dev: torch.device):
    """A context that turns autocast off on dev's type (a no-op where that type has no autocast)."""
    try:
        return torch.autocast(device_type=dev.type, enabled=False)
    except (RuntimeError, ValueError):
        return contextlib.nullcontext()


def _group(q: torch.Tensor, group_size: int) -> torch.Tensor:
    """group_queries after its checks."""
    b, h, n, d = q.shape
    c = group_size
    g = math.ceil(n / c)
    n_pad = g * c
    dev = q.device
    perm_all = torch.empty((b * h, n_pad), dtype=torch.int64, device=dev)
    qf = q.reshape(b * h, n, d)
    levels = _level_positions(n_pad, c, dev)
    budget = CHUNK_ELEMS * (4 if q.is_cuda else 1)  # GPU memory is plentiful next to a 1 GiB scratch
    step = max(1, budget // max(1, n_pad * d * 2))
    for h0 in range(0, b * h, step):
        x = qf[h0:h0 + step].float()
        nh = x.shape[0]
        rows = x.reshape(nh * n, d)
        head_base = (torch.arange(nh, device=dev) * n).view(nh, 1, 1)
        perm = torch.arange(n_pad, device=dev).expand(nh, n_pad).clone()
        for level in levels:
            for length, pos, n_segs in level:
                ids = perm[:, pos].view(nh, n_segs, length)
                # row gather (index_select) rather than an element-wise gather with an expanded index
                pts = rows.index_select(0, (ids.clamp(max=n - 1) + head_base).view(-1))
                real = (ids < n).view(-1, length) if n_pad > n else None  # only a ragged N has padding slots
                order = _principal_order(pts.view(nh * n_segs, length, d), real)
                perm[:, pos] = torch.gather(ids.view(-1, length), 1, order).view(nh, -1)
        perm_all[h0:h0 + nh] = perm
    perm_all = torch.where(perm_all < n, perm_all, torch.full_like(perm_all, -1))
    return perm_all.view(b, h, g, c).to(torch.int32)
