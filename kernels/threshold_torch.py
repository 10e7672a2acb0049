"""A row threshold applied with a budget: the last step of the mc_sparse anchor's top-k on long rows (PyTorch twin of
``threshold_triton``; engine/block_geometry.py's ``keep_top`` estimates the threshold, docs/kernel_notes.md, "v21")."""

from __future__ import annotations

import torch


def check_threshold_args(scores, thresh, k, cap=None) -> None:
    """ValueError unless scores is a floating tensor (..., L), thresh a tensor (..., 1) of the same leading shape,
    dtype and device (a threshold of another precision would compare differently in the kernel and the twin), k
    an int >= 0 and cap None or an int >= k."""
    if not isinstance(scores, torch.Tensor) or not scores.is_floating_point() or scores.dim() < 1:
        raise ValueError("scores must be a floating tensor (..., L)")
    if not isinstance(thresh, torch.Tensor) or thresh.dtype != scores.dtype \
            or tuple(thresh.shape) != (*scores.shape[:-1], 1) or thresh.device != scores.device:
        raise ValueError(f"thresh must be a {scores.dtype} tensor of shape {(*scores.shape[:-1], 1)} on "
                         f"{scores.device}, got {getattr(thresh, 'dtype', type(thresh).__name__)} "
                         f"{tuple(getattr(thresh, 'shape', ()))}")
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ValueError(f"k must be an int >= 0, got {k!r}")
    if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < k):
        raise ValueError(f"cap must be None or an int >= k ({k}), got {cap!r}")


def keep_at_threshold(scores: torch.Tensor, thresh: torch.Tensor, k: int, cap: int | None = None) -> torch.Tensor:
    """Each row's entries above its threshold, plus the entries equal to it in index order while the row holds
    fewer than k: scores float (..., L), any strides; thresh (..., 1) of scores' dtype; k int >= 0.
    Returns bool (..., L): ``s > t``, and ``s == t`` for the first ``max(0, k - count(s > t))`` ties of the row
    (a row with more than k entries above its threshold keeps all of them; NaN is never kept).

    cap: None, or an int >= k: a row with more than ``cap`` entries above its threshold has it raised first
    (``raised_threshold``), so no row keeps more than ``cap`` entries, +inf ones aside (forced entries are always
    kept): a caller can size what it makes of the mask without reading the counts back (docs/kernel_notes.md, "v27").

    Where every row's ties fit its room (the usual case: the threshold is one sampled value) no prefix count over
    the (rows, L) mask is needed; the check costs one host synchronisation, which the Triton kernel does not need
    (it counts and fills in one program per row)."""
    if cap is not None:
        thresh = raised_threshold(scores, thresh, cap)  # fp32: exact for every float dtype the scores may have
    above, tied = scores > thresh, scores == thresh
    room = (k - above.sum(-1, keepdim=True)).clamp(min=0)
    fits = tied.sum(-1, keepdim=True) <= room
    if not bool((~fits & (room > 0)).any()):
        return above | (tied & fits)
    return above | (tied & (torch.cumsum(tied, dim=-1, dtype=torch.int32) <= room))


INT32_MIN = -(2**31)


def order_key(x: torch.Tensor) -> torch.Tensor:
    """fp32 tensor -> int64 of its shape whose order is the floats' order (sign-magnitude bits to two's complement;
    -0.0 just below +0.0)."""
    i = x.contiguous().view(torch.int32).long()
    return torch.where(i >= 0, i, i ^ 0x7FFFFFFF)


def from_key(key: torch.Tensor) -> torch.Tensor:
    """``order_key``'s inverse: int64 keys in int32 range -> fp32 values."""
    return torch.where(key >= 0, key, key ^ 0x7FFFFFFF).to(torch.int32).view(torch.float32)


def raised_threshold(scores: torch.Tensor, thresh: torch.Tensor, cap: int) -> torch.Tensor:
    """fp32 thresholds (..., 1): ``thresh`` where at most ``cap`` finite or +inf entries of the row lie above it;
    elsewhere the smallest value (exactly, by bisection over the fp32 order's keys between the threshold and the row's
    largest finite value: at most 32 counts of the row) with at most ``cap`` entries above it, or that largest finite
    value where the +inf entries alone exceed the cap. scores float (..., L), thresh (..., 1) as for
    ``keep_at_threshold``. The kernel (threshold_triton.py) bisects the same keys in the same steps."""
    length = scores.shape[-1]
    rows = scores.reshape(-1, length)
    t = thresh.reshape(-1, 1).float()
    over = torch.nonzero((rows > t).sum(-1) > cap).view(-1)
    if over.numel():
        x = rows.index_select(0, over).float()
        keys = order_key(x)
        lo = order_key(t.index_select(0, over))
        hi = torch.where(torch.isfinite(x), keys, INT32_MIN).amax(-1, keepdim=True)
        hi = torch.maximum(hi, lo)
        valid = ~torch.isnan(x)
        while True:
            active = hi - lo > 1
            if not bool(active.any()):
                break
            mid = lo + (hi - lo) // 2
            beyond = ((keys > mid) & valid).sum(-1, keepdim=True) > cap
            lo = torch.where(active & beyond, mid, lo)
            hi = torch.where(active & ~beyond, mid, hi)
        t = t.clone()
        t[over] = from_key(hi)
    return t.view(thresh.shape)
