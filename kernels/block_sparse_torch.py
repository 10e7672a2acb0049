"""Block-sparse attention over CSR-like block lists, PyTorch twin of the Triton kernel."""

from __future__ import annotations

import math

import torch

from ._checks import (check_block_size, check_counts, check_index, check_qkv, check_scale,
                      check_sorted_unique_in_range)
from ._gather import Scratch, blocks_of, flat_rows
from ._residual import add_residual_, check_residual, mass_weight, residual_mass
from . import _torch_softmax
from ._torch_softmax import attend, chunk_rows, fused_sdpa, plan_chunks, sdpa


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
                           validate: bool = True, residual=None, return_lse: bool = False):
    """Attention of every query block over its own list of KV blocks; skipped blocks count as -inf.

    q: (B, H, Nq, D); k, v: (B, H, Nk, D); fp16/bf16/fp32 (SDPA runs in that dtype, softmax in fp32).
    kv_indices: int32 (B, H, ceil(Nq/block_q), max_k), the KV block ids of each query block, strictly
    increasing within the first ``kv_counts`` entries (the rest is ignored); kv_counts: int32
    (B, H, ceil(Nq/block_q)). block_q, block_k: 64 or 128.
    Returns out (B, H, Nq, D) in q's dtype. A query with nothing to attend gets out 0.
    ``validate=False`` skips the value checks of the lists (for lists the engine built itself).
    residual: None or a (data, scale) pair (kernels/_residual.py): out = attention + data * scale in fp32,
    cast once; a query with nothing to attend gets exactly the residual. A (data, scale, mass) triple weights the
    residual by the mass (kernels/_residual.py, ``mass_weight``), from this call's row LSE.
    return_lse: also return the row LSE of the sparse attention, fp32 (B, H, Nq), natural log, -inf for queries
    with nothing to attend: (out, lse). The LSE takes one more fp32 score matmul per chunk.

    How: query blocks are sorted by key length (their count of blocks, less the padding of a ragged last
    KV block when they hold it); each chunk of equal-length rows gathers its K/V blocks (index_select) and
    runs one batched SDPA over (query block, gathered keys) without any mask; only merged short runs of
    different lengths carry a key-padding mask. Rows listing every block attend k/v as they are (one SDPA
    per head, no gather). Empty rows are skipped (zeros, never NaN). fp32 on CPU runs the rows as batched
    matmuls instead of SDPA (``_torch_softmax.attend``). Extra memory: one chunk of gathered K/V
    (``_torch_softmax.gather_budget``), int64 query ids (B*H*Nq), and padded copies of k/v when Nk is not
    a multiple of block_k. Ops: gather, index_select, argsort (on the CPU copy of the counts),
    scaled_dot_product_attention (or baddbmm, softmax, bmm), index_put_ — all on CPU, CUDA
    and Apple MPS.
    """
    b, h, nq, nk, d = check_qkv(q, k, v)
    scale = check_scale(scale, d)
    n_qblk, n_kblk, max_k = check_block_lists(q, k, kv_indices, kv_counts, block_q, block_k, validate)
    res = check_residual(residual, q)
    mass = residual_mass(residual, q) if res is not None else None
    want_lse = return_lse or mass is not None
    dev = q.device
    out = torch.zeros((b * h * nq, d), dtype=q.dtype, device=dev)
    lse = torch.full((b * h * nq,), float("-inf"), dtype=torch.float32, device=dev) if want_lse else None
    if max_k > 0:
        idx = kv_indices.reshape(-1, max_k).long()
        cnt = kv_counts.reshape(-1).long()
        # key length of each row: its blocks, less the padding of the ragged last KV block when listed
        # (sorted lists hold that block, if at all, in their last slot)
        tail = n_kblk * block_k - nk
        last = idx.gather(1, (cnt - 1).clamp(min=0, max=max_k - 1).unsqueeze(1)).squeeze(1)
        lens = cnt * block_k - torch.where((cnt > 0) & (last == n_kblk - 1), tail, 0)
        lens_cpu = lens.cpu()
        order_cpu = torch.argsort(lens_cpu, descending=True, stable=True)
        n_rows = int((lens_cpu > 0).sum())
        n_full = int((lens_cpu == nk).sum())  # rows listing every KV block: they come first in the order
        # query token ids of every row (flat over B*H*Nq); the ragged last block repeats its last query,
        # whose duplicate output lands on that same query (same q, same keys: the same value)
        row = torch.arange(b * h * n_qblk, device=dev)
        slot = torch.arange(block_q, device=dev)
        qtok = (torch.div(row, n_qblk, rounding_mode="floor") * nq).view(-1, 1) \
            + ((row % n_qblk).view(-1, 1) * block_q + slot).clamp(max=nq - 1)
        qr = flat_rows(q)
        scratch = Scratch.get(q.dtype, dev)
        if n_full:
            _full_rows(q, k, v, qr, qtok, out, order_cpu[:n_full], n_qblk, scale, scratch, lse)
        sorted_lens = lens_cpu[order_cpu[n_full:n_rows]].tolist()
        order = order_cpu[n_full:n_rows].to(dev)
        kb, vb = blocks_of(k, block_k), blocks_of(v, block_k)
        kv_base = torch.div(row, n_qblk, rounding_mode="floor") * n_kblk

        def max_rows(length: int) -> int:
            return chunk_rows(dev, block_q, -(-length // block_k) * block_k, d)

        for s0, s1, longest, mixed in plan_chunks(sorted_lens, max_rows):
            rows = order[s0:s1]
            nb = -(-longest // block_k)
            blk = idx.index_select(0, rows)[:, :nb].clamp(0, n_kblk - 1) + kv_base.index_select(0, rows).view(-1, 1)
            r = rows.numel()
            tok = qtok.index_select(0, rows).view(-1)
            qg = scratch.take("q", qr, tok).view(r, 1, block_q, d)
            kg = scratch.take("k", kb, blk.view(-1)).view(r, 1, nb * block_k, d)[:, :, :longest]
            vg = scratch.take("v", vb, blk.view(-1)).view(r, 1, nb * block_k, d)[:, :, :longest]
            o = attend(qg, kg, vg, lens.index_select(0, rows) if mixed else None, scale, scratch)
            out.index_put_((tok,), o.reshape(r * block_q, d))
            if lse is not None:
                lse.index_put_((tok,), _rows_lse(qg, kg, lens.index_select(0, rows) if mixed else None, scale))
    out = out.view(b, h, nq, d)
    if lse is not None:
        lse = lse.view(b, h, nq)
    if res is not None:
        out = add_residual_(out.float(), res, None if mass is None else mass_weight(lse, mass)).to(q.dtype)
    return (out, lse) if return_lse else out


def _rows_lse(qg, kg, lengths, scale):
    """Row LSE (fp32, flat over the chunk's queries) of qg (R, 1, M, D) over kg (R, 1, L, D), keys past
    ``lengths`` (int64 (R,) or None) left out."""
    s = torch.matmul(qg.float(), kg.float().transpose(-1, -2)).mul_(scale)
    if lengths is not None:
        s.masked_fill_(torch.arange(s.shape[-1], device=s.device).view(1, 1, 1, -1)
                       >= lengths.view(-1, 1, 1, 1), float("-inf"))
    return torch.logsumexp(s, -1).reshape(-1)


def _full_rows(q, k, v, qr, qtok, out, rows_cpu, n_qblk, scale, scratch, lse=None):
    """Query blocks that list every KV block attend k/v of their head as they are (no gather): one SDPA
    per head holding such rows (capped by ``CHUNK_ELEMS`` scores on unfused devices).

    qr: (B*H*Nq, D) query rows; qtok: int64 (B*H*n_qblk, block_q) their ids per query block; out:
    (B*H*Nq, D), written for the query blocks ``rows_cpu`` (int64, CPU); lse: fp32 (B*H*Nq,) row LSE written
    for them too, or None.
    """
    h, nk, d = q.shape[1], k.shape[2], q.shape[3]
    block_q = qtok.shape[1]
    rows_cpu = rows_cpu[torch.argsort(rows_cpu // n_qblk, stable=True)]
    heads, per_head = torch.unique_consecutive(rows_cpu // n_qblk, return_counts=True)
    cap = n_qblk if fused_sdpa(q.device) else max(1, _torch_softmax.CHUNK_ELEMS // (block_q * nk))
    rows_dev = rows_cpu.to(q.device)
    start = 0
    for bh, count in zip(heads.tolist(), per_head.tolist()):
        bi, hi = divmod(bh, h)
        for s0 in range(start, start + count, cap):
            tok = qtok.index_select(0, rows_dev[s0:min(start + count, s0 + cap)]).view(-1)
            qg = scratch.take("q", qr, tok).view(1, 1, -1, d)
            o = sdpa(qg, k[bi:bi + 1, hi:hi + 1], v[bi:bi + 1, hi:hi + 1], None, scale)
            out.index_put_((tok,), o.reshape(-1, d))
            if lse is not None:
                lse.index_put_((tok,), _torch_softmax.dense_lse_fallback(qg, k[bi:bi + 1, hi:hi + 1],
                                                                          scale).reshape(-1))
        start += count
