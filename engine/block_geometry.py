"""Block-level geometry of a token layout: which blocks hold text, where image blocks sit in (F, H, W).

Used by the block policies: text rows/columns stay dense (docs/method.md, "Modalities") and local windows are measured
between block centroids in the latent grid.
"""

from __future__ import annotations

import math

import torch

from .context import TokenLayout


def token_coords(n: int, layout: TokenLayout, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(coords float (N, 3) as (frame, row, col) for image tokens, is_text bool (N,)).

    Tokens outside the grid span (text, extra tokens) are flagged ``is_text``; without a grid the image
    tokens are laid on one row (1-D positions).
    """
    start, end = layout.image_span(n)
    is_text = torch.ones(n, dtype=torch.bool, device=device)
    is_text[start:end] = False
    pos = torch.arange(end - start, device=device, dtype=torch.float32)
    coords = torch.zeros((n, 3), dtype=torch.float32, device=device)
    if layout.grid is not None and math.prod(layout.grid) == end - start:
        f, h, w = layout.grid
        coords[start:end, 0] = torch.div(pos, h * w, rounding_mode="floor")
        coords[start:end, 1] = torch.div(pos, w, rounding_mode="floor") % h
        coords[start:end, 2] = pos % w
    else:
        coords[start:end, 2] = pos
    return coords, is_text


def block_summary(n: int, block: int, layout: TokenLayout, device):
    """Per block of ``block`` tokens: (centroid (nb, 3) of its image tokens, has_text bool (nb,))."""
    coords, is_text = token_coords(n, layout, device)
    nb = math.ceil(n / block)
    pad = nb * block - n
    img = (~is_text).float()
    c = torch.nn.functional.pad(coords * img.unsqueeze(-1), (0, 0, 0, pad)).view(nb, block, 3).sum(1)
    cnt = torch.nn.functional.pad(img, (0, pad)).view(nb, block).sum(1)
    has_text = torch.nn.functional.pad(is_text.float(), (0, pad)).view(nb, block).sum(1) > 0
    return c / cnt.clamp(min=1).unsqueeze(-1), has_text


def rows_topk(scores: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the ``counts`` highest-scoring columns, sorted ascending.

    scores: float (..., L) (+inf marks forced entries); counts: int (...) in [0, L].
    Returns (indices int32 (..., K) with -1 past each count, counts int32 (...)), K = max(counts).
    """
    length = scores.shape[-1]
    counts = counts.clamp(0, length)
    width = int(counts.max()) if counts.numel() else 0
    if width == 0:
        return (torch.full((*scores.shape[:-1], 0), -1, dtype=torch.int32, device=scores.device),
                counts.to(torch.int32))
    top = torch.topk(scores, width, dim=-1, sorted=True).indices
    keep = torch.arange(width, device=scores.device) < counts.unsqueeze(-1)
    idx = torch.sort(torch.where(keep, top, torch.full_like(top, length)), dim=-1).values
    idx = torch.where(idx == length, torch.full_like(idx, -1), idx)
    return idx.to(torch.int32), counts.to(torch.int32)


SAMPLE = 4096


def rows_above_threshold(scores: torch.Tensor, k: int, iters: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    """About the ``k`` largest entries of each row, sorted ascending, without a full top-k.

    scores: float (R, L) >= 0 (+inf marks forced entries). Each row keeps the entries above a threshold:
    for short rows (L <= 4 * SAMPLE) found by bisection in log space so the count is exactly k; for long rows
    estimated from a fixed sample of SAMPLE columns (the k*SAMPLE/L-th largest sampled value), one pass
    instead of ~20, so the count is k up to sampling noise (a few %). Entries tied at the threshold fill the
    row up to k in index order (k equal keys beyond the budget keep k of them, never none). The kept entries
    are compacted in order with a cumulative sum and a scatter: linear passes instead of sorting every row,
    which matters at L = 75k tokens and thousands of rows. Returns (indices int32 (R, W) with -1 past each
    count, counts int32 (R,)), W = max count.
    """
    r, length = scores.shape
    k = max(0, min(k, length))
    if length > 4 * SAMPLE and 0 < k < length:
        step = length / SAMPLE
        cols = (torch.arange(SAMPLE, device=scores.device, dtype=torch.float64) * step + step / 2).long()
        sample = scores[:, cols]
        rank = max(1, min(SAMPLE, round(k * SAMPLE / length)))
        thresh = torch.topk(sample, rank, dim=-1).values[:, -1:]
        above, tied = scores > thresh, scores == thresh
    else:
        finite = torch.where(torch.isinf(scores), torch.zeros_like(scores), scores)
        top = finite.amax(-1, keepdim=True).clamp(min=1e-30)
        lo = torch.log(top) - 46.0  # e^-46 ~ 1e-20 of the row's largest value
        hi = torch.log(top)
        for _ in range(iters):
            mid = (lo + hi) / 2
            over = (scores > torch.exp(mid)).sum(-1, keepdim=True) > k
            lo = torch.where(over, mid, lo)
            hi = torch.where(over, hi, mid)
        above = scores > torch.exp(hi)  # at most k entries (or every forced one)
        tied = (scores > torch.exp(lo)) & ~above  # the band the bisection could not split: equal values
    room = (k - above.sum(-1, keepdim=True)).clamp(min=0)
    keep = above | (tied & (torch.cumsum(tied, dim=-1, dtype=torch.int32) <= room))
    pos = torch.cumsum(keep, dim=-1, dtype=torch.int32) - 1
    counts = keep.sum(-1).to(torch.int32)
    width = int(counts.max()) if counts.numel() else 0
    out = torch.full((r, width + 1), -1, dtype=torch.int32, device=scores.device)
    cols = torch.arange(length, dtype=torch.int32, device=scores.device).expand(r, length)
    out.scatter_(1, torch.where(keep, pos, width).long(), cols)
    return out[:, :width].contiguous(), counts
