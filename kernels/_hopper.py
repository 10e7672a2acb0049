"""When the Hopper (TMA) kernels may run, and the host-side pieces they need.

The TMA kernels load K/V tiles through tensor descriptors made in-kernel per (batch, head)
(``tl.make_tensor_descriptor``): the descriptor's shape is the head's true (N, D), so the hardware
zero-fills the ragged last tile and the padded head-dim lanes (80, 96 -> 128), for any (B, H, N, D)
strides. That needs compute capability 9.x, a Triton with device-side descriptors and an allocator for
their per-program scratch, and 16-byte aligned K/V bases and strides (last stride 1). Anything else runs
the pointer-load kernels. A TMA kernel that fails to compile is logged once and its kind is not tried
again in this process (the pointer kernel runs instead). docs/kernel_notes.md has the measurements.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from .backend import cuda_capability, interpreting

log = logging.getLogger(__name__)

_broken: dict[str, str] = {}  # kernel kind -> first compile error


@functools.lru_cache(maxsize=1)
def triton_has_descriptors() -> bool:
    """Triton exposes device-side tensor descriptors and ``set_allocator`` (asked once: every launch asks)."""
    try:
        import triton
        import triton.language as tl
    except Exception:
        return False
    return hasattr(tl, "make_tensor_descriptor") and hasattr(triton, "set_allocator")


def tma_problem(tensors, capability: tuple[int, int] | None) -> str | None:
    """Why the TMA kernels cannot take ``tensors`` (K and V, (B, H, N, D)) on a device of
    ``capability`` (None: not a CUDA device), or None when they can."""
    if os.environ.get("SPARSE_ATTN_TMA", "1") == "0":
        return "SPARSE_ATTN_TMA=0"
    if capability is None or capability[0] != 9:
        return f"compute capability {capability} is not 9.x (Hopper)"
    if not triton_has_descriptors():
        return "this Triton has no device-side tensor descriptors"
    for t in tensors:
        es = t.element_size()
        if t.stride(-1) != 1:
            return "last dim is strided"
        if t.data_ptr() % 16:
            return "base address is not 16-byte aligned"
        if any((st * es) % 16 for st in t.stride()[:3]):
            return f"strides {tuple(t.stride())} are not multiples of 16 bytes"
    return None


def device_capability(t: torch.Tensor) -> tuple[int, int] | None:
    """Compute capability of a CUDA tensor's device; None for other devices."""
    return cuda_capability(t)


def use_tma(kind: str, *tensors: torch.Tensor) -> bool:
    """Auto choice for kernel ``kind``: CUDA Hopper, descriptors, alignment, and no earlier compile failure.
    The interpreter runs the pointer kernels by default (the TMA kernels are tested there explicitly)."""
    if kind in _broken or interpreting():
        return False
    return tma_problem(tensors, device_capability(tensors[0])) is None


def mark_broken(kind: str, exc: BaseException) -> None:
    """Remember that kernel ``kind`` failed to compile here; logged once."""
    if kind not in _broken:
        _broken[kind] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        log.warning("sparse attention: the TMA %s kernel failed (%s); using the pointer kernel", kind, _broken[kind])


def attempt(kind: str, auto: bool, launch):
    """``launch()`` (a TMA kernel, or the fused anchor), guarded: out-of-memory and argument errors propagate;
    any other error (a compile failure) propagates when the caller asked for this variant, and otherwise marks
    ``kind`` broken (logged once) and returns None, so the caller runs its fallback now and from then on."""
    try:
        return launch()
    except (torch.OutOfMemoryError, ValueError):
        raise
    except Exception as exc:
        if not auto:
            raise
        mark_broken(kind, exc)
        return None


def broken() -> dict[str, str]:
    """Kernel kinds that failed to compile in this process, with the first error."""
    return dict(_broken)


@functools.lru_cache(maxsize=None)
def scratch_setter(device: torch.device):
    """A callable (one per device, kept) that installs the allocator of the in-kernel descriptors' scratch (128 bytes
    per program) on ``device``: run before each TMA launch and each replay of one (kernels/fast_launch.py, ``before``),
    since Triton's launcher reads the allocator installed last (another device's, in a process that drives two)."""
    import triton

    def alloc(size: int, alignment: int, stream):
        return torch.empty(size, dtype=torch.int8, device=device)

    def install():
        triton.set_allocator(alloc)
    return install


def set_allocator(device: torch.device) -> None:
    """Scratch for the in-kernel descriptors (128 bytes per program), allocated on ``device``."""
    scratch_setter(device)()


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a small number under the interpreter)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count
