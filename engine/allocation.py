"""Adaptive allocation: one call's budget of key blocks spread over its heads and query blocks by score
(docs/method.md, "Adaptive allocation").

A uniform density gives every query block of every head the same count of key blocks. Heads and rows differ: a
local head's row has most of its mass in a few blocks, a global head's row spreads it. ``allocation: adaptive``
keeps the call's total (per batch element and key segment) and gives the blocks to the highest pooled scores over
all heads and rows of the call, so the budget goes where the estimated mass is.
"""

from __future__ import annotations

import torch


def pooled_counts(scores: torch.Tensor, counts: torch.Tensor, owner: torch.Tensor,
                  dense_pair: torch.Tensor) -> torch.Tensor:
    """Per-row block counts with the same total per (batch element, key segment) as ``counts``, given to the
    highest scores over all heads and rows.

    scores: float (B, H, R, L) >= 0, +inf on forced entries (pooled block probabilities: each row sums to 1, so
    rows of different heads compare); counts: int64 (B, H, R, S) the uniform counts per row and key segment,
    forced entries included; owner: int64 (L,) the key segment of each column; dense_pair: float or bool (R, S),
    nonzero where the row keeps the whole segment. Returns int64 (B, H, R, S): rows of dense pairs and rows with
    no free entry to choose keep their counts; every other row keeps its forced entries and at least its best
    free one, and the rest of the segment's budget goes to the highest free scores of the call.
    """
    b, h, r, n_seg = counts.shape
    out = counts.clone()
    for s in range(n_seg):
        cols = torch.nonzero(owner == s).view(-1)
        if cols.numel() == 0:
            continue
        sc = scores[..., cols].float()
        forced = torch.isinf(sc)
        n_forced = forced.sum(-1)  # (B, H, R)
        free_cnt = (counts[..., s] - n_forced).clamp(min=0)
        n_free = (~forced).sum(-1)
        picks = (dense_pair[:, s] == 0).view(1, 1, r) & (free_cnt > 0) & (n_free > 0)  # rows that choose
        free = torch.where(forced, torch.full_like(sc, -1.0), sc.clamp(min=0))
        best = free.argmax(-1, keepdim=True)
        cand = free.scatter(-1, best, -1.0)  # every choosing row keeps its best free entry anyway
        cand = torch.where(picks.unsqueeze(-1), cand, torch.full_like(cand, -1.0))
        # the budget left after each choosing row's best entry, per batch element
        extra = (torch.where(picks, free_cnt, torch.zeros_like(free_cnt)).sum((1, 2)) - picks.sum((1, 2)))
        for i in range(b):
            flat = cand[i].reshape(-1)
            e = min(int(extra[i]), int((flat >= 0).sum()))
            added = torch.zeros(flat.shape, dtype=torch.int64, device=flat.device)
            if e > 0:
                added[torch.topk(flat, e, sorted=False).indices] = 1
            per_row = n_forced[i] + 1 + added.view(h, r, -1).sum(-1)
            out[i, ..., s] = torch.where(picks[i], per_row, counts[i, ..., s])
    return out
