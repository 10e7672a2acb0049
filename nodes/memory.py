"""The cache's view of GPU memory from ComfyUI's memory manager (the engine plans with it, engine/cache.py).

ComfyUI decides how much of a model to keep on the GPU from its own accounting: free memory (driver plus
PyTorch's free pool) minus what ``--reserve-vram`` keeps for other programs. The cache must plan with the same
view, or it takes room ComfyUI counts on for the model's weights and activations (at 8 GB a run ended with an
out-of-memory error outside the engine: docs/decisions.md, small cards).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def comfy_device_memory(device):
    """(free, usable total) bytes on ``device`` as ComfyUI sees them: both less the reserved VRAM."""
    import comfy.model_management as mm

    reserved = int(mm.extra_reserved_memory())
    free = int(mm.get_free_memory(device))
    total = int(mm.get_total_memory(device))
    return max(0, free - reserved), max(1, total - reserved)


def install_probe() -> None:
    """Make the engine's cache plan with ComfyUI's view of GPU memory (idempotent)."""
    from ..engine import cache

    cache.set_device_probe(comfy_device_memory)
