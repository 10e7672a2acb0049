"""Work started on a side stream so that it runs beside what the current stream does next (docs/kernel_notes.md,
"v23").

The mc_sparse anchor's query grouping reads only the queries, yet ran after the dense call whose row LSE pass 2
needs. Its many small operators leave most of the GPU idle; launched on a side stream of the highest priority just
before the dense call, they take SMs as the dense call's programs finish, and the dense call fills the rest.

``beside(fn, ref)`` runs ``fn()`` on the side stream of ``ref``'s device, bracketed so that nothing changes for the
callers of the current stream: the side stream first waits for the current one (the inputs are ready), and
``Pending.result()`` makes the current stream wait for the side stream and records the result's tensors as used on
it (the caching allocator then keeps their memory until the current stream is done with them). Between the two the
caller must not touch what ``fn`` writes. Off CUDA, inside a CUDA graph capture, or under
SPARSE_ATTN_SIDE_STREAM=0 (read at each call), ``fn()`` runs at once on the current stream.
"""

from __future__ import annotations

import os

import torch

_streams: dict = {}  # device index -> its side stream (one a device: the work it carries stays in order)


def enabled() -> bool:
    """Whether work may go to a side stream: SPARSE_ATTN_SIDE_STREAM is not "0" (read at each call)."""
    return os.environ.get("SPARSE_ATTN_SIDE_STREAM", "1") != "0"


def _side(dev: torch.device) -> torch.cuda.Stream:
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
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
    """The result of ``beside``: ``result()`` returns it, ordered on the current stream of the call that made it."""

    __slots__ = ("_value", "_side", "_main")

    def __init__(self, value, side=None, main=None):
        self._value, self._side, self._main = value, side, main

    @property
    def on_side_stream(self) -> bool:
        """Whether the work went to a side stream and ``result()`` has not yet joined it."""
        return self._side is not None

    def result(self):
        """The value of ``fn()``; the first call makes the launching stream wait for the side stream."""
        if self._side is not None:
            self._main.wait_stream(self._side)
            for t in _tensors(self._value):
                if t.is_cuda:
                    t.record_stream(self._main)
            self._side = self._main = None
        return self._value


def beside(fn, ref: torch.Tensor) -> Pending:
    """Run ``fn()`` (which launches work on the current stream and returns tensors, or a dict, list or tuple of them)
    on the side stream of ``ref``'s device; see the module's docstring. Returns a Pending."""
    if not (ref.is_cuda and enabled()) or torch.cuda.is_current_stream_capturing():
        return Pending(fn())
    main = torch.cuda.current_stream(ref.device)
    side = _side(ref.device)
    side.wait_stream(main)
    ref.record_stream(side)  # its memory is not handed out again before the side stream has read it
    with torch.cuda.stream(side):
        value = fn()
    return Pending(value, side, main)
