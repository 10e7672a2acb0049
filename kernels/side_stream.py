"""Work that runs on a side stream beside what the current stream was given in the meantime (docs/kernel_notes.md,
"v23").

The mc_sparse anchor's query grouping reads only the queries, yet ran after the dense call whose row LSE pass 2
needs. Its many small operators leave SMs idle between and at the tails of its kernels; on a side stream of the
highest priority, launched just after the dense call, they take SMs as the dense call's programs finish, and the
dense call fills the rest (Wan 14B: 218.2 ms for the two in order, 212.9 beside each other). The order of launches
matters: launched before the dense call, the grouping's ~600 launches hold the dense call's back (217.8 ms); with
normal priority the dense call's queued programs are dispatched first (219.2 ms).

``beside(fn, ref)`` marks the current stream of ``ref``'s device where ``fn``'s inputs are ready (an event) and
returns a ``Pending``. The caller then launches its other work (the dense call) on the current stream; the first
``Pending.result()`` launches ``fn()`` on the side stream, which waits for the mark only, makes the current stream wait
for the side stream (the host never waits) and records the result's tensors as used on the current stream (the caching
allocator keeps their memory until the current stream is done with them). Nothing changes for callers of the current
stream but the order in which the GPU runs the two. Off CUDA, inside a CUDA graph capture, or under
SPARSE_ATTN_SIDE_STREAM=0 (read at ``beside``), ``result()`` runs ``fn()`` on the current stream.

Memory: the caching allocator keeps what ``fn`` allocated on the side stream for that stream's later allocations,
not the current stream's (the Wan 14B anchor's grouping: 1.25 GB reserved beside the in-order path's, measured;
docs/decisions.md, "The side stream's memory"). It hands those blocks back when an allocation would otherwise fail,
but on a card without room that would happen at every anchor call. So ``beside`` takes the side stream only where the
device has ROOM_FACTOR times ``fn``'s scratch (``need_bytes``) free, counting what the side stream keeps cached (under
the native allocator; cudaMallocAsync's pool, ComfyUI's default, serves every stream).
"""

from __future__ import annotations

import os

import torch

_streams: dict = {}  # device index -> its side stream (one a device: the work it carries stays in order)
# free memory (the driver's plus what the side stream keeps cached) beside's work needs, in multiples of its scratch:
# the side stream may keep one scratch cached for itself and the current stream keeps the rest of the room
ROOM_FACTOR = 4
_held: dict = {}  # device index -> the largest need_bytes of work given to its side stream (what it may keep cached)
_FAILED = object()  # Pending._value once fn raised


def enabled() -> bool:
    """Whether work may go to a side stream: SPARSE_ATTN_SIDE_STREAM is not "0" (read at each call)."""
    return os.environ.get("SPARSE_ATTN_SIDE_STREAM", "1") != "0"


def _index(dev: torch.device) -> int:
    return dev.index if dev.index is not None else torch.cuda.current_device()


def _side(dev: torch.device) -> torch.cuda.Stream:
    idx = _index(dev)
    s = _streams.get(idx)
    if s is None:
        # (lowest, highest) priority; the highest is the most negative: its programs are scheduled first as SMs free
        s = _streams[idx] = torch.cuda.Stream(device=idx, priority=torch.cuda.Stream.priority_range()[1])
    return s


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


class Pending:
    """What ``beside`` returns: ``result()`` runs the work once (see the module's docstring) and returns its value,
    ordered on the stream that was current at ``beside``."""

    __slots__ = ("_fn", "_value", "_ref", "_ready", "_main")

    def __init__(self, fn, ref: torch.Tensor | None = None, ready=None, main=None):
        self._fn, self._value, self._ref, self._ready, self._main = fn, None, ref, ready, main

    @property
    def on_side_stream(self) -> bool:
        """Whether the work goes to a side stream (decided at ``beside``)."""
        return self._ready is not None

    def result(self):
        """The value of ``fn()``; the first call launches it (on the side stream, after the mark) and joins it. An
        exception of ``fn`` is raised; later calls then raise RuntimeError (the exception is not kept: its traceback
        would hold the failed attempt's tensors)."""
        if self._fn is None:
            if self._value is _FAILED:
                raise RuntimeError("Pending.result: the work raised at the first call")
            return self._value
        fn, self._fn, self._value = self._fn, None, _FAILED
        if self._ready is None or torch.cuda.is_current_stream_capturing():  # (a capture begun since the mark)
            self._ref = self._ready = self._main = None
            self._value = fn()
            return self._value
        side, main = _side(self._ref.device), self._main
        side.wait_event(self._ready)
        self._ref.record_stream(side)  # its memory is not handed out again before the side stream has read it
        self._ref = self._ready = self._main = None
        try:
            with torch.cuda.stream(side):
                value = fn()
        finally:  # also when fn raised (out of memory): what it launched is ordered before the current stream's next
            main.wait_stream(side)
        for t in _tensors(value):
            if t.is_cuda:
                t.record_stream(main)
        self._value = value
        return value


def async_allocator() -> bool:
    """Whether PyTorch's CUDA allocator is the cudaMallocAsync backend, ComfyUI's default on CUDA builds of torch
    (False where CUDA cannot say)."""
    try:
        return torch.cuda.get_allocator_backend() == "cudaMallocAsync"
    except (RuntimeError, AssertionError):  # a build or machine without CUDA
        return False


def room(dev: torch.device, need_bytes: int) -> bool:
    """Whether CUDA device ``dev`` has ROOM_FACTOR x ``need_bytes`` free for the side stream: the driver's free memory
    plus what the side stream may hold cached from earlier work (the most ``beside`` gave it, as far as PyTorch's
    caching allocator holds that much unused). Blocks the allocator caches for other streams do not count: the side
    stream could have them only by a flush of every stream's cache (no synchronisation here). Always under PyTorch's
    cudaMallocAsync backend (ComfyUI's default where it is supported): its pool serves every stream, in stream order,
    so the side stream keeps nothing apart."""
    if need_bytes <= 0 or async_allocator():
        return True
    free, _ = torch.cuda.mem_get_info(dev)
    unused = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
    return free + min(unused, _held.get(_index(dev), 0)) >= ROOM_FACTOR * need_bytes


def beside(fn, ref: torch.Tensor, need_bytes: int = 0) -> Pending:
    """Mark where ``fn``'s inputs are ready; ``fn()`` (which launches work on the current stream and returns tensors,
    or a dict, list or tuple of them) runs at the Pending's first ``result()``, on the side stream of ``ref``'s device
    after the mark; see the module's docstring. need_bytes: the device memory ``fn`` takes while it runs, at most;
    where the device lacks ``room`` for it, ``fn`` runs on the current stream."""
    if (not (ref.is_cuda and enabled()) or torch.cuda.is_current_stream_capturing()
            or not room(ref.device, need_bytes)):
        return Pending(fn)
    idx = _index(ref.device)
    _held[idx] = max(_held.get(idx, 0), need_bytes)
    main = torch.cuda.current_stream(ref.device)
    ready = torch.cuda.Event()
    ready.record(main)
    return Pending(fn, ref, ready, main)
