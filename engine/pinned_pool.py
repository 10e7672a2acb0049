"""Page-locked host buffers of exactly the size asked for, recycled by size, for the cache's host entries.

torch's pinned allocator rounds every block up to a power of two: an fp8 residual of both CFG halves of one Wan 14B
layer at 720p (738 MiB) takes 1 GiB, and a 32 GB host cache held 44.4 GiB of pinned memory for 31.9 GiB of entries
(docs/benchmarks.md, "The small-VRAM preset on a 16 GB card, timed"). Host memory is what decides how many layers
keep their residual on a small card, so large host entries live here instead: ordinary host memory page-locked with
``cudaHostRegister`` (a *region*). The pool owns every region for its whole life; a region holds one buffer, or
several side by side once it was split:

- ``empty`` hands out a view of a free buffer of the same byte count, or up to 1/16 larger; else it cuts the request
  from the front of the smallest free buffer at most SPLIT_MAX times its size (the rest stays a free buffer of the
  same region); else it page-locks a new region. The copies that read the buffer before it was released are
  finished first (events recorded at release). Cutting is what lets a residual packed to 4 bits take half of the
  fp8 buffer it was packed from, and the next packed residual the other half: page-locking costs ~0.5 s/GiB, and
  without it the first anchor that packs page-locked every packed entry anew (docs/benchmarks.md, "4-bit residuals
  on a 16 GB card"). The SPLIT_MAX bound keeps small requests (token lists) from carving the large buffers apart.
- ``release`` (the cache, when it forgets a host entry) makes the buffer free again and joins it to the free buffers
  next to it in its region; views that are still alive keep the memory valid (torch holds the storage), they only
  must not be read after a new owner writes it, and the cache never reads an entry it forgot.
- ``trim`` (end of run) unregisters and frees the regions no entry of that run used, after the device has finished
  with them; a collected cache gives its buffers back and frees the free regions it released last, not those
  another cache keeps for its next run or is about to take again. Free regions idle for a minute are also freed
  before new memory is page-locked, so sizes that change mid-run do not pile up. Only a region that is free as a
  whole can be unregistered: a free part of a region whose other part is in use stays page-locked (and serves
  requests) until the rest is released.
- A collected cache's finalizer (``forget``) may run wherever the garbage collector runs, including inside one of
  the pool's own calls on the same thread, whose lock is held there: it never waits for the lock, and work it cannot
  do at once is queued and done as that call ends (or at the pool's next call).
- ``release`` finds the buffer by the address of the tensor's first element (the buffer that holds it): the cache
  releases only tensors of entries it holds, never a stale view of a buffer recycled since.
- A refused ``cudaHostRegister`` / ``cudaHostUnregister`` leaves its error as the CUDA runtime's last error, which
  the next kernel launch check would raise in unrelated code; a tiny launch right after consumes it.

Where CUDA, the runtime call or the memory is missing, ``empty`` returns None and the caller uses torch's pinned
allocator (one log line).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)

MIN_BYTES = 4 << 20  # smaller host tensors stay with torch's allocator (its rounding costs little there)
REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every device of the process (engines per device)
FIT_SLACK = 1 / 16  # a free buffer up to this share larger serves a request (token lists vary a little per anchor)
STALE_S = 60.0  # free regions idle this long are freed before new memory is locked (other engines' recent ones stay)
SPLIT_MAX = 4  # a request is cut from a free buffer at most this many times its size (module docstring)
SPLIT_ALIGN = 16  # a cut rounds up to this many bytes: the rest is aligned for a view of any dtype, and the two halves
# of a buffer twice a request's size (a packed residual's B x H x N x D/2 bytes: a multiple of 16 at D = 64 or 128) both
# serve that request (a page alignment left the second half short for most token counts)


@dataclass
class _Buffer:
    base: torch.Tensor  # uint8 (nbytes,) view of its region (ordinary host memory, page-locked while in the pool)
    region: int  # the data_ptr of that region (what cudaHostRegister saw)
    in_use: bool = True
    last_used: float = field(default_factory=time.monotonic)  # handed out or released (time.monotonic)
    events: list = field(default_factory=list)  # recorded at release: the copies issued before it
    owners: frozenset = frozenset()  # tokens of the caches that released it (its parts, when joined) since it was
    # last handed out: ``forget`` and ``free_released`` free a region only once all of them are gone but the caller


class PinnedPool:
    """Exact-size page-locked host buffers (module docstring). Thread-safe (engines of several devices share it).

    register(ptr, nbytes) -> bool and unregister(ptr) default to the CUDA runtime; tests pass their own."""

    def __init__(self, register=None, unregister=None, min_bytes: int = MIN_BYTES):
        self._register = register or _cuda_register
        self._unregister = unregister or _cuda_unregister
        self.min_bytes = min_bytes
        self._regions: dict[int, torch.Tensor] = {}  # region data_ptr -> its uint8 (nbytes,) host memory
        self._buffers: dict[int, _Buffer] = {}  # buffer start data_ptr -> buffer (the regions' parts, side by side)
        self._lock = threading.Lock()
        self._forgotten: deque = deque()  # (tensors, owner) of collected caches, given back at the next call
        self._gone: set = set()  # tokens of collected caches that still own free parts (``_Buffer.owners``)
        self._failed = False

    # sizes
    @property
    def free_bytes(self) -> int:
        """Bytes page-locked in buffers no entry holds now (reused before new memory is locked)."""
        with self._locked():
            return sum(b.base.numel() for b in self._buffers.values() if not b.in_use)

    @property
    def held_bytes(self) -> int:
        """Bytes page-locked by the pool, in use or free."""
        with self._locked():
            return sum(r.numel() for r in self._regions.values())

    def empty(self, shape, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor | None:
        """An uninitialised CPU tensor of ``shape`` and ``dtype`` in page-locked memory (a buffer of its size, or the
        front of a larger one: module docstring), or None
        (too small to matter, no CUDA, or the runtime refused: use torch's pinned allocator). ``device``: the CUDA
        device whose current stream will write it (it waits there for the copies that read a recycled buffer)."""
        numel = 1
        for s in shape:
            numel *= int(s)
        nbytes = numel * dtype.itemsize
        if nbytes < self.min_bytes or self._failed:
            return None
        with self._locked():
            ptr = self._fitting(nbytes)
            if ptr is None and (ptr := self._cuttable(nbytes)) is not None:
                ptr = self._cut(ptr, nbytes)
            buf = self._buffers[ptr] if ptr is not None else None
            if buf is None:
                # free regions idle for a while go before new memory is locked (bounded hoarding when sizes change);
                # recent ones stay: the entry being stored, or another device's engine, is about to take them
                self._free_unused(before=time.monotonic() - STALE_S)
                with torch.inference_mode(False):  # writable by a later run outside inference mode too
                    base = torch.empty(nbytes, dtype=torch.uint8)
                if not self._register(base.data_ptr(), nbytes):
                    self._failed = True
                    log.info("sparse attention: page-locking host memory failed; host entries use torch's pinned "
                             "allocator for the rest of the session (its blocks are rounded up to a power of two)")
                    return None
                buf = _Buffer(base, base.data_ptr())
                self._regions[base.data_ptr()] = base
                self._buffers[base.data_ptr()] = buf
            else:
                _wait(buf.events, device)
                buf.events = []
                buf.in_use, buf.last_used, buf.owners = True, time.monotonic(), frozenset()
        return buf.base[:nbytes].view(dtype).view(tuple(int(s) for s in shape))

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives in one of the pool's buffers (in use or free)."""
        with self._locked():
            return self._holder(t) is not None

    def release(self, t: torch.Tensor, streams=(), owner=None) -> None:
        """The tensor's buffer is free again (no-op for tensors the pool did not hand out). t: a CPU tensor (any
        shape and dtype) that starts inside a pool buffer. ``streams``: the CUDA streams that may still be reading it
        (copies to the device, prefetches); events recorded on them now are waited for before the buffer is
        written again. ``owner``: a token of the releasing cache, for ``forget``."""
        if t.device.type != "cpu":
            return
        with self._locked():
            self._release(t, streams, owner)

    def _holder(self, t: torch.Tensor) -> int | None:
        """The start of the buffer that holds ``t``'s first element, or None (not the pool's). The lock is held."""
        if t.device.type != "cpu" or t.numel() == 0:
            return None
        p = t.data_ptr()
        for ptr, b in self._buffers.items():
            if ptr <= p < ptr + b.base.numel():
                return ptr
        return None

    def _release(self, t: torch.Tensor, streams, owner) -> None:
        ptr = self._holder(t)
        buf = self._buffers[ptr] if ptr is not None else None
        if buf is None or not buf.in_use:
            return
        buf.in_use, buf.last_used = False, time.monotonic()
        buf.owners = frozenset() if owner is None else frozenset((owner,))
        buf.events = []
        for s in streams:
            ev = torch.cuda.Event()
            ev.record(s)
            buf.events.append(ev)
        self._join(ptr)

    def _join(self, ptr: int) -> None:
        """Merge the free buffer at ``ptr`` with the free buffers right before and after it in its region (the lock
        is held): the merged one waits for every copy either waited for, was last used when the later of them was,
        and counts the caches that released either among its owners."""
        buf = self._buffers[ptr]
        for other_ptr, other in list(self._buffers.items()):
            if other.in_use or other.region != buf.region or other_ptr == ptr:
                continue
            if other_ptr + other.base.numel() == ptr:  # other lies just before: it takes buf
                first, second, first_ptr, second_ptr = other, buf, other_ptr, ptr
            elif ptr + buf.base.numel() == other_ptr:  # other lies just after: buf takes it
                first, second, first_ptr, second_ptr = buf, other, ptr, other_ptr
            else:
                continue
            region = self._regions[buf.region]
            start = first_ptr - buf.region
            first.base = region[start:start + first.base.numel() + second.base.numel()]
            first.events = first.events + second.events
            first.last_used = max(first.last_used, second.last_used)
            first.owners = first.owners | second.owners
            del self._buffers[second_ptr]
            buf, ptr = first, first_ptr

    def free_released(self, owner, keep=()) -> int:
        """Unregister and free now the free regions ``owner`` (a cache's token, never None) released last (with caches
        that are gone) and nobody took since: a cache short of host room that changes its entries' sizes (residuals
        packed to 4 bits, engine/residual.py) cannot reuse them whole, and the pool would count them as host memory to
        spare. ``keep``: byte counts the caller asks ``empty`` for next; for each, the smallest of that cache's free
        regions that serves it (whole, or cut) stays: the packed entry a later anchor stores in place of a packed one
        takes that one's buffer, and a residual packed where fp8 found no room takes half of the fp8 buffer the
        packing freed (page-locking them anew cost ~7 s an anchor at Wan 14B, docs/benchmarks.md, "4-bit residuals on
        a 16 GB card"). Free parts of regions in use stay anyway (only whole regions can be freed): a region the
        size of two requests is spared before the part that fits one, so the part serves this request and the
        region the next (the next packing of a stored residual), where freeing it would make the anchor wait for the
        copies still reading it and page-lock anew. Returns the bytes freed."""
        if owner is None:
            raise ValueError("free_released: a cache's token is needed (None would free every free buffer)")
        with self._locked():
            spared: set[int] = set()
            for nbytes in keep:
                if nbytes < self.min_bytes:  # served by torch's allocator, never by a buffer
                    continue
                ptr = self._smallest_free(nbytes, nbytes * SPLIT_MAX, owner, spared, whole=True)
                if ptr is not None:
                    spared.add(ptr)
            return self._free_unused(before=float("inf"), owner=owner, spare=spared)

    def _fitting(self, nbytes: int) -> int | None:
        """The start of the smallest free buffer that serves a request of ``nbytes`` whole (up to FIT_SLACK larger),
        or None. The lock is held."""
        return self._smallest_free(nbytes, nbytes * (1 + FIT_SLACK))

    def _cuttable(self, nbytes: int) -> int | None:
        """The start of the smallest free buffer a request of ``nbytes`` can be cut from (larger than FIT_SLACK
        allows, at most SPLIT_MAX times it), or None. The lock is held."""
        return self._smallest_free(nbytes * (1 + FIT_SLACK), nbytes * SPLIT_MAX)

    def _smallest_free(self, low: float, high: float, owner=None, exclude=frozenset(), whole: bool = False
                       ) -> int | None:
        """The start of the smallest free buffer of ``low`` to ``high`` bytes, or None; with ``owner``, only among
        those that owner released (last); never one in ``exclude``; ``whole``: only buffers that are a whole region.
        The lock is held."""
        fits = [(b.base.numel(), ptr) for ptr, b in self._buffers.items()
                if not b.in_use and ptr not in exclude and (owner is None or owner in b.owners)
                and low <= b.base.numel() <= high
                and (not whole or b.base.numel() == self._regions[b.region].numel())]
        return min(fits)[1] if fits else None

    def _cut(self, ptr: int, nbytes: int) -> int:
        """Cut the free buffer at ``ptr`` in two: its first ``nbytes`` (rounded up to SPLIT_ALIGN) stay at ``ptr``,
        the rest becomes a free buffer of its own with the same pending copies, owners and age; a rest smaller than
        ``min_bytes`` stays with the first part. Returns ``ptr``. The lock is held."""
        buf = self._buffers[ptr]
        head = -(-nbytes // SPLIT_ALIGN) * SPLIT_ALIGN
        if buf.base.numel() - head < self.min_bytes:
            return ptr
        rest = _Buffer(buf.base[head:], buf.region, in_use=False, last_used=buf.last_used, events=list(buf.events),
                       owners=buf.owners)
        buf.base = buf.base[:head]
        self._buffers[ptr + head] = rest
        return ptr

    def trim(self, since: float) -> int:
        """Unregister and free the regions that are free and were neither handed out nor released since ``since``
        (a ``time.monotonic()`` reading: the start of the run that ends). The engines of several devices each trim
        at their run's end without freeing what the others use. Returns the bytes freed."""
        with self._locked():
            return self._free_unused(before=since)

    @contextmanager
    def _locked(self):
        """The pool's lock, with the queued work of ``forget`` done first, and again after the call when a finalizer
        queued some while it ran (the garbage collector runs at any allocation)."""
        with self._lock:
            self._drain()
            yield
        if self._forgotten:
            self._drain_if_free()

    def _drain_if_free(self) -> None:
        """The queued work of ``forget``, now if the lock is free (never waiting for it)."""
        if self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()

    def forget(self, tensors, owner) -> None:
        """A collected cache (``owner``: its token, never None) is gone: its ``tensors`` (CPU tensors it still held)
        are given back, and its free regions — those it released last and nobody took since, which it kept for its
        next run — are unregistered and freed. Called from the cache's finalizer, which may run inside one of the
        pool's own calls (the garbage collector runs at any allocation): it never waits for the lock; when the lock
        is held, the work is queued and done as the call holding it ends, or at the pool's next call. No events are
        recorded: a cache nobody holds issues no copies, and its last ones ended with its last call."""
        if owner is None:
            raise ValueError("forget: a cache's token is needed (None would free every free buffer)")
        self._forgotten.append((list(tensors), owner))  # deque.append: atomic, no lock
        self._drain_if_free()

    def _drain(self) -> None:
        """The queued work of ``forget`` (the lock is held)."""
        while self._forgotten:
            tensors, owner = self._forgotten.popleft()
            self._gone.add(owner)
            for t in tensors:
                self._release(t, (), owner)
            self._free_unused(before=float("inf"), owner=owner)
            # a gone cache's token is kept while a free part it released waits for its other owners
            self._gone = {t for t in self._gone if any(t in b.owners for b in self._buffers.values())}

    def _free_unused(self, before: float, owner=None, spare=frozenset()) -> int:
        """Unregister and free the regions that are one free buffer last used before ``before`` (a
        ``time.monotonic()`` reading); with ``owner``, only those that owner released (last) and no cache but it and
        gone ones (``forget``); never those whose start is in ``spare``. A region with a part in use stays whole."""
        freed = 0
        for ptr, b in list(self._buffers.items()):
            if b.in_use or b.last_used >= before or ptr in spare or (
                    owner is not None and (owner not in b.owners or not b.owners - {owner} <= self._gone)):
                continue
            if ptr != b.region or b.base.numel() != self._regions[b.region].numel():
                continue  # a part of a region another part of which is in use
            for ev in b.events:  # copies still reading it finish first: unregistering under a copy is undefined
                ev.synchronize()
            self._unregister(ptr)
            freed += b.base.numel()
            del self._buffers[ptr], self._regions[ptr]
        return freed


def _wait(events, device) -> None:
    """Order the next write of a recycled buffer after the copies that read it: on the device's current stream where
    the event is that device's, else on the host."""
    for ev in events:
        ev_dev = getattr(ev, "device", None)
        if device is not None and device.type == "cuda" and ev_dev is not None and ev_dev == device:
            torch.cuda.current_stream(device).wait_event(ev)
        else:
            ev.synchronize()


def _cuda_register(ptr: int, nbytes: int) -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        rt = torch.cuda.cudart()
        ok = rt.cudaHostRegister(ptr, nbytes, REGISTER_PORTABLE) == rt.cudaError.success
    except Exception:  # noqa: BLE001 - a torch build without the runtime binding: torch's allocator instead
        return False
    if not ok:
        clear_runtime_error()
    return ok


def _cuda_unregister(ptr: int) -> None:
    try:
        rt = torch.cuda.cudart()
        ok = rt.cudaHostUnregister(ptr) == rt.cudaError.success
    except Exception:  # noqa: BLE001 - the memory is freed either way; a stale registration only wastes locked pages
        ok = False
    if not ok:
        log.debug("sparse attention: cudaHostUnregister failed")
        clear_runtime_error()


def clear_runtime_error() -> None:
    """Consume the CUDA runtime's last error of this thread (torch binds no cudaGetLastError): a one-element launch
    whose launch check reads and resets it. The errors of these calls are not sticky: the context stays usable."""
    try:
        torch.empty(1, device="cuda").fill_(0)
    except RuntimeError:
        pass


POOL = PinnedPool()
