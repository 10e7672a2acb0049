"""Backend choice for the attention primitives: Triton on CUDA when it can run, else PyTorch.

Triton is imported lazily, once; when it is missing the PyTorch twins run and the log says so once.
Which backend runs each primitive is logged once per (primitive, device type).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

log = logging.getLogger(__name__)

BACKENDS = ("auto", "triton", "torch")
_announced: set[tuple[str, str]] = set()  # (primitive, device type) pairs already logged


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when ``import triton`` works (imported once, logged once when it does not)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install raising anything else
        log.info("sparse attention: Triton unavailable (%s); using the PyTorch backend", exc)
        return False
    return True


def interpreting() -> bool:
    """True when Triton runs its CPU interpreter (TRITON_INTERPRET=1): kernels then accept CPU tensors. Read as Triton
    reads it: "1", "true" and "on", in any case, turn it on; anything else ("0", "false", unset) leaves it off."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on")


def triton_device_ok(t: torch.Tensor) -> bool:
    """Triton kernels run on CUDA tensors, or on CPU tensors under the interpreter."""
    return t.is_cuda or (interpreting() and t.device.type == "cpu")


def announce(name: str, t, chosen: str, reason: str | None = None) -> None:
    """Log once per (primitive ``name``, device type of ``t``) which backend runs it, and why not Triton."""
    dev = getattr(getattr(t, "device", None), "type", "unknown")
    if (name, dev) in _announced:
        return
    _announced.add((name, dev))
    label = "Triton kernel" if chosen == "triton" else "PyTorch backend"
    log.info("sparse attention: %s on %s runs on the %s%s", name, dev, label, f" ({reason})" if reason else "")


def check_backend(backend: str) -> None:
    """ValueError unless ``backend`` is one of ``BACKENDS``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


MIN_CAPABILITY = (8, 0)  # Triton's own floor for NVIDIA GPUs (Ampere)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(index)
    return major, minor


def cuda_capability(t: torch.Tensor) -> tuple[int, int] | None:
    """Compute capability of a CUDA tensor's device (asked once per device: kernel calls read it); None for
    other devices."""
    if not t.is_cuda:
        return None
    return _capability(t.device.index if t.device.index is not None else torch.cuda.current_device())


def capability_problem(t: torch.Tensor) -> str | None:
    """Why the NVIDIA device of the CUDA tensor ``t`` is too old for the kernels, or None (ROCm devices are left to
    Triton)."""
    if torch.version.hip is not None:
        return None
    major, minor = cuda_capability(t)
    if (major, minor) < MIN_CAPABILITY:
        # compiled for sm_75 the pointer kernels spill ~130 KB a thread and need more shared memory than a Turing
        # program may have; ptxas takes minutes on each (docs/kernel_notes.md, "v14")
        return f"compute capability {major}.{minor}: the Triton kernels need 8.0 (Ampere) or later"
    return None


def triton_problem(backend: str, t: torch.Tensor, why_not: str | None) -> str | None:
    """Why the Triton kernel cannot run for ``t`` under ``backend`` ("auto" or "triton"; ``why_not`` the primitive's
    own reason or None), or None when it can. Nothing logged, nothing raised."""
    if why_not is not None:
        return why_not
    # "auto" takes Triton only on CUDA; an explicit "triton" also runs CPU tensors under TRITON_INTERPRET=1
    if not (t.is_cuda if backend == "auto" else triton_device_ok(t)):
        return f"tensors are on {t.device}, the Triton kernels need CUDA"
    if t.is_cuda:
        old = capability_problem(t)
        if old is not None:
            return old
    if not triton_available():
        return "Triton is not installed or failed to import"
    return None


def choose(backend: str, t: torch.Tensor, why_not: str | None, name: str) -> str:
    """Pick ``"triton"`` or ``"torch"`` for primitive ``name`` on tensor ``t`` (logged once per device type).

    backend: "auto" | "triton" | "torch". why_not: None when the Triton kernel supports this case,
    else the reason it does not (dtype, head dim, block size). An explicit "triton" that cannot run
    raises ValueError with the reason; "auto" falls back to the PyTorch twin.
    """
    check_backend(backend)
    if backend == "torch":
        announce(name, t, "torch", "backend='torch' requested")
        return "torch"
    reason = triton_problem(backend, t, why_not)
    if reason is None:
        # api.attention_dense tries cuDNN's fused attention before its Triton kernel under "auto"
        announce(name, t, "triton", "cuDNN's fused attention first where it takes the case"
                 if backend == "auto" and name == "attention_dense" else None)
        return "triton"
    if backend == "triton":
        raise ValueError(f"{name}: backend='triton' cannot run: {reason}")
    announce(name, t, "torch", reason)
    return "torch"
