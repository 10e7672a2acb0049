"""Gather helpers of the PyTorch backend: rows or blocks of a (B, H, N, D) tensor picked by index lists.

Ops: ``reshape``, ``arange``, ``index_select`` with ``out=`` (implemented on CPU, CUDA and Apple MPS).
"""

from __future__ import annotations

import threading

import torch

_cpu_scratch = threading.local()  # per thread: {dtype: Scratch} of persistent CPU buffers


def flat_rows(x: torch.Tensor) -> torch.Tensor:
    """(B, H, N, D) -> (B*H*N, D) view (contiguous copy only when needed)."""
    return x.reshape(-1, x.shape[-1])


def head_offsets(b: int, h: int, n: int, device: torch.device) -> torch.Tensor:
    """(B*H, 1) int64 offsets of each head's first row in the flattened (B*H*N, D) tensor."""
    return (torch.arange(b * h, device=device, dtype=torch.int64) * n).view(b * h, 1)


def blocks_of(x: torch.Tensor, block: int) -> torch.Tensor:
    """(B, H, N, D) -> (B*H*ceil(N/block), block, D), the last block of each head zero-padded.

    A view when N is a multiple of ``block`` and x is contiguous; otherwise one copy of x.
    """
    b, h, n, d = x.shape
    nb = -(-n // block)
    if nb * block == n:
        return x.reshape(b * h * nb, block, d)
    pad = torch.zeros((b * h, nb * block, d), dtype=x.dtype, device=x.device)
    pad[:, :n] = x.reshape(b * h, n, d)
    return pad.view(b * h * nb, block, d)


class Scratch:
    """Reusable gather buffers, one per name, grown on demand.

    Writing each chunk's gather into the same memory keeps it warm in cache (CPU) and avoids fresh
    allocations per chunk. Chunks run in device order on one stream, so reuse is safe.
    """

    def __init__(self, dtype: torch.dtype, device: torch.device):
        self.dtype, self.device = dtype, device
        self._bufs: dict[str, torch.Tensor] = {}

    @staticmethod
    def get(dtype: torch.dtype, device: torch.device) -> "Scratch":
        """The buffers for one call. CPU: the calling thread's persistent set for ``dtype`` (a fresh
        multi-MiB buffer costs page faults on every call: ~2.5 ms per 6 MiB measured, a quarter of a small
        sparse call); held memory stays within the chunk budgets (tens of MiB). Other devices: a fresh
        set (their caching allocators already reuse memory)."""
        if device.type != "cpu":
            return Scratch(dtype, device)
        sets = getattr(_cpu_scratch, "sets", None)
        if sets is None:
            sets = _cpu_scratch.sets = {}
        if dtype not in sets:
            sets[dtype] = Scratch(dtype, device)
        return sets[dtype]

    def buffer(self, name: str, numel: int) -> torch.Tensor:
        """A flat buffer of at least ``numel`` elements (contents undefined), reused across calls. Made outside
        ``torch.inference_mode`` (ComfyUI samples inside it): an inference tensor could not be written by a later
        call outside that mode, while a normal tensor can be written in either."""
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < numel:
            with torch.inference_mode(False):
                buf = torch.empty(numel, dtype=self.dtype, device=self.device)
            self._bufs[name] = buf
        return buf[:numel]

    def take(self, name: str, src: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """src: (R, *rest); idx: int64 (n,) in [0, R). Returns src[idx] (n, *rest) in a reused buffer."""
        shape = (idx.numel(), *src.shape[1:])
        numel = 1
        for s in shape:
            numel *= s
        out = self.buffer(name, numel).view(shape)
        torch.index_select(src, 0, idx, out=out)
        return out
