"""The query grouping's partition replayed from a CUDA graph (docs/kernel_notes.md, "v22").

The partition of ``grouping_torch._group`` is hundreds of small operators a call (~600 at Wan 14B: about 55 a level,
11 levels), so at moderate lengths the host launching them is its cost: at 16 384 tokens (24 heads) 17.6 ms as it
is, 5.7 ms replayed. It never waits for the GPU, its shapes follow only the points' shape, and every layer of an
anchor step calls it with the same shape, so from the second call of a shape its operators are replayed from one CUDA
graph: a copy of the points into the graph's input, one replay, a copy of the groups out. Up to MAX_TOKENS tokens:
beyond, the anchor's dense call, beside which the grouping runs (side_stream.py), hides its launches.

What a graph holds: its input (the points: fp32 (B, H, N, W), 25 MB at 24 heads x 16 384 tokens with W = 16), its output
(int32 groups, made before the capture) and the partition's scratch in a memory pool every graph of this module shares
(graphs never run at once; 336 MB reserved there under the native allocator, v22). ``release()`` frees them all; the
engine calls it at the end of every run and when it makes room after an out-of-memory error. A capture costs what
PyTorch's ``torch.cuda.graph`` does on entry (a device synchronisation and an ``empty_cache``) once a shape a run, under
this module's lock. Graphs assume the calls of one device are ordered on one stream (a replay and the next call's copy
into its input): the engine's anchors call it on the side stream of kernels/side_stream.py, which waits for the current
stream before each call and is waited for after it. At most ``MAX_GRAPHS`` shapes are kept (the oldest goes), and none
is made where free memory is short, inside another capture, or under SPARSE_ATTN_GROUPING_GRAPH=0 (read at each call):
the call then runs as it is.

Under PyTorch's cudaMallocAsync backend (ComfyUI's default allocator) the graph gathers each level's rows with
PyTorch's ``index_select`` (``gather_torch.gather_rows``) instead of the Triton kernel the caller passes: Triton's
launcher refuses a pointer that a capture allocated under that backend ("cannot be accessed from Triton"), so the
capture failed there, and freeing the failed capture's tensors aborted the process (docs/kernel_notes.md, "v25" and
"v27"). Replayed with PyTorch's gathers the partition gives the same groups, and an mc_sparse anchor at 4 608 tokens
(24 heads) takes 7.0-8.7 ms instead of 13.5-15.1 ms without a graph, as under the native allocator (8.7-9.2 against
15.9-17.6 ms); at 16 384 tokens, where the grouping hides beside the anchor's dense call, 22.4 against 21.4 ms
(H100, docs/kernel_notes.md, "v28"). The graph's output is allocated before the capture and written by a copy inside
it, so nothing the capture allocated outlives it (an output allocated inside was freed outside the capture at
``release()``, which PyTorch warns of under that backend).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict

import torch

from . import gather_torch, grouping_torch
from .side_stream import async_allocator

log = logging.getLogger(__name__)

MAX_GRAPHS = 4  # shapes kept (cond and uncond batched or apart, two experts' layouts: a run has one or two)
# longer sequences run as they are: there the anchor's dense call, beside which the grouping runs (side_stream.py),
# takes longer than the grouping takes to launch, so the launches hide behind it. With the side stream (v23) the anchor
# at 16 384 tokens (24 heads) is as fast without the graph as with it (native 21.97 / 21.83 against 21.92 / 21.33 ms;
# cudaMallocAsync 21.36 against 22.37, one run each, 1 ms where the native pairs spread by 0.6 ms), while at 4 608
# tokens the graph halves it (docs/kernel_notes.md, "v28"): the cap is the measured size where the gain had ended.
# Beyond, a graph would hold its pool through the run for nothing: ~1 GB at Wan 14B 480p (40 heads x 32 760 tokens),
# on the cards whose residual cache needs it most. (v22, before the side stream, kept graphs up to 49 152 tokens.)
MAX_TOKENS = 16384


class _Graph:
    """One captured partition: ``points`` the input the graph reads, ``groups`` the output it writes, ``keep`` the
    tensors its operators read that live outside it (the level positions)."""

    __slots__ = ("graph", "points", "groups", "keep")

    def __init__(self, graph, points, groups, keep):
        self.graph, self.points, self.groups, self.keep = graph, points, groups, keep

    def free(self) -> None:
        """Drop the tensors, then the graph (idempotent). Tensors first: left to the collector, the graph went first
        (slots are cleared in sorted name order), and a tensor a graph uses should not outlive it."""
        self.groups = self.points = self.keep = None
        graph, self.graph = self.graph, None
        if graph is not None:
            graph.reset()

    def __del__(self):
        try:
            self.free()
        except Exception:  # noqa: BLE001 - at interpreter exit torch may be torn down first; the driver frees it all
            pass


_graphs: OrderedDict = OrderedDict()  # key -> _Graph, oldest first
_seen: set = set()  # keys called once: the first call of a shape runs as it is (it compiles and caches)
_refused: set = set()  # keys whose capture failed: they run as they are until release() (the run's end)
_pool = None  # the memory pool every graph shares
_lock = threading.Lock()


def enabled() -> bool:
    """Whether graphs may be made (SPARSE_ATTN_GROUPING_GRAPH, read at each call): "0" never, else (the default "1";
    "force", which earlier versions needed under cudaMallocAsync, means the same) always, under either allocator
    (docs/kernel_notes.md, "v28")."""
    return os.environ.get("SPARSE_ATTN_GROUPING_GRAPH", "1") != "0"


def graph_gather(gather):
    """The row gather a graph captures, (rows fp32 (R, W), index int64 (M,)) -> rows[index]: the caller's, or under
    PyTorch's cudaMallocAsync backend ``gather_torch.gather_rows`` (Triton's launcher refuses the capture's own
    allocations there; see the module's docstring). Both gather the same rows exactly."""
    return gather_torch.gather_rows if async_allocator() else gather


def _key(points: torch.Tensor, group_size: int, gather) -> tuple:
    return tuple(points.shape), str(points.device), group_size, gather


def _room(points: torch.Tensor) -> bool:
    """Whether the device has room for a graph of these points: free memory (the driver's plus what PyTorch holds
    unused) at least twice the graph's input and scratch."""
    free, _ = torch.cuda.mem_get_info(points.device)
    unused = torch.cuda.memory_reserved(points.device) - torch.cuda.memory_allocated(points.device)
    need = points.numel() * points.element_size() * (1 + grouping_torch.SCRATCH_FACTOR)
    return free + unused >= 2 * need


def group_points(points: torch.Tensor, group_size: int, gather) -> torch.Tensor:
    """``grouping_torch._group(points, group_size, gather, owned=True)``, replayed from a CUDA graph where it can be.

    points: fp32 (B, H, N, W) contiguous, on CUDA, the caller's scratch (it may change); group_size: queries per
    group; gather: the row gather of each level (as ``_group``'s; a graph captures ``graph_gather(gather)``, the same
    rows). Returns int32 (B, H, ceil(N / group_size),
    group_size), the same groups as ``_group`` (the graph replays its operators). Off CUDA, beyond MAX_TOKENS, inside
    another capture, when disabled, at a shape's first call, where memory is short or after a failed capture:
    ``_group`` itself.
    """
    if (not points.is_cuda or not enabled() or not points.is_contiguous() or points.shape[2] > MAX_TOKENS
            or torch.cuda.is_current_stream_capturing()):
        return grouping_torch._group(points, group_size, gather, owned=True)
    # worker threads of a multi-GPU run share this module's graphs (their keys differ by device); a graph is captured
    # and replayed with its device current
    captured = graph_gather(gather)
    key = _key(points, group_size, captured)
    with _lock, torch.cuda.device(points.device):
        entry = None if key in _refused else _graphs.get(key)
        if entry is None and key in _seen and key not in _refused and _room(points):
            entry = _capture(points, group_size, captured, key)
        if entry is not None:
            # on the device's current stream, in order: the next call's copy into entry.points follows this clone
            _graphs.move_to_end(key)
            entry.points.copy_(points)
            entry.graph.replay()
            return entry.groups.clone()
        _seen.add(key)
    return grouping_torch._group(points, group_size, gather, owned=True)


def _capture(points: torch.Tensor, group_size: int, gather, key) -> _Graph | None:
    """Capture the partition of points' shape: a warm-up on a side stream (as PyTorch asks before a capture), then
    the capture, reading a copy of the points. None (and the key refused from then on) when the capture fails."""
    global _pool
    while len(_graphs) >= MAX_GRAPHS:
        _graphs.popitem(last=False)[1].free()
    b, h, n, _ = points.shape
    n_pad = -(-n // group_size) * group_size
    keep = grouping_torch._level_positions(n_pad, group_size, points.device)
    static = points.clone()
    side = torch.cuda.Stream(device=points.device)
    side.wait_stream(torch.cuda.current_stream(points.device))
    try:
        with torch.cuda.stream(side):
            warm = grouping_torch._group(static.clone(), group_size, gather, owned=True)
        torch.cuda.current_stream(points.device).wait_stream(side)
        # the output on the caller's stream, as the input: the stream every replay and copy of this graph runs on
        groups = torch.empty(warm.shape, dtype=warm.dtype, device=points.device)
        del warm
        if _pool is None:
            _pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: another worker thread's work on its own GPU during the capture is not an error
        with torch.cuda.graph(graph, pool=_pool, capture_error_mode="thread_local"):
            # into the output made before the capture: every tensor the capture allocates is freed inside it
            groups.copy_(grouping_torch._group(static, group_size, gather, owned=True))
    except Exception as exc:  # a capture that fails leaves the call to run as it is, never the run to end
        _refused.add(key)
        log.warning("sparse attention: the query grouping of shape %s runs without a CUDA graph (%s: %s)",
                    tuple(points.shape), type(exc).__name__, exc)
        torch.cuda.synchronize(points.device)
        return None
    entry = _Graph(graph, static, groups, keep)
    _graphs[key] = entry
    log.debug("sparse attention: the query grouping of shape %s captured in a CUDA graph", tuple(points.shape))
    return entry


def release() -> bool:
    """Free every graph, its input and the shared pool's memory (the next call of a shape runs as it is and captures
    again at the one after). Returns whether any graph or pool was dropped (memory may have come back)."""
    global _pool
    with _lock:
        dropped = bool(_graphs) or _pool is not None
        for entry in _graphs.values():
            entry.free()
        _graphs.clear()
        _seen.clear()
        _refused.clear()  # a capture refused (for want of memory, say) is tried again in the next run
        _pool = None
    if dropped and torch.cuda.is_available():
        torch.cuda.empty_cache()
    return dropped
