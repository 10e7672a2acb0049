"""Masked softmax-attention on gathered rows: the shared core of the PyTorch backend.

Only standard tensor operations (matmul, gather, masked fill) so it runs on any torch device
(docs/method.md, "Backends"). Work is chunked so no temporary exceeds ``CHUNK_ELEMS``
fp32 score elements.
"""

from __future__ import annotations

import torch

# Upper bound on fp32 score elements held at once (64 Mi elements = 256 MiB).
CHUNK_ELEMS = 1 << 26


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of each query row over its own key rows, fp32 throughout.

    q: (G, M, D) fp32; k, v: (G, L, D) fp32; valid: bool (G, L) or (G, M, L) (True = key may be
    attended) or None. Returns (out (G, M, D) fp32, lse (G, M) fp32, natural log). Rows with no
    valid key get out = 0 and lse = -inf, never NaN: masked keys count as -inf, not as zeros.
    """
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if valid is not None:
        if valid.dim() == 2:
            valid = valid.unsqueeze(1)
        s = s.masked_fill(~valid, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m_safe)
    denom = p.sum(dim=-1, keepdim=True)
    empty = denom == 0
    out = torch.matmul(p, v) / torch.where(empty, torch.ones_like(denom), denom)
    lse = torch.where(empty, torch.full_like(denom, float("-inf")), m_safe + torch.log(denom))
    return out, lse.squeeze(-1)


def rows_per_chunk(row_cost: int, total_rows: int) -> int:
    """How many independent rows (each costing ``row_cost`` fp32 elements) fit in one chunk."""
    return max(1, min(total_rows, CHUNK_ELEMS // max(1, row_cost)))
