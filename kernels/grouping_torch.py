"""Query grouping: principal-direction divisive partitioning with median splits (docs/method.md, "MC-Sparse")."""

from __future__ import annotations

import contextlib
import math

import torch

from ._torch_softmax import CHUNK_ELEMS
from .gather_torch import gather_rows

POWER_ITERS = 4  # started from the farthest point, a few iterations find the leading direction
SUBSAMPLE = 1024  # points a long segment's direction is estimated from (see _principal_order)
SUBSPACE_SAMPLE = 4096  # queries per head the leading subspace of group_queries(dims=...) is estimated from
SUBSPACE_ITERS = 6  # subspace iterations from a fixed random start (see project_leading)
GROUPING_DIMS = (0, 16, 32, 64)  # group_queries' dims: 0 = every coordinate
COVARIANCE_DIMS = 32  # points this narrow iterate on their covariance (see _leading_direction)
SCRATCH_FACTOR = 8  # the partition's scratch is at most this many copies of its points (cur, pts, moved, proj, ...)


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
    power iteration started from the point farthest from the mean. Returns fp32 (S, D), unit norm.

    Up to COVARIANCE_DIMS coordinates (the projected queries of ``group_queries(dims=...)``) each iteration
    multiplies by the segment's D x D covariance, formed in one pass over the points, instead of reading them
    twice an iteration: the same vector up to rounding (xc^T (xc v) = (xc^T xc) v) from 3 passes instead of 9.
    Wider points keep the two products: their covariance would cost D times more arithmetic."""
    far = torch.linalg.vector_norm(xc, dim=-1).argmax(1)  # deterministic start
    vec = xc[torch.arange(xc.shape[0], device=xc.device), far]
    cov = xc.transpose(1, 2) @ xc if xc.shape[-1] <= COVARIANCE_DIMS else None
    for _ in range(POWER_ITERS):
        vec = _back(xc, _project(xc, vec)) if cov is None else torch.bmm(cov, vec.unsqueeze(-1)).squeeze(-1)
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


def group_queries(q: torch.Tensor, group_size: int, dims: int = 0, gather=None, partition=None) -> torch.Tensor:
    """Partition each head's queries into groups of exactly ``group_size`` similar queries.

    Recursively projects every group on its leading principal direction (power iteration) and
    splits the sorted queries at a multiple of ``group_size`` next to the median, until each group
    holds ``group_size`` queries. Batched over B*H; deterministic; only the last group is padded.
    q: (B, H, N, D) any float dtype. dims: 0 partitions the queries themselves; 16, 32 or 64 (below D)
    partitions each head's queries projected on their ``dims`` leading principal directions
    (``project_leading``): every level of the partition then reads ``dims`` values per query instead of D
    (docs/kernel_notes.md, "v21"). gather: the row gather of each level, (rows fp32 (R, W), index int64 (M,))
    -> rows[index] (``gather_triton.gather_rows`` on CUDA), None for the twin ``gather_torch.gather_rows``.
    partition: what partitions the projected queries, (points fp32 (B, H, N, dims), group_size, gather) -> the
    groups, as ``_group(..., owned=True)`` (``grouping_graph.group_points`` on CUDA: the same operators replayed
    from a CUDA graph); None for ``_group``.
    Returns int32 (B, H, ceil(N/group_size), group_size): query indices per group, -1 padding the last group. Each
    sample of the batch is grouped alone, so its groups never depend on the samples beside it.
    Ops: gather, batched matmuls, norm, argsort(stable=True), index assignment, Cholesky — on q's device
    (CPU, CUDA, MPS); fp32 work (autocast off) in chunks of heads bounded by ``CHUNK_ELEMS``.
    """
    check_grouping_args(q, group_size, dims)
    if q.shape[0] > 1:
        # each sample alone: on the GPU the batched products and reductions round with the whole tensor's shape, so
        # cond and uncond batched grouped 32-66 % of their queries as each alone did (docs/kernel_notes.md, "v22")
        return torch.cat([group_queries(q[i:i + 1], group_size, dims, gather, partition) for i in range(q.shape[0])])
    with _without_autocast(q.device):  # fp32 products and projections even inside an autocast region
        if dims and dims < q.shape[-1]:  # a fresh fp32 tensor: _group may reorder it in place
            points = project_leading(q, dims)
            if partition is not None:
                return partition(points, group_size, gather or gather_rows)
            return _group(points, group_size, gather or gather_rows, owned=True)
        return _group(q, group_size, gather or gather_rows)


def scratch_bytes(shape: tuple, group_size: int, dims: int = 0, cuda: bool = True) -> int:
    """Device memory ``group_queries`` of queries of ``shape`` (B, H, N, D) takes while it runs, at most, in bytes (the
    samples are grouped one after the other, so one sample's), with every head's int64 order and int32 groups: the
    larger of
    - the projection's (with ``dims``, ``project_leading``): the fp32 points (H, N, dims), two fp32 copies of a chunk
      of heads' queries, their centred subsamples and covariances (fp32 and fp64, D x D a head);
    - the partition's (``_group``): SCRATCH_FACTOR copies of a chunk of heads' points (its working tensors; its chunks
      are larger on ``cuda``) beside the points themselves (all heads' with ``dims``, which stay alive throughout).
    group_size: queries per group (N is padded to a multiple of it). An estimate from above: at Wan 14B (40 heads x
    75 600 tokens, dims 16, groups of 128) 1.78 GB, where the grouping on a side stream kept 1.25 GB cached for that
    stream (docs/decisions.md, "The side stream's memory"); the partition's working tensors measured 3.3-5.3 copies of
    its chunk's points on the CPU."""
    _, h, n, d = shape
    width = dims if dims and dims < d else d
    n_pad = -(-n // group_size) * group_size  # as _group pads
    budget = CHUNK_ELEMS * (4 if cuda else 1)
    chunk = min(h, max(1, budget // max(1, n_pad * width * 2)))  # as _group's step
    work = chunk * n_pad * width * 4 * SCRATCH_FACTOR
    orders = h * n_pad * (8 + 4)  # perm_all and the groups
    if width == d:  # the points are a chunk's fp32 copy of the queries
        return chunk * n_pad * width * 4 + work + orders
    points = h * n * width * 4
    heads = min(h, max(1, CHUNK_ELEMS // max(1, n * d)))  # as project_leading's step
    sample = min(n, 2 * SUBSPACE_SAMPLE)  # leading_subspace's centred subsample, at most this many rows
    projection = points + 2 * heads * n * d * 4 + heads * (sample * d * 4 + d * d * (4 + 8))
    return max(projection, points + work) + orders


def check_grouping_args(q, group_size, dims) -> None:
    """ValueError unless q is a floating (B, H, N, D) tensor, group_size a positive int and dims in GROUPING_DIMS."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or not q.is_floating_point():
        raise ValueError("q must be a floating tensor of layout (B, H, N, D)")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if not isinstance(dims, int) or isinstance(dims, bool) or dims not in GROUPING_DIMS:
        raise ValueError(f"dims must be one of {GROUPING_DIMS}, got {dims!r}")


def _orthonormal(v: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of the columns of v fp64 (S, D, r), r <= D, by Cholesky QR: columns scaled to unit norm,
    G = v^T v = L L^T, v L^-T. Batched LAPACK / cuSOLVER calls that never wait for the GPU (cholesky_ex checks
    nothing on the host); a tiny diagonal shift keeps G positive definite when two columns are near parallel."""
    v = v / torch.linalg.vector_norm(v, dim=1, keepdim=True).clamp(min=1e-300)
    g = v.transpose(1, 2) @ v
    g = g + 1e-10 * torch.eye(g.shape[-1], dtype=g.dtype, device=g.device)
    lower = torch.linalg.cholesky_ex(g)[0]
    return torch.linalg.solve_triangular(lower, v.transpose(1, 2), upper=False).transpose(1, 2)


def subspace_device(dev: torch.device) -> torch.device:
    """Where the subspace iteration runs for queries on dev: there on CPU and CUDA; on the CPU for devices without
    float64 or batched Cholesky (Apple MPS), one small (S, D, D) copy each way and a wait for the device."""
    return dev if dev.type in ("cpu", "cuda") else torch.device("cpu")


def leading_subspace(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and covariance of each head's points, the inputs of ``project_leading``: x fp32 (S, N, D) -> mean fp32
    (S, 1, D) and covariance fp64 (S, D, D) on ``subspace_device`` of an even subsample of about SUBSPACE_SAMPLE
    points (the product in fp32, then widened)."""
    sub = x[:, ::max(1, x.shape[1] // SUBSPACE_SAMPLE)]
    mean = sub.mean(1, keepdim=True)
    c = sub - mean
    return mean, (c.transpose(1, 2) @ c).to(subspace_device(x.device), torch.float64)


_STARTS: dict = {}  # (D, dims, device) -> the fixed start of the subspace iteration


def _start(d: int, dims: int, dev: torch.device) -> torch.Tensor:
    """The subspace iteration's start: a fixed Gaussian fp64 (D, dims) matrix (seed 0), the same for every head and
    call. A start picked from the data (say the axes of largest variance) would be a discrete choice: two nearly
    equal variances could swap under rounding-level changes of q (cond and uncond batched or in separate calls) and
    move the groups. Made once per device: a tensor copied from host memory waits for the GPU's queue."""
    key = (d, dims, str(dev))
    start = _STARTS.get(key)
    if start is None:
        start = torch.randn(d, dims, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(dev)
        _STARTS[key] = start
    return start


def project_leading(q: torch.Tensor, dims: int) -> torch.Tensor:
    """Each head's queries, centred, in an orthonormal basis of their ``dims`` leading principal directions.

    q: (B, H, N, D) any float dtype, dims < D. Returns fp32 (B, H, N, dims). The basis comes from subspace
    iteration on the covariance of an even subsample of SUBSPACE_SAMPLE queries per head, started from a fixed
    random matrix (``_start``): SUBSPACE_ITERS products of a D x D matrix and Cholesky QRs in fp64 (on the CPU for
    devices without fp64, ``subspace_device``),
    no eigendecomposition (batched eigh of 128 x 128 matrices is a loop of solver calls on CUDA) and no host
    synchronisation. Distances inside the projection do not depend on which orthonormal basis of the subspace
    comes out, only on how well it holds the leading directions (docs/kernel_notes.md, "v21").
    """
    b, h, n, d = q.shape
    out = torch.empty((b * h, n, dims), dtype=torch.float32, device=q.device)
    qf = q.reshape(b * h, n, d)
    step = max(1, CHUNK_ELEMS // max(1, n * d))
    for h0 in range(0, b * h, step):
        x = qf[h0:h0 + step].float()
        mean, cov = leading_subspace(x)
        v = cov @ _start(d, dims, cov.device)
        for _ in range(SUBSPACE_ITERS - 1):
            v = cov @ _orthonormal(v)
        basis = _orthonormal(v).to(q.device, torch.float32)
        torch.bmm(x - mean, basis, out=out[h0:h0 + step])
    return out.view(b, h, n, dims)


def _without_autocast(dev: torch.device):
    """A context that turns autocast off on dev's type (a no-op where that type has no autocast)."""
    try:
        return torch.autocast(device_type=dev.type, enabled=False)
    except (RuntimeError, ValueError):
        return contextlib.nullcontext()


def _group(q: torch.Tensor, group_size: int, gather=gather_rows, owned: bool = False) -> torch.Tensor:
    """group_queries after its checks; owned: q is the caller's own scratch (the projection), which may change."""
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
        # the points in the order of perm (a padding slot holds a copy of the last query, which the masks ignore):
        # each level reorders points inside their own segment. Alone this measured no gain over gathering from the
        # original order (PyTorch's gather costs per row, local or not); it is the layout the Triton row gather was
        # timed with (docs/kernel_notes.md, "v21")
        if n_pad > n:
            cur = torch.cat([x, x[:, -1:].expand(nh, n_pad - n, d)], 1)
        else:
            # .float() of fp32 is q itself, which must not change; either way rows laid out densely for the views below
            cur = x.clone(memory_format=torch.contiguous_format) if x.dtype == q.dtype and not owned \
                else x.contiguous()
        perm = torch.arange(n_pad, device=dev).expand(nh, n_pad).clone()
        for li, level in enumerate(levels):
            last = li == len(levels) - 1  # the points are not needed after the last level
            for length, pos, n_segs in level:
                whole = n_segs * length == n_pad  # one bucket holding all segments in order: pos is arange(n_pad)
                ids = (perm if whole else perm[:, pos]).view(nh * n_segs, length)
                pts = (cur if whole else cur[:, pos]).view(nh * n_segs, length, d)
                real = ids < n if n_pad > n else None  # only a ragged N has padding slots
                order = _principal_order(pts, real)
                new_ids = torch.gather(ids, 1, order).view(nh, -1)
                moved = None
                if not last:
                    local = order + (torch.arange(nh * n_segs, device=dev) * length).view(-1, 1)
                    moved = gather(pts.reshape(-1, d), local.view(-1)).view(nh, -1, d)
                if whole:
                    perm = new_ids
                    cur = moved if moved is not None else cur
                else:
                    perm[:, pos] = new_ids
                    if moved is not None:
                        cur[:, pos] = moved
        perm_all[h0:h0 + nh] = perm
    perm_all = torch.where(perm_all < n, perm_all, torch.full_like(perm_all, -1))
    return perm_all.view(b, h, g, c).to(torch.int32)
