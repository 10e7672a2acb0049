"""Public attention primitives with backend dispatch (``backend="auto"|"triton"|"torch"``).

Each function has the signature and semantics of its PyTorch twin (``*_torch.py``); the docstrings
there state layouts, shapes and dtypes.
"""

from __future__ import annotations

import torch

from . import block_sparse_torch, dense_torch, grouping_torch, selection_torch, token_sparse_torch
from .backend import choose


def attention_dense(q, k, v, *, scale=None, key_padding_mask=None, return_lse=False, backend="auto"):
    """Dense attention. q: (B,H,Nq,D), k/v: (B,H,Nk,D) -> out (B,H,Nq,D) [+ lse (B,H,Nq) fp32]."""
    choose(backend, q, "no Triton kernel is built yet", "attention_dense")
    return dense_torch.attention_dense(q, k, v, scale=scale, key_padding_mask=key_padding_mask,
                                       return_lse=return_lse)


def block_sparse_attention(q, k, v, kv_indices, kv_counts, *, block_q, block_k, scale=None,
                           key_padding_mask=None, return_lse=False, backend="auto"):
    """Block-sparse attention over CSR block lists kv_indices (B,H,nqb,max_k) / kv_counts (B,H,nqb)."""
    choose(backend, q, "no Triton kernel is built yet", "block_sparse_attention")
    return block_sparse_torch.block_sparse_attention(
        q, k, v, kv_indices, kv_counts, block_q=block_q, block_k=block_k, scale=scale,
        key_padding_mask=key_padding_mask, return_lse=return_lse)


def token_sparse_attention(q, k, v, q_groups, kv_tokens, kv_counts, *, scale=None, key_padding_mask=None,
                           return_lse=False, backend="auto"):
    """Token-sparse attention of query groups (B,H,G,C) over KV token lists (B,H,G,max_k)."""
    choose(backend, q, "no Triton kernel is built yet", "token_sparse_attention")
    return token_sparse_torch.token_sparse_attention(
        q, k, v, q_groups, kv_tokens, kv_counts, scale=scale, key_padding_mask=key_padding_mask,
        return_lse=return_lse)


def group_queries(q, group_size, *, backend="auto"):
    """Principal-direction median-split grouping -> int32 (B,H,ceil(N/C),C), -1 pads."""
    choose(backend, q, "grouping runs on PyTorch operations only", "group_queries")
    return grouping_torch.group_queries(q, group_size)


def pooled_block_scores(q, k, *, block_q, block_k, scale=None, backend="auto"):
    """Softmax of mean-pooled Q vs mean-pooled K -> fp32 (B,H,nqb,nkb)."""
    choose(backend, q, "pooled scores run on PyTorch operations only", "pooled_block_scores")
    return selection_torch.pooled_block_scores(q, k, block_q=block_q, block_k=block_k, scale=scale)


def group_kv_mass(q, k, lse, q_groups, *, granularity="token", block_k=None, scale=None,
                  key_padding_mask=None, backend="auto"):
    """Exact per-group KV attention mass -> fp32 (B,H,G,Nk) or (B,H,G,nkb)."""
    choose(backend, q, "no Triton kernel is built yet", "group_kv_mass")
    return selection_torch.group_kv_mass(q, k, lse, q_groups, granularity=granularity, block_k=block_k,
                                         scale=scale, key_padding_mask=key_padding_mask)


def topk_per_row(scores: torch.Tensor, k=None, mass=None):
    """Top-k or cumulative-mass selection per row -> (indices int32 sorted, counts int32)."""
    return selection_torch.topk_per_row(scores, k=k, mass=mass)
