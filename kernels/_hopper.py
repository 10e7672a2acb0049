"""When the Hopper (TMA) kernels may run, and the host-side pieces they need.

The TMA kernels load K/V tiles through tensor descriptors made in-kernel per (batch, head)
(``tl.make_tensor_descriptor``): the descriptor's shape is the head's true (N, D), so the hardware
zero-fills the ragged last tile and the padded head-dim lanes (80, 96 -> 128), for any (B, H, N, D)
strides. That needs compute capability 9.x, a Triton with device-side descriptors and an allocator for
their per-program scratch, and 16-byte aligned K/V bases and strides (last stride 1). Anything else runs
the pointer-load kernels. A TMA kernel that fails to compile is logged once and its kind is not tried
again in this process (the pointer kernel runs instead). docs/kernel_notes.md has the measurements.

The Gluon kernel (kernels/attention_gluon.py: dense and block-sparse, faster than cuDNN and than the TMA kernels,
docs/kernel_notes.md "v17") runs before both where ``gluon_problem`` finds nothing against it, and from
GLUON_MIN_TOKENS query tokens on: its launch goes through Gluon's own launcher, which neither kernels/fast_launch.py
nor a replay (kernels/replay.py) can take, so below that size, where a call is host-bound (docs/benchmarks.md, "Host
overhead at 4 608 tokens"), the TMA kernels keep the call.
"""

from __future__ import annotations

import functools
import importlib
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


GLUON_MIN_TOKENS = 16384
GLUON_HEAD_DIMS = (64, 128)


@functools.lru_cache(maxsize=4)
def gluon_import_problem(module: str = "attention_gluon") -> str | None:
    """Why kernels/<module>.py (a Gluon kernel) cannot be imported here (a Triton without the Gluon API it uses), or
    None."""
    try:
        importlib.import_module(f".{module}", __package__)
    except Exception as exc:  # ImportError, or an older Gluon's missing names
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    return None


def gluon_problem(kind: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_q: int = 128,
                  block_k: int = 128, auto: bool = True) -> str | None:
    """Why the Gluon kernel of ``kind`` ("gluon_dense", "gluon_sparse"; "gluon_anchor": kernels/anchor_gluon.py;
    "gluon_token": kernels/token_sparse_gluon.py, query groups of block_q) cannot take q (B,H,Nq,D), k/v (B,H,Nk,D)
    with blocks of block_q x block_k, or None when it can. ``auto``: the automatic choice, which also leaves it alone
    under SPARSE_ATTN_GLUON=0, after a failure of this kind and below GLUON_MIN_TOKENS query tokens."""
    if auto:
        if os.environ.get("SPARSE_ATTN_GLUON", "1") == "0":
            return "SPARSE_ATTN_GLUON=0"
        if kind in _broken:
            return f"it failed earlier ({_broken[kind]})"
        if q.shape[2] < GLUON_MIN_TOKENS:
            return f"{q.shape[2]} query tokens, under {GLUON_MIN_TOKENS}"
    if interpreting():
        return "the interpreter has no Gluon"
    cap = device_capability(q)
    if cap is None or cap[0] != 9:
        return f"compute capability {cap} is not 9.x (Hopper)"
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes {q.dtype}/{k.dtype}/{v.dtype} are not one of fp16/bf16"
    if q.shape[-1] not in GLUON_HEAD_DIMS or k.shape[-1] != q.shape[-1] or v.shape[-1] != q.shape[-1]:
        return f"head dim {q.shape[-1]} is not one of {GLUON_HEAD_DIMS}"
    if k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]:
        return "k/v have other heads than q"
    if kind == "gluon_token":
        return _gluon_token_problem(q, k, v, block_q, auto)
    if block_q != 128 or block_k not in (64, 128):
        return f"blocks {block_q}x{block_k} are not 128x64 or 128x128"
    if any(t.data_ptr() % 16 for t in (q, k, v)):
        return "a base address is not 16-byte aligned"
    if auto:  # another layout would be copied for the kernel's descriptors; the TMA kernels take any strides
        layouts = [rows_layout(t) for t in (q, k, v)]
        if None in layouts or layouts[1] != layouts[2]:
            return f"q/k/v layouts {layouts} (neither (B, H, N, D)- nor (B, N, H, D)-contiguous, or k and v differ)"
    return gluon_import_problem("anchor_gluon" if kind == "gluon_anchor" else "attention_gluon")


def _gluon_token_problem(q, k, v, group: int, auto: bool) -> str | None:
    """The token kernel's own conditions: groups of 128 queries, and K/V rows its 16-byte cp.async copies can read in
    place (the head dim contiguous, every other stride and the base 16-byte aligned); the automatic choice also
    leaves head dim 64 to the pointer kernel, which was faster there (docs/benchmarks.md, "Token-sparse in Gluon":
    0.94 / 1.02 against 0.79 / 0.90 of 1/d on the H100)."""
    if group != 128:
        return f"query groups of {group}, not 128"
    if auto and q.shape[-1] != 128:
        return f"head dim {q.shape[-1]}: the pointer kernel is the faster one there"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1 or any(st * t.element_size() % 16 for st in t.stride()[:3]) or t.data_ptr() % 16:
            return f"{name} strides {tuple(t.stride())} are not 16-byte rows with the head dim contiguous"
    return gluon_import_problem("token_sparse_gluon")


def rows_layout(t: torch.Tensor) -> str | None:
    """How the Gluon kernel's 2-D descriptors address a (B, H, N, D) tensor without a copy: "bhnd" (contiguous: rows of
    (B*H*N, D)), "bnhd" ((B, N, H, D)-contiguous seen as (B, H, N, D): rows of (B*N, H*D)), or None (a copy)."""
    if t.is_contiguous():
        return "bhnd"
    if t.transpose(1, 2).is_contiguous():
        return "bnhd"
    return None


def use_gluon(kind: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_q: int = 128,
              block_k: int = 128, path: str = "auto") -> bool:
    """Whether the Gluon kernel of ``kind`` runs this call under ``path`` ("auto": when ``gluon_problem`` finds
    nothing; "gluon": always, or ValueError with the reason it cannot; any other path: never)."""
    if path not in ("auto", "gluon"):
        return False
    problem = gluon_problem(kind, q, k, v, block_q, block_k, auto=path == "auto")
    if problem is not None and path == "gluon":
        raise ValueError(f"the Gluon kernel cannot take this call: {problem}")
    return problem is None


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
        log.warning("sparse attention: the %s %s kernel failed (%s); using the %s from now on",
                    "Gluon" if kind.startswith("gluon") else "TMA", kind, _broken[kind],
                    "other kernels (cuDNN, TMA or pointer loads)" if kind.startswith("gluon") else "pointer kernel")


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
