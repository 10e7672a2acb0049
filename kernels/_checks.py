"""Input validation shared by every attention primitive.

Every check raises ``ValueError`` naming the offending argument, so a bad call fails before
any work starts and the message says which tensor is wrong.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
BLOCK_SIZES = (64, 128)
TRITON_HEAD_DIMS = (64, 80, 96, 128)  # head dims the Triton kernels take (80, 96 padded in-kernel)
GATHER_WIDTHS = (16, 32, 64, 128)  # row widths of gather_triton (a power of two: one tl.arange across the row)


def triton_group_problem(c: int) -> str | None:
    """Why a query group of size c cannot be a Triton tile (a power of two in [16, 128]), or None."""
    if c < 16 or c > 128 or (c & (c - 1)):
        return f"query group size {c} is not a power of two in [16, 128]"
    return None


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int, int]:
    """Check a (B, H, N, D) query/key/value triple.

    q: (B, H, Nq, D); k, v: (B, H, Nk, D); one floating dtype (fp16, bf16 or fp32) and one device.
    Returns (B, H, Nq, Nk, D).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have layout (B, H, N, D), got shape {tuple(t.shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"k and v must share q's dtype {q.dtype}, got k={k.dtype}, v={v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"k and v must be on q's device {q.device}, got k={k.device}, v={v.device}")
    b, h, nq, d = q.shape
    if k.shape[0] != b or k.shape[1] != h or k.shape[3] != d:
        raise ValueError(f"k shape {tuple(k.shape)} does not match q shape {tuple(q.shape)} in B, H or D")
    if v.shape != k.shape:
        raise ValueError(f"v shape {tuple(v.shape)} must equal k shape {tuple(k.shape)}")
    if d == 0 or nq == 0 or k.shape[2] == 0:
        raise ValueError(f"q/k must have non-empty N and D, got q={tuple(q.shape)} k={tuple(k.shape)}")
    return b, h, nq, k.shape[2], d


def check_scale(scale: float | None, d: int) -> float:
    """Return the softmax scale: ``scale`` if given (finite, > 0), else ``d ** -0.5``."""
    if scale is None:
        return float(d) ** -0.5
    scale = float(scale)
    if not (scale > 0.0 and scale < float("inf")):
        raise ValueError(f"scale must be a finite positive number, got {scale}")
    return scale


def check_block_size(name: str, value: int) -> int:
    """Block sizes are 64 or 128 (the tile sizes of the Triton kernels)."""
    if not isinstance(value, int) or isinstance(value, bool) or value not in BLOCK_SIZES:
        raise ValueError(f"{name} must be 64 or 128, got {value!r}")
    return value


def check_index(name: str, t: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Check an integer index tensor's dtype, exact shape and device."""
    if not isinstance(t, torch.Tensor) or t.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} must be an int32 (or int64) tensor, got {getattr(t, 'dtype', type(t))}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    return t


def check_counts(name: str, counts: torch.Tensor, max_k: int) -> None:
    """Counts lie in [0, max_k]."""
    if counts.numel() and (int(counts.min()) < 0 or int(counts.max()) > max_k):
        raise ValueError(f"{name} must lie in [0, {max_k}], got range [{int(counts.min())}, {int(counts.max())}]")


def check_sorted_unique_in_range(name: str, idx: torch.Tensor, counts: torch.Tensor, upper: int) -> None:
    """The first ``counts`` entries of every row of ``idx`` are strictly increasing and in [0, upper).

    idx: (..., max_k) integer; counts: (...) integer. Entries past the count are ignored.
    """
    if idx.shape[-1] == 0:
        return
    slot = torch.arange(idx.shape[-1], device=idx.device)
    valid = slot < counts.unsqueeze(-1)
    bad = valid & ((idx < 0) | (idx >= upper))
    if bool(bad.any()):
        raise ValueError(f"{name} holds an index outside [0, {upper}) within its count")
    if idx.shape[-1] > 1:
        both = valid[..., 1:]
        if bool((both & (idx[..., 1:] <= idx[..., :-1])).any()):
            raise ValueError(f"{name} must be strictly increasing (sorted, no repeats) within its count")
