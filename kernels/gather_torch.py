"""A row gather: ``rows[index]`` by ``index_select`` (PyTorch twin of ``gather_triton``; the query grouping's gather of
each level's points, kernels/grouping_torch.py)."""

from __future__ import annotations

import torch


def gather_rows(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """rows float (R, D), index int64 (M,) of rows -> rows[index], (M, D) of rows' dtype: a row gather
    (index_select) rather than an element-wise gather with an expanded index."""
    return rows.index_select(0, index)
