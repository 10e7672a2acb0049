"""The CUDA allocator's idle memory, handed back to the driver before an out-of-memory error costs the cache.

ComfyUI runs PyTorch on its cudaMallocAsync backend. There, memory that tensors free stays reserved in the
driver's pool, and an allocation the pool and the driver cannot serve raises ``torch.OutOfMemoryError`` at once:
unlike the native allocator, which frees its cached blocks and tries once more before raising, the async backend
neither trims the pool nor retries (PyTorch's ``CUDAMallocAsyncAllocator``, ``mallocAsync``). Memory held idle in
the pool, in pieces a large request does not fit, can then end a step that would fit once the pool hands it back.
So both out-of-memory handlers (the model's forward, nodes/patch.py; an anchor, engine/engine.py ``_with_room``)
first hand the pool's idle memory back (``torch.cuda.empty_cache``: a device synchronisation, then
cudaMemPoolTrimTo(0)) and try again, and only when that fails move the cache to host memory, which costs every
later step a host-to-device copy (docs/decisions.md, "Out of memory under cudaMallocAsync: the pool's idle memory
first, then the cache").

The handlers come late: by the time an allocation fails, a whole step may have to run again. Measured at Wan 2.1 14B
with mc_sparse on an H100, the pool grew from 52 to 78 GB within anchor steps while the memory in use stayed at
36.6 GB, and the model's feed-forward ran out of memory with 32 GB idle in the pool (docs/decisions.md, same section).
So the engine also watches between calls (``PoolWatch``): when the driver's free memory runs low while the pool holds
idle memory, it hands that back before the next allocation fails.
"""

from __future__ import annotations

import gc
import time

import torch

# idle pool memory below this is not worth a device synchronisation and another attempt
TRIM_MIN_BYTES = 1 << 30
# PoolWatch: the driver's free memory below this share of the card counts as running low. The largest single request
# measured (the feed-forward's at Wan 14B 720p) was 3.9 GB, 5 % of an 80 GB card; an anchor's scratch adds more.
LOW_FREE_SHARE = 0.10


def async_pool(device: torch.device) -> bool:
    """Whether ``device`` (a torch.device) allocates from cudaMallocAsync's pool (ComfyUI's default on CUDA)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        return torch.cuda.get_allocator_backend() == "cudaMallocAsync"
    except RuntimeError:  # no allocator to ask
        return False


def idle_pool_bytes(device: torch.device) -> int:
    """Bytes cudaMallocAsync's pool on ``device`` holds beyond what is in use (reserved minus used, the driver's
    counts as PyTorch reports them); 0 on the native allocator (it trims and retries itself) and off CUDA."""
    if not async_pool(device):
        return 0
    return max(0, torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def trim_pool(device: torch.device) -> int:
    """Hand the idle memory of cudaMallocAsync's pool on ``device`` back to the driver where it holds at least
    TRIM_MIN_BYTES (after a garbage collection: tensors caught in reference cycles, a failed attempt's frames among
    them, go back to the pool first). Returns the idle bytes the pool held (0: nothing was done). Call it outside
    an ``except`` block: the error's traceback keeps the failed attempt's tensors alive."""
    if not async_pool(device):
        return 0
    gc.collect()
    idle = idle_pool_bytes(device)
    if idle < TRIM_MIN_BYTES:
        return 0
    torch.cuda.empty_cache()
    return idle


def room(device: torch.device) -> tuple[int, int]:
    """(bytes the pool can still take from the driver, the bytes it may hold in all) on CUDA ``device``: the driver's
    free memory and the card, or, under a per-process cap (``torch.cuda.set_per_process_memory_fraction``, the
    simulated small cards of bench/e2e.py --vram-gb), what the cap leaves beyond the pool's reservation and the cap."""
    free, total = torch.cuda.mem_get_info(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 1.0)(device)
    if fraction < 1.0:
        cap = int(fraction * total)
        return min(free, max(0, cap - torch.cuda.memory_reserved(device))), cap
    return free, total


class PoolWatch:
    """Hands cudaMallocAsync's idle pool memory back to the driver before an allocation fails, not after (module
    docstring). ``check(device)`` is cheap enough for every attention call: it reads the driver's free memory at most
    every ``interval_s`` and trims at most every ``min_gap_s`` (a trim synchronises the device, and the pool regrows
    what the next calls need from the driver), only when what the pool can still take (``room``: the driver's free
    memory, or a per-process cap's) is below LOW_FREE_SHARE of the card (or of the cap) and the pool holds at least
    TRIM_MIN_BYTES idle (the engine counts the trims: engine/engine.py ``_watch_pool``)."""

    def __init__(self, interval_s: float = 0.05, min_gap_s: float = 1.0):
        self.interval_s, self.min_gap_s = interval_s, min_gap_s
        self.reset()

    def reset(self) -> None:
        """A new run: look and trim at once, whatever the last run did."""
        self._next_look = self._next_trim = 0.0

    def check(self, device: torch.device) -> int:
        """Trim the pool on ``device`` (a torch.device) if the driver runs low (class docstring); returns the idle
        bytes handed back (0: nothing was done)."""
        now = time.perf_counter()
        if now < self._next_look or now < self._next_trim or not async_pool(device):
            return 0
        if torch.cuda.is_current_stream_capturing():  # a CUDA graph being recorded (a compiled model's): no sync
            return 0
        self._next_look = now + self.interval_s
        free, total = room(device)
        if free >= LOW_FREE_SHARE * total:
            return 0
        idle = idle_pool_bytes(device)
        if idle < TRIM_MIN_BYTES:
            return 0
        torch.cuda.empty_cache()
        self._next_trim = time.perf_counter() + self.min_gap_s
        return idle
