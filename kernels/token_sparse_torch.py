"""Token-sparse (gathered-KV) attention for groups of queries, PyTorch twin of the Triton kernel."""

from __future__ import annotations

import torch

from ._checks import check_counts, check_index, check_qkv, check_scale, check_sorted_unique_in_range
from .compact_torch import SEGMENT, decode_lists
from ._gather import Scratch, flat_rows, head_offsets
from ._residual import add_residual_, check_residual, refuse_mass
from ._torch_softmax import attend, chunk_rows, plan_chunks


def check_query_groups(q_groups: torch.Tensor, b: int, h: int, nq: int, device: torch.device,
                       validate: bool = True) -> tuple[int, int]:
    """q_groups: int (B, H, G, C), entries in [-1, Nq), each query at most once per head. Returns (G, C).

    ``validate=False`` checks only shape/dtype/device (no read-back of values).
    """
    if not isinstance(q_groups, torch.Tensor) or q_groups.dim() != 4:
        raise ValueError("q_groups must be an int32 tensor of shape (B, H, G, C)")
    g, c = q_groups.shape[2], q_groups.shape[3]
    check_index("q_groups", q_groups, (b, h, g, c), device)
    if q_groups.numel() == 0 or not validate:
        return g, c
    if int(q_groups.min()) < -1 or int(q_groups.max()) >= nq:
        raise ValueError(f"q_groups entries must lie in [-1, {nq}) (-1 pads a group)")
    flat = q_groups.reshape(b * h, g * c).long()
    seen = torch.zeros((b * h, nq + 1), dtype=torch.int32, device=device)
    seen.scatter_add_(1, torch.where(flat < 0, nq, flat), torch.ones_like(flat, dtype=torch.int32))
    if bool((seen[:, :nq] > 1).any()):
        raise ValueError("q_groups lists a query more than once in the same head")
    return g, c


def check_token_lists(q, k, q_groups, kv_tokens, kv_counts, validate=True) -> tuple[int, int, int]:
    """Validate groups and their KV token lists; returns (G, C, max_k)."""
    b, h, nq, _ = q.shape
    nk = k.shape[2]
    g, c = check_query_groups(q_groups, b, h, nq, q.device, validate)
    if not isinstance(kv_tokens, torch.Tensor) or kv_tokens.dim() != 4:
        raise ValueError("kv_tokens must be an int32 tensor of shape (B, H, G, max_k)")
    max_k = kv_tokens.shape[3]
    check_index("kv_tokens", kv_tokens, (b, h, g, max_k), q.device)
    check_index("kv_counts", kv_counts, (b, h, g), q.device)
    if validate:
        check_counts("kv_counts", kv_counts, max_k)
        check_sorted_unique_in_range("kv_tokens", kv_tokens, kv_counts, nk)
    return g, c, max_k


def token_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_groups: torch.Tensor,
                           kv_tokens: torch.Tensor, kv_counts: torch.Tensor, *, scale: float | None = None,
                           validate: bool = True, residual=None):
    """Each group of C queries attends its own sorted list of KV tokens; the rest count as -inf.

    q: (B, H, Nq, D); k, v: (B, H, Nk, D); fp16/bf16/fp32 (SDPA runs in that dtype, softmax in fp32).
    q_groups: int32 (B, H, G, C) query indices per group (-1 pads); kv_tokens: int32 (B, H, G, max_k)
    strictly increasing KV token ids within the first ``kv_counts`` entries; kv_counts: int32 (B, H, G).
    Output is written at each query's own position: out (B, H, Nq, D) in q's dtype. Queries in no group,
    or with nothing to attend, get out 0. ``validate=False`` skips the value checks (engine-built lists).
    residual: None or a (data, scale) pair (kernels/_residual.py): out = attention + data * scale in fp32,
    cast once; queries in no group, or with nothing to attend, get exactly the residual.

    How: groups are sorted by list length; each chunk of equal-length groups gathers its C query rows and
    its K/V tokens (index_select into reused buffers) and runs one batched SDPA, unmasked; merged short
    runs of different lengths carry a key-padding mask. fp32 on CPU runs the rows as batched matmuls
    instead (``_torch_softmax.attend``). Empty groups are skipped (zeros, never NaN). Extra memory: one
    chunk of gathered K/V (``_torch_softmax.gather_budget``). Ops: index_select, argsort (on the CPU copy
    of the counts), scaled_dot_product_attention (or baddbmm, softmax, bmm), index_put_ —
    all on CPU, CUDA and Apple MPS.
    """
    b, h, nq, nk, d = check_qkv(q, k, v)
    scale = check_scale(scale, d)
    g, c, max_k = check_token_lists(q, k, q_groups, kv_tokens, kv_counts, validate)
    refuse_mass(residual, q)
    res = check_residual(residual, q)
    dev = q.device
    out = torch.zeros((b * h * nq + 1, d), dtype=q.dtype, device=dev)  # last row: sink for pads
    if max_k > 0 and g > 0 and c > 0:
        cnt = kv_counts.reshape(-1).long()
        cnt_cpu = cnt.cpu()
        order = torch.argsort(cnt_cpu, descending=True, stable=True)
        n_rows = int((cnt_cpu > 0).sum())
        sorted_lens = cnt_cpu[order[:n_rows]].tolist()
        order = order[:n_rows].to(dev)
        qoff = head_offsets(b, h, nq, dev)
        koff = head_offsets(b, h, nk, dev).repeat_interleave(g, dim=0)  # (B*H*G, 1)
        qidx = q_groups.reshape(b * h, g * c).long()
        qdst = torch.where(qidx < 0, b * h * nq, qidx + qoff).view(b * h * g, c)
        qsrc = (qidx.clamp(min=0) + qoff).view(b * h * g, c)
        tok = kv_tokens.reshape(b * h * g, max_k)
        qr, kr, vr = flat_rows(q), flat_rows(k), flat_rows(v)
        scratch = Scratch.get(q.dtype, dev)
        for s0, s1, longest, mixed in plan_chunks(sorted_lens, lambda length: chunk_rows(dev, c, length, d)):
            rows = order[s0:s1]
            r = rows.numel()
            t = (tok.index_select(0, rows)[:, :longest].long().clamp(0, nk - 1) + koff.index_select(0, rows)).view(-1)
            qg = scratch.take("q", qr, qsrc.index_select(0, rows).view(-1)).view(r, 1, c, d)
            kg = scratch.take("k", kr, t).view(r, 1, longest, d)
            vg = scratch.take("v", vr, t).view(r, 1, longest, d)
            o = attend(qg, kg, vg, cnt.index_select(0, rows) if mixed else None, scale, scratch)
            out.index_put_((qdst.index_select(0, rows).view(-1),), o.reshape(r * c, d))
    out = out[:-1].view(b, h, nq, d)
    return out if res is None else add_residual_(out.float(), res).to(q.dtype)


def check_compact_lists(q, k, q_groups, kv_low, seg_ends, kv_counts, validate=True) -> tuple[int, int, int, int]:
    """Validate groups and their compact KV lists (kernels/compact_torch.py's format); returns (G, C, W, S).
    ``validate=True`` also decodes the lists and checks them as ``check_token_lists`` does."""
    b, h, nq, _ = q.shape
    nk = k.shape[2]
    g, c = check_query_groups(q_groups, b, h, nq, q.device, validate)
    if not isinstance(kv_low, torch.Tensor) or kv_low.dim() != 4 or kv_low.dtype != torch.int16:
        raise ValueError("kv_low must be an int16 tensor of shape (B, H, G, W) (kernels.compact_keep's lists)")
    if tuple(kv_low.shape[:3]) != (b, h, g) or kv_low.device != q.device:
        raise ValueError(f"kv_low must have shape ({b}, {h}, {g}, W) on {q.device}, got {tuple(kv_low.shape)} on "
                         f"{kv_low.device}")
    if not isinstance(seg_ends, torch.Tensor) or seg_ends.dim() != 4 or seg_ends.dtype != torch.int32 \
            or tuple(seg_ends.shape[:3]) != (b, h, g) or seg_ends.device != q.device:
        raise ValueError(f"seg_ends must be an int32 tensor of shape ({b}, {h}, {g}, S) on {q.device}")
    n_seg = seg_ends.shape[3]
    if g and kv_low.shape[3] and n_seg < -(-nk // SEGMENT):  # empty lists read no segment
        raise ValueError(f"seg_ends holds {n_seg} segment(s); {nk} keys need {-(-nk // SEGMENT)} of {SEGMENT}")
    check_index("kv_counts", kv_counts, (b, h, g), q.device)
    if validate:
        try:
            check_counts("kv_counts", kv_counts, kv_low.shape[3])
            check_sorted_unique_in_range("kv_tokens", decode_lists(kv_low, seg_ends, SEGMENT)[..., :kv_low.shape[3]],
                                         kv_counts, nk)
        except ValueError as exc:
            raise ValueError(f"kv_low / seg_ends (decoded): {exc}") from None
    return g, c, kv_low.shape[3], n_seg


def token_sparse_attention_compact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_groups: torch.Tensor,
                                   kv_low: torch.Tensor, seg_ends: torch.Tensor, kv_counts: torch.Tensor, *,
                                   scale: float | None = None, validate: bool = True, residual=None,
                                   fill_ungrouped: bool = True):
    """``token_sparse_attention`` over compact lists, the format the engine caches (kernels.compact_keep with its
    default 65 536-token segments; lists of other segment sizes decode wrongly here): kv_low int16 (B, H, G, W) and
    seg_ends int32 (B, H, G, S) decode to each group's sorted KV tokens (column = low + 32768 + 65536 × the number of
    seg_ends at or below the slot); kv_counts int32 (B, H, G). Other arguments and the output as in
    ``token_sparse_attention``. This twin decodes the lists, then runs it; the Triton kernel decodes in registers.
    fill_ungrouped=False allows rows in no group to be left undefined; this twin fills them anyway (what it costs
    here is the gathers, not the fill)."""
    check_compact_lists(q, k, q_groups, kv_low, seg_ends, kv_counts, validate)
    return token_sparse_attention(q, k, v, q_groups, decode_lists(kv_low, seg_ends, SEGMENT), kv_counts, scale=scale,
                                  validate=False, residual=residual)
