"""Compaction of a kept-token mask in Triton: one program per row streams the mask once and writes the row's
compact list (int16 offsets) and segment ends directly. Twin of ``compact_torch.compact_keep``, which it
replaces on CUDA: the twin's cumulative sum, int64 scatter index and conversions took ~45 ms of an mc_sparse
anchor's selection at Wan 14B (docs/kernel_notes.md, "v6")."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import interpreting
from .compact_torch import SEGMENT, CompactLists


@triton.jit
def _compact_fwd(keep_ptr, low_ptr, seg_ptr, L, W, S, SEGMENT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    base = tl.full([], 0, tl.int32)  # kept columns so far in this row
    for start in range(0, L, BLOCK):
        cols = start + offs
        kept = tl.load(keep_ptr + row * L + cols, mask=cols < L, other=0).to(tl.int32)
        slot = base + tl.cumsum(kept, 0) - 1
        low = ((cols % SEGMENT) - 32768).to(tl.int16)
        tl.store(low_ptr + row * W + slot, low, mask=(kept > 0) & (slot < W))  # a row past the caller's bound: cut
        base += tl.sum(kept, 0)
        end = start + BLOCK
        if (end % SEGMENT == 0) & (end < L):  # BLOCK divides SEGMENT: every inner segment ends at a block's end
            tl.store(seg_ptr + row * S + end // SEGMENT - 1, tl.minimum(base, W))
    tl.store(seg_ptr + row * S + S - 1, tl.minimum(base, W))  # the last segment ends at L


@triton.jit
def _count_fwd(keep_ptr, count_ptr, L, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    total = tl.full([], 0, tl.int32)
    for start in range(0, L, BLOCK):
        cols = start + offs
        total += tl.sum(tl.load(keep_ptr + row * L + cols, mask=cols < L, other=0).to(tl.int32), 0)
    tl.store(count_ptr + row, total)


def count_rows(rows: torch.Tensor) -> torch.Tensor:
    """Kept entries per row: rows bool (R, L) -> int32 (R,), one program per row reading the mask once (a bool
    tensor's sum converts it to int32 first: ~7 ms of the mc_sparse anchor at Wan 14B, docs/kernel_notes.md, "v21")."""
    r, length = rows.shape
    counts = torch.zeros(r, dtype=torch.int32, device=rows.device)
    if r and length:
        _count_fwd[(r,)](rows.contiguous().view(torch.uint8), counts, length,
                         BLOCK=128 if interpreting() else 4096, num_warps=4)
    return counts


def compact_keep(keep: torch.Tensor, segment: int = SEGMENT, width: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as ``compact_torch.compact_keep``: keep bool (..., L), width None or an int bound on the counts
    -> (kv_low int16 (..., W), seg_ends int32 (..., S), counts int32 (...)). Without ``width`` the largest count is
    read back once (as the twin does); with it nothing waits for the host."""
    lists = CompactLists(keep, segment, count=count_rows, width=width)
    if lists.r and lists.length and lists.width:
        block = min(segment, 64 if interpreting() else 2048)
        rows = lists.rows.contiguous().view(torch.uint8)
        _compact_fwd[(lists.r,)](rows, lists.low, lists.seg_ends, lists.length, lists.width, lists.n_seg,
                                 SEGMENT=segment, BLOCK=block, num_warps=4)
    return lists.result()
