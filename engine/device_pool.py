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
"""

from __future__ import annotations

import gc

import torch

# idle pool memory below this is not worth a device synchronisation and another attempt
TRIM_MIN_BYTES = 1 << 30


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
