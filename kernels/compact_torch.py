"""Compaction of a kept-token mask into mc_sparse's compact KV lists (PyTorch twin of ``compact_triton``).

The lists are what ``engine.selection.TokenSelection`` stores: per row, the kept columns in ascending order as
int16 offsets inside 65536-token segments, plus where each segment's entries end (docs/kernel_notes.md, "v6").
"""

from __future__ import annotations

import torch

SEGMENT = 1 << 16     # tokens per segment of the compact lists (int16 offsets)
LOW_PAD = -32768      # kv_low of the slots past a row's count: token 0's offset, never read by the kernels
CHUNK_ELEMS = 1 << 26  # mask entries worked on at a time (int64 scatter index: 512 MiB)


def check_compact_args(keep, segment) -> None:
    """ValueError unless keep is a bool tensor with at least one dimension and segment a power of two in
    [16, 65536]."""
    if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool or keep.dim() < 1:
        raise ValueError("keep must be a bool tensor (..., L)")
    if not isinstance(segment, int) or isinstance(segment, bool) or not 16 <= segment <= SEGMENT \
            or segment & (segment - 1):
        raise ValueError(f"segment must be a power of two in [16, {SEGMENT}], got {segment!r}")


LIST_ALIGN = 16  # list widths are multiples of this: Triton compiles integers divisible by 16 (the lists' row
# stride) separately, and a width that follows the data would switch between the two mid-run (docs/kernel_notes.md,
# "v7"); aligned rows also let the kernels load their offsets in wide vectors


def aligned_width(width: int) -> int:
    """``width`` rounded up to a multiple of LIST_ALIGN (0 stays 0)."""
    return -(-width // LIST_ALIGN) * LIST_ALIGN


class CompactLists:
    """What both implementations of ``compact_keep`` start from: the checked mask as rows (R, L), the counts
    int32 (R,), the width W (the caller's bound, or the largest count read back once; rounded up to a multiple of
    LIST_ALIGN; counts clamped to it), and the outputs kv_low (filled with LOW_PAD) and seg_ends (zeros), which the
    caller fills; ``result()`` shapes them back to the mask's leading dims."""

    def __init__(self, keep: torch.Tensor, segment: int, count=None, width: int | None = None):
        check_compact_args(keep, segment)
        if width is not None and (not isinstance(width, int) or isinstance(width, bool) or width < 0):
            raise ValueError(f"width must be None or an int >= 0, got {width!r}")
        self.lead, self.length = keep.shape[:-1], keep.shape[-1]
        self.rows = keep.reshape(-1, self.length)
        self.r = self.rows.shape[0]
        # count: rows (R, L) bool -> int32 (R,) kept per row; the Triton path passes a kernel that reads the mask
        # once instead of the sum's int32 copy of it (docs/kernel_notes.md, "v21")
        self.counts = self.rows.sum(-1, dtype=torch.int32) if count is None else count(self.rows)
        if width is None:
            self.width = aligned_width(int(self.counts.max())) if self.r else 0
        else:  # the caller's bound: no read back (docs/kernel_notes.md, "v27"); a row beyond it keeps its first W
            self.width = aligned_width(min(width, self.length))
            self.counts.clamp_(max=self.width)
        self.n_seg = max(1, -(-self.length // segment))
        self.low = torch.full((self.r, self.width), LOW_PAD, dtype=torch.int16, device=keep.device)
        self.seg_ends = torch.zeros((self.r, self.n_seg), dtype=torch.int32, device=keep.device)

    def result(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (self.low.view(*self.lead, self.width), self.seg_ends.view(*self.lead, self.n_seg),
                self.counts.view(self.lead))


def compact_keep(keep: torch.Tensor, segment: int = SEGMENT, width: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kept columns of each row as compact sorted lists.

    keep: bool (..., L), True where a row keeps that column (token). Returns
      kv_low int16 (..., W): the j-th kept column c of the row as (c mod segment) - 32768, LOW_PAD past the count;
      seg_ends int32 (..., S): the number of the row's kept columns below (s + 1) * segment, S = ceil(L / segment)
        (at least 1), i.e. where segment s's entries end in the list;
      counts int32 (...): kept columns per row.
    W is the largest count rounded up to a multiple of LIST_ALIGN (0 when nothing is kept), read back from the
    device; ``width``: a bound on every row's count the caller knows on the host (keep_top's ``keep_bound``), so
    nothing is read back; W is then ``width`` rounded up, and a row keeping more than W columns (a broken bound)
    keeps its first W, counted as W. Decoding: column = low + 32768 + segment * (number of seg_ends at or below the
    slot), as ``decode_lists`` does.
    """
    lists = CompactLists(keep, segment, width=width)
    rows, r, length, width, n_seg = lists.rows, lists.r, lists.length, lists.width, lists.n_seg
    low, seg_ends, dev = lists.low, lists.seg_ends, keep.device
    if r and length:
        ends = torch.tensor([min((s + 1) * segment, length) - 1 for s in range(n_seg)], device=dev)
        cols = torch.arange(length, dtype=torch.int32, device=dev)
        vals = (cols % segment - 32768).to(torch.int16)
        step = max(1, CHUNK_ELEMS // length)
        for r0 in range(0, r, step):
            k = rows[r0:r0 + step]
            pos = torch.cumsum(k, dim=-1, dtype=torch.int32)
            seg_ends[r0:r0 + step] = pos[:, ends].clamp_(max=width)
            slot = torch.where(k & (pos <= width), pos.sub_(1), width).long()
            del pos
            buf = torch.full((k.shape[0], width + 1), LOW_PAD, dtype=torch.int16, device=dev)
            buf.scatter_(1, slot, vals.expand(k.shape[0], length))
            low[r0:r0 + step] = buf[:, :width]
    return lists.result()


def decode_lists(kv_low: torch.Tensor, seg_ends: torch.Tensor, segment: int = SEGMENT) -> torch.Tensor:
    """Compact lists (kv_low int16 (..., W), seg_ends int32 (..., S), as ``compact_keep`` writes them) -> int32 token
    lists (..., W16), W16 = W rounded up to a multiple of LIST_ALIGN; entries past a row's count are meaningless.
    The token-sparse kernels decode in registers instead (``token_sparse_attention_compact``); this is for the
    PyTorch twin, reports and tests."""
    width = kv_low.shape[-1]
    padded = aligned_width(width)
    slot = torch.arange(padded, device=kv_low.device, dtype=torch.int32)
    out = torch.empty((*kv_low.shape[:-1], padded), dtype=torch.int32, device=kv_low.device)
    out[..., width:] = 0  # the alignment slots (never read below a count: any value would do)
    out[..., :width] = kv_low
    out[..., :width] += 32768
    for s in range(seg_ends.shape[-1]):  # slots at or past segment s's end belong to a later one
        out.add_((slot >= seg_ends[..., s:s + 1]).to(torch.int32).mul_(segment))
    return out
