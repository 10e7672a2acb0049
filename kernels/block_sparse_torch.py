"""Block-sparse attention over CSR-like block lists, PyTorch twin of the Triton kernel."""

from __future__ import annotations

import math

import torch

from ._checks import (check_block_size, check_counts, check_index, check_qkv, check_scale,
                      check_sorted_unique_in_range)
from ._gather import flat_rows, gather_rows, head_offsets
from ._residual import add_residual_, check_residual
from ._torch_softmax import attend, rows_per_chunk


def check_block_lists(q, k, kv_indices, kv_counts, block_q, block_k, validate=True):
    """Validate block lists against q/k; returns (n_qblk, n_kblk, max_k).

    Shapes, dtypes and block sizes are always checked; ``validate`` adds the value checks (counts in
    range, indices sorted and in range), which read the tensors back (a GPU synchronisation).
    """
    b, h, nq, d = q.shape
    nk = k.shape[2]
    check_block_size("block_q", block_q)
    check_block_size("block_k", block_k)
    n_qblk, n_kblk = math.ceil(nq / block_q), math.ceil(nk / block_k)
    if not isinstance(kv_indices, torch.Tensor) or kv_indices.dim() != 4:
        raise ValueError("kv_indices must be an int32 tensor of shape (B, H, ceil(Nq/block_q), max_k)")
    max_k = kv_indices.shape[3]
    check_index("kv_indices", kv_indices, (b, h, n_qblk, max_k), q.device)
    check_index("kv_counts", kv_counts, (b, h, n_qblk), q.device)
    if validate:
        check_counts("kv_counts", kv_counts, max_k)
        check_sorted_unique_in_range("kv_indices", kv_indices, kv_counts, n_kblk)
    return n_qblk, n_kblk, max_k


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_indices: torch.Tensor,
                           kv_counts: torch.Tensor, *, block_q: int, block_k: int, scale: float | None = None,
                           validate: bool = True, residual=None):
    """Attention of every query block over its own list of KV blocks; skipped blocks count as -inf.

    q: (B, H, Nq, D); k, v: (B, H, Nk, D); fp16/bf16/fp32, fp32 accumulation.
    kv_indices: int32 (B, H, ceil(Nq/block_q), max_k), the KV block ids of each query block, strictly
    increasing within the first ``kv_counts`` entries (the rest is ignored); kv_counts: int32
    (B, H, ceil(Nq/block_q)). block_q, block_k: 64 or 128.
    Returns out (B, H, Nq, D) in q's dtype. A query with nothing to attend gets out 0.
    ``validate=False`` skips the value checks of the lists (for lists the engine built itself).
    residual: None or a (data, scale) pair (kernels/_residual.py): out = attention + data * scale in fp32,
    cast once; a query with nothing to attend gets exactly the residual.
    """
    b, h, nq, nk, d = check_qkv(q, k, v)
    scale = check_scale(scale, d)
    n_qblk, _, max_k = check_block_lists(q, k, kv_indices, kv_counts, block_q, block_k, validate)
    res = check_residual(residual, q)
    dev = q.device
    out = torch.zeros((b * h, n_qblk * block_q, d), dtype=torch.float32, device=dev)
    if max_k > 0:
        qpad = torch.zeros((b * h, n_qblk * block_q, d), dtype=q.dtype, device=dev)
        qpad[:, :nq] = q.reshape(b * h, nq, d)
        qblocks = qpad.view(b * h * n_qblk, block_q, d)
        idx = kv_indices.reshape(b * h * n_qblk, max_k).long()
        cnt = kv_counts.reshape(b * h * n_qblk, 1).long()
        # token ids of each group's key list: (G, max_k * block_k)
        tok = (idx.unsqueeze(-1) * block_k + torch.arange(block_k, device=dev)).view(-1, max_k * block_k)
        slot = torch.arange(max_k, device=dev).repeat_interleave(block_k).view(1, -1)
        bh_of_group = torch.arange(b * h, device=dev).repeat_interleave(n_qblk)
        off = head_offsets(b, h, nk, dev).view(-1)[bh_of_group].view(-1, 1)
        kr, vr = flat_rows(k), flat_rows(v)
        length = max_k * block_k
        step = rows_per_chunk(block_q * length * 2 + length * d * 2, qblocks.shape[0])
        o_view = out.view(b * h * n_qblk, block_q, d)
        for g0 in range(0, qblocks.shape[0], step):
            sl = slice(g0, g0 + step)
            t = tok[sl]
            valid = (slot < cnt[sl]) & (t < nk)
            t = t.clamp(0, nk - 1)
            o, _ = attend(qblocks[sl].float(), gather_rows(kr, t + off[sl]), gather_rows(vr, t + off[sl]), valid,
                          scale)
            o_view[sl] = o
    out = out[:, :nq].reshape(b, h, nq, d)
    return add_residual_(out, res).to(q.dtype)
