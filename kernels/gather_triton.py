"""A row gather in Triton for the query grouping: ``rows[index]``, many rows a program. Twin:
``gather_torch.gather_rows`` (``index_select``), which it replaces on CUDA: PyTorch's gathers took ~1.85 ms for the
3 M rows of one grouping level at Wan 14B whether a row held 16 or 128 values, local indices or not
(bench/gather_rows.py; docs/kernel_notes.md, "v21"), ~17 ms of the grouping's ~39."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import interpreting


@triton.jit
def _rows_fwd(src_ptr, idx_ptr, out_ptr, M, D: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = r < M
    i = tl.load(idx_ptr + r, mask=inside, other=0)
    cols = tl.arange(0, D)
    v = tl.load(src_ptr + i[:, None] * D + cols[None, :], mask=inside[:, None], other=0.0)
    tl.store(out_ptr + r[:, None] * D + cols[None, :], v, mask=inside[:, None])


def gather_rows(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """rows float (R, D) contiguous, D in _checks.GATHER_WIDTHS; index int64 (M,) of rows (not checked: the
    grouping's own) -> rows[index], (M, D) of rows' dtype, as ``rows.index_select(0, index)``."""
    m, d = index.numel(), rows.shape[1]
    out = torch.empty((m, d), dtype=rows.dtype, device=rows.device)
    if m:
        block = 64 if interpreting() else max(32, 4096 // d)
        _rows_fwd[(triton.cdiv(m, block),)](rows.contiguous(), index.contiguous(), out, m, D=d, BLOCK=block,
                                            num_warps=4)
    return out
