"""Attention primitives: Triton kernels and their PyTorch twins behind one API.

Layout (B, H, N, D) throughout; see each function's docstring. ``backend="auto"`` runs Triton on
CUDA when it imports and supports the case, else the PyTorch twin (any torch device).
"""

from .api import (attention_dense, block_anchor_attention, block_sparse_attention, block_sparse_on_triton, compact_keep,
                  group_kv_mass, group_queries, keep_at_threshold, pooled_block_scores, release_graphs, residual_of,
                  token_sparse_attention, token_sparse_attention_compact)
from .backend import BACKENDS, triton_available
from .grouping_torch import scratch_bytes as group_queries_scratch
from .replay import CallReplay
from .side_stream import Pending, beside

__all__ = [
    "BACKENDS", "CallReplay", "Pending", "attention_dense", "beside", "block_anchor_attention",
    "block_sparse_attention", "block_sparse_on_triton", "compact_keep", "group_kv_mass",
    "group_queries", "group_queries_scratch", "keep_at_threshold",
    "pooled_block_scores", "release_graphs", "residual_of", "token_sparse_attention", "token_sparse_attention_compact",
    "triton_available",
]
