"""Token-sparse (gathered-KV) attention forward in Triton.

One program holds a tile of C grouped queries (gathered by index) and walks its own sorted KV token
list in chunks of BLOCK_N, gathering K/V rows by index inside the loop: gathered K/V never exist in
memory. Outputs are written back at the queries' original positions. Twin of
``token_sparse_torch.token_sparse_attention``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_qkv, check_scale, triton_group_problem
from ._triton_common import (LOG2E, configs, finish, head_dim_pad, kv_tile, last_dim_contiguous, load_group,
                             seq_bucket, store_rows)
from .token_sparse_torch import check_token_lists

_CONFIGS = configs(
    [dict(BLOCK_N=64, num_warps=4, num_stages=3),
     dict(BLOCK_N=64, num_warps=4, num_stages=2),
     dict(BLOCK_N=128, num_warps=4, num_stages=3)],
    interpret_pick=dict(BLOCK_N=32))


@triton.autotune(configs=_CONFIGS, key=["K_BUCKET", "HEAD_DIM", "GROUP"])
@triton.jit
def _token_fwd(Q, K, V, Out, QG, TOK, CNT,
               sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,
               H, N_Q, N_KV, G, MAX_K, qk_scale, K_BUCKET,
               HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
               GROUP: tl.constexpr, BLOCK_N: tl.constexpr):
    d = tl.arange(0, D_PAD)
    q, qi, q_ok, row, b, h, pid_bh = load_group(QG, Q, G, H, sqb, sqh, sqn, d, HEAD_DIM, D_PAD, GROUP)
    k_base = K + b * skb + h * skh
    v_base = V + b * svb + h * svh
    tok_base = TOK + row * MAX_K
    count = tl.load(CNT + row)
    m_i = tl.full([GROUP], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP], tl.float32)
    acc = tl.zeros([GROUP, D_PAD], tl.float32)
    n_full = (count // BLOCK_N) * BLOCK_N
    for start in range(0, n_full, BLOCK_N):  # full chunks of the list: no masks
        slot = start + tl.arange(0, BLOCK_N)
        tok = tl.load(tok_base + slot)
        acc, m_i, l_i = kv_tile(acc, m_i, l_i, q, k_base, v_base, tok, slot < count, skn, svn,
                                qk_scale, d, HEAD_DIM, D_PAD, False)
    if n_full < count:  # the list's tail
        slot = n_full + tl.arange(0, BLOCK_N)
        t_ok = slot < count
        tok = tl.load(tok_base + slot, mask=t_ok, other=0)
        acc, m_i, l_i = kv_tile(acc, m_i, l_i, q, k_base, v_base, tok, t_ok, skn, svn,
                                qk_scale, d, HEAD_DIM, D_PAD, True)
    out, _ = finish(acc, m_i, l_i)
    store_rows(Out + b * sob + h * soh, qi, son, q_ok, d, out.to(Out.dtype.element_ty), HEAD_DIM, D_PAD)


def token_sparse_attention(q, k, v, q_groups, kv_tokens, kv_counts, *, scale=None, validate=True):
    """Token-sparse attention on the Triton kernel; arguments as in the PyTorch twin.

    q: (B,H,Nq,D); k, v: (B,H,Nk,D); q_groups int32 (B,H,G,C) (-1 pads); kv_tokens int32
    (B,H,G,max_k) sorted; kv_counts int32 (B,H,G). Returns out (B,H,Nq,D); queries in no group get 0.
    ``validate=False`` skips the index checks for trusted lists.
    """
    b, h, nq, nk, d = check_qkv(q, k, v)
    scale = check_scale(scale, d)
    g, c, max_k = check_token_lists(q, k, q_groups, kv_tokens, kv_counts, validate)
    why = triton_group_problem(c)
    if why:
        raise ValueError(f"q_groups: {why}")
    q, k, v = last_dim_contiguous(q, k, v)
    qg = q_groups.to(torch.int32).contiguous()
    tok = kv_tokens.to(torch.int32).contiguous()
    cnt = kv_counts.to(torch.int32).contiguous()
    out = torch.zeros((b, h, nq, d), dtype=q.dtype, device=q.device)  # queries in no group stay 0
    if g > 0:
        _token_fwd[(g, b * h)](
            q, k, v, out, qg, tok, cnt, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
            *out.stride()[:3], h, nq, nk, g, max(1, max_k), scale * LOG2E, seq_bucket(max(1, max_k)),
            HEAD_DIM=d, D_PAD=head_dim_pad(d), GROUP=c)
    return out
