"""A row threshold applied with a budget in Triton: one program per row reads the row twice (count above the
threshold, then write the mask with the ties filled in index order; a row over its cap first raises its threshold,
docs/kernel_notes.md, "v27") and never waits for the host. Twin of
``threshold_torch.keep_at_threshold``, which it replaces on CUDA: the twin's comparisons, bool sums (each an int64
copy of the mask) and the host check took ~45 ms of an mc_sparse anchor at Wan 14B (docs/kernel_notes.md, "v21")."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import interpreting


@triton.jit
def _order_key(x):
    """fp32 -> int32 whose order is the floats' order (sign-magnitude bits to two's complement)."""
    i = x.to(tl.int32, bitcast=True)
    return tl.where(i >= 0, i, i ^ 0x7FFFFFFF)


@triton.jit
def _from_key(key):
    """``_order_key``'s inverse: an int64 key in int32 range -> the fp32 value."""
    i = key.to(tl.int32)
    return tl.where(i >= 0, i, i ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _count_above(base, t, L, BLOCK: tl.constexpr):
    """How many of the row's L entries at ``base`` lie above the fp32 threshold t (a pass over the row)."""
    offs = tl.arange(0, BLOCK)
    above_n = tl.full([], 0, tl.int32)
    for start in range(0, L, BLOCK):
        cols = start + offs
        inside = cols < L
        s = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
        above_n += tl.sum(((s > t) & inside).to(tl.int32), 0)
    return above_n


@triton.jit
def _keep_fwd(s_ptr, t_ptr, out_ptr, INNER, L, stride_outer, stride_inner, K, CAP, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = s_ptr + (row // INNER) * stride_outer + (row % INNER) * stride_inner
    t = tl.load(t_ptr + row).to(tl.float32)  # compared in fp32: exact for fp16 / bf16 scores too
    offs = tl.arange(0, BLOCK)
    above_n = _count_above(base, t, L, BLOCK)
    if above_n > CAP:  # the threshold raised until at most CAP lie above it (threshold_torch.raised_threshold)
        lo = _order_key(t).to(tl.int64)
        hi = tl.full([], -2147483648, tl.int64)  # the largest finite value's key
        for start in range(0, L, BLOCK):
            cols = start + offs
            s = tl.load(base + cols, mask=cols < L, other=0.0).to(tl.float32)
            finite = (cols < L) & (tl.abs(s) < float("inf"))
            hi = tl.maximum(hi, tl.max(tl.where(finite, _order_key(s), -2147483648), 0).to(tl.int64))
        hi = tl.maximum(hi, lo)
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            over_n = tl.full([], 0, tl.int32)
            for start in range(0, L, BLOCK):
                cols = start + offs
                s = tl.load(base + cols, mask=cols < L, other=0.0).to(tl.float32)
                over_n += tl.sum(((cols < L) & (s == s) & (_order_key(s).to(tl.int64) > mid)).to(tl.int32), 0)
            lo = tl.where(over_n > CAP, mid, lo)
            hi = tl.where(over_n > CAP, hi, mid)
        t = _from_key(hi)
        above_n = _count_above(base, t, L, BLOCK)
    room = tl.maximum(K - above_n, 0)
    tied_n = tl.full([], 0, tl.int32)  # ties before this block
    for start in range(0, L, BLOCK):
        cols = start + offs
        inside = cols < L
        s = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
        tied = ((s == t) & inside).to(tl.int32)
        rank = tied_n + tl.cumsum(tied, 0)
        keep = ((s > t) & inside) | ((tied > 0) & (rank <= room))
        tl.store(out_ptr + row * L + cols, keep.to(tl.uint8), mask=inside)
        tied_n += tl.sum(tied, 0)


def _rows_view(scores: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """scores (..., L) with unit last stride as (outer, inner, L) without a copy where its strides allow one:
    returns (tensor, inner, outer stride, inner stride); a layout no two strides describe is copied contiguous."""
    length = scores.shape[-1]
    lead = scores.shape[:-1]
    for cut in range(len(lead) + 1):  # merge lead[:cut] into outer, lead[cut:] into inner
        try:
            outer = scores.view(-1, *lead[cut:], length) if cut else scores.unsqueeze(0)
            three = outer.view(outer.shape[0], -1, length)
        except RuntimeError:
            continue
        return three, three.shape[1], three.stride(0), three.stride(1)
    three = scores.contiguous().view(1, -1, length)
    return three, three.shape[1], three.stride(0), three.stride(1)


def keep_at_threshold(scores: torch.Tensor, thresh: torch.Tensor, k: int, cap: int | None = None) -> torch.Tensor:
    """Same contract as ``threshold_torch.keep_at_threshold``: scores float (..., L) (fp32/fp16/bf16, any leading
    strides), thresh (..., 1) of scores' dtype, k int >= 0, cap int >= k or None -> bool (..., L), contiguous. A row
    over the cap bisects its raised threshold in the program that reads it (a pass over the row per step, at most
    32), so the call never waits for the host."""
    length = scores.shape[-1]
    out = torch.empty(scores.shape, dtype=torch.bool, device=scores.device)
    rows = out.numel() // length if length else 0
    if rows == 0:
        return out
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    three, inner, s_outer, s_inner = _rows_view(scores)
    t = thresh.reshape(rows).contiguous()  # scores' dtype (check_threshold_args)
    block = 128 if interpreting() else 2048  # several blocks a row in the interpreter's tests too
    _keep_fwd[(rows,)](three, t, out.view(torch.uint8), inner, length, s_outer, s_inner, min(k, 2**31 - 1),
                       min(length if cap is None else cap, 2**31 - 1), BLOCK=block, num_warps=8)
    return out
