"""A row threshold applied with a budget: the last step of the mc_sparse anchor's top-k on long rows (PyTorch twin of
``threshold_triton``; engine/block_geometry.py's ``keep_top`` estimates the threshold, docs/kernel_notes.md, "v21")."""

from __future__ import annotations

import torch


def check_threshold_args(scores, thresh, k) -> None:
    """ValueError unless scores is a floating tensor (..., L), thresh a tensor (..., 1) of the same leading shape,
    dtype and device (a threshold of another precision would compare differently in the kernel and the twin), and k
    an int >= 0."""
    if not isinstance(scores, torch.Tensor) or not scores.is_floating_point() or scores.dim() < 1:
        raise ValueError("scores must be a floating tensor (..., L)")
    if not isinstance(thresh, torch.Tensor) or thresh.dtype != scores.dtype \
            or tuple(thresh.shape) != (*scores.shape[:-1], 1) or thresh.device != scores.device:
        raise ValueError(f"thresh must be a {scores.dtype} tensor of shape {(*scores.shape[:-1], 1)} on "
                         f"{scores.device}, got {getattr(thresh, 'dtype', type(thresh).__name__)} "
                         f"{tuple(getattr(thresh, 'shape', ()))}")
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ValueError(f"k must be an int >= 0, got {k!r}")


def keep_at_threshold(scores: torch.Tensor, thresh: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's entries above its threshold, plus the entries equal to it in index order while the row holds
    fewer than k: scores float (..., L), any strides; thresh (..., 1) of scores' dtype; k int >= 0.
    Returns bool (..., L): ``s > t``, and ``s == t`` for the first ``max(0, k - count(s > t))`` ties of the row
    (a row with more than k entries above its threshold keeps all of them; NaN is never kept).

    Where every row's ties fit its room (the usual case: the threshold is one sampled value) no prefix count over
    the (rows, L) mask is needed; the check costs one host synchronisation, which the Triton kernel does not need
    (it counts and fills in one program per row)."""
    above, tied = scores > thresh, scores == thresh
    room = (k - above.sum(-1, keepdim=True)).clamp(min=0)
    fits = tied.sum(-1, keepdim=True) <= room
    if not bool((~fits & (room > 0)).any()):
        return above | (tied & fits)
    return above | (tied & (torch.cumsum(tied, dim=-1, dtype=torch.int32) <= room))
