"""Pass 2 of exact selection in Triton: per query group, the attention mass of every KV token.

mass[b,h,g,j] = sum_{i in group g} exp(scale * q_i . k_j - lse_i), with the row LSE from pass 1. One
program per (group, head) streams all KV tiles; scores never reach memory, only the (G, N) fp32 result.
Twin of ``selection_torch.group_kv_mass``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import triton_group_problem
from ._triton_common import LOG2E, configs, head_dim_pad, last_dim_contiguous, load_group, load_rows, seq_bucket
from .selection_torch import check_mass_args

_CONFIGS = configs(
    [dict(BLOCK_N=64, num_warps=4, num_stages=3),
     dict(BLOCK_N=128, num_warps=8, num_stages=3),
     dict(BLOCK_N=128, num_warps=4, num_stages=3)],
    interpret_pick=dict(BLOCK_N=64))


@triton.autotune(configs=_CONFIGS, key=["N_BUCKET", "HEAD_DIM", "GROUP"])
@triton.jit
def _mass_fwd(Q, K, LSE, QG, OUT,
              sqb, sqh, sqn, skb, skh, skn,
              H, N_Q, N_KV, G, qk_scale, N_BUCKET,
              HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr):
    d = tl.arange(0, D_PAD)
    q, qi, q_ok, row, b, h, pid_bh = load_group(QG, Q, G, H, sqb, sqh, sqn, d, HEAD_DIM, D_PAD, GROUP)
    lse2 = tl.load(LSE + pid_bh.to(tl.int64) * N_Q + qi, mask=q_ok, other=float("inf")) * 1.4426950408889634
    lse2 = tl.where(lse2 == float("-inf"), float("inf"), lse2)  # empty rows contribute nothing
    k_base = K + b * skb + h * skh
    out_base = OUT + row * N_KV
    n_full = (N_KV // BLOCK_N) * BLOCK_N
    for start_n in range(0, n_full, BLOCK_N):  # full tiles: no masks
        _mass_tile(q, lse2, k_base, out_base, start_n, N_KV, skn, qk_scale, d, HEAD_DIM, D_PAD, BLOCK_N, False)
    if n_full < N_KV:
        _mass_tile(q, lse2, k_base, out_base, n_full, N_KV, skn, qk_scale, d, HEAD_DIM, D_PAD, BLOCK_N, True)


@triton.jit
def _mass_tile(q, lse2, k_base, out_base, start_n, N_KV, skn, qk_scale, d,
               HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """Column sums of exp2(s2 - lse2) for one KV tile, stored per token."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N_KV
    k = load_rows(k_base, offs_n, skn, n_ok, d, HEAD_DIM, D_PAD, MASKED)
    s2 = tl.dot(q, tl.trans(k)) * qk_scale
    p = tl.exp2(s2 - lse2[:, None])
    if MASKED:
        p = tl.where(n_ok[None, :], p, 0.0)
        tl.store(out_base + offs_n, tl.sum(p, 0), mask=n_ok)
    else:
        tl.store(out_base + offs_n, tl.sum(p, 0))


def group_kv_mass(q, k, lse, q_groups, *, scale=None, validate=True):
    """Exact group KV mass on the Triton kernel; arguments as in the PyTorch twin.

    q: (B,H,Nq,D); k: (B,H,Nk,D); lse fp32 (B,H,Nq); q_groups int32 (B,H,G,C). Returns fp32 (B,H,G,Nk).
    """
    b, h, nq, nk, d, scale, g, c = check_mass_args(q, k, lse, q_groups, scale, validate)
    why = triton_group_problem(c)
    if why:
        raise ValueError(f"q_groups: {why}")
    q, k = last_dim_contiguous(q, k)
    out = torch.empty((b, h, g, nk), dtype=torch.float32, device=q.device)
    if g > 0:
        _mass_fwd[(g, b * h)](
            q, k, lse.float().contiguous(), q_groups.to(torch.int32).contiguous(), out,
            *q.stride()[:3], *k.stride()[:3], h, nq, nk, g, scale * LOG2E, seq_bucket(nk),
            HEAD_DIM=d, D_PAD=head_dim_pad(d), GROUP=c)
    return out
