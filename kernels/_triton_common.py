"""Triton building blocks shared by the attention kernels: one online-softmax step and the epilogue.

Imported only when a Triton kernel is about to run (never at package import). Scores are kept in
base-2 units: ``s2 = (q . k) * scale * log2(e)``; LSE is returned in natural log.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import interpreting

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def online_softmax_step(acc, m_i, l_i, qk, qk_scale, v):
    """Fold one tile of raw scores ``qk`` [M, N] (-inf = skipped) and values ``v`` [N, D] into the state.

    Scores become base-2 logits ``qk * qk_scale`` (qk_scale = scale * log2 e > 0) inside one FMA with the
    max subtraction. acc: [M, D] fp32; m_i, l_i: [M] fp32 running max (base 2) and sum. Rows whose
    scores are all -inf so far keep m = -inf and l = 0 (no NaN: the max used for exp2 is guarded).
    """
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(qk * qk_scale - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i


@triton.jit
def finish(acc, m_i, l_i):
    """Epilogue: (out [M, D] fp32, lse [M] natural log). Empty rows give out 0 and lse -inf."""
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    return out, lse


def head_dim_pad(d: int) -> int:
    """Head dims are padded inside the kernel (not in memory) to the next power of two (80, 96 -> 128)."""
    return max(16, triton.next_power_of_2(d))


def seq_bucket(n: int) -> int:
    """Autotune key bucket for a sequence length: next power of two (never one compile per length)."""
    return triton.next_power_of_2(max(1, n))


def configs(options: list[dict], interpret_pick: dict) -> list[triton.Config]:
    """Autotune configs; under the CPU interpreter a single one (it would run every config serially)."""
    if interpreting():
        options = [interpret_pick]
    return [triton.Config({k: v for k, v in o.items() if k not in ("num_warps", "num_stages")},
                          num_warps=o.get("num_warps", 4), num_stages=o.get("num_stages", 2)) for o in options]


@triton.jit
def load_rows(base, rows, stride, valid, d, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
              CHECK_ROWS: tl.constexpr):
    """Load a [R, D_PAD] tile of rows ``rows`` (int32, within one head) from ``base``.

    Rows outside ``valid`` (when CHECK_ROWS) and head-dim lanes >= HEAD_DIM read as 0.
    """
    ptrs = base + rows[:, None] * stride + d[None, :]
    if CHECK_ROWS:
        if HEAD_DIM == D_PAD:
            x = tl.load(ptrs, mask=valid[:, None], other=0.0)
        else:
            x = tl.load(ptrs, mask=valid[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    else:
        if HEAD_DIM == D_PAD:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=d[None, :] < HEAD_DIM, other=0.0)
    return x


@triton.jit
def store_rows(base, rows, stride, valid, d, x, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    """Store a [R, D_PAD] tile to rows ``rows`` where ``valid``, head-dim lanes < HEAD_DIM only."""
    ptrs = base + rows[:, None] * stride + d[None, :]
    if HEAD_DIM == D_PAD:
        tl.store(ptrs, x, mask=valid[:, None])
    else:
        tl.store(ptrs, x, mask=valid[:, None] & (d[None, :] < HEAD_DIM))


def last_dim_contiguous(*ts: torch.Tensor) -> list[torch.Tensor]:
    """Kernels address rows by stride and assume unit stride along the head dim."""
    return [t if t.stride(-1) == 1 else t.contiguous() for t in ts]


@triton.jit
def kv_tile(acc, m_i, l_i, q, k_base, v_base, rows, rows_ok, skn, svn, qk_scale, d,
            HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, MASKED: tl.constexpr):
    """Attend one tile of KV rows ``rows`` [N] (contiguous or gathered). With MASKED, rows outside
    ``rows_ok`` are skipped (-inf); without it every row is valid and loads carry no row mask."""
    k = load_rows(k_base, rows, skn, rows_ok, d, HEAD_DIM, D_PAD, MASKED)
    qk = tl.dot(q, tl.trans(k))
    if MASKED:
        qk = tl.where(rows_ok[None, :], qk, float("-inf"))
    v = load_rows(v_base, rows, svn, rows_ok, d, HEAD_DIM, D_PAD, MASKED)
    return online_softmax_step(acc, m_i, l_i, qk, qk_scale, v)


@triton.jit
def load_group(QG, Q, G, H, sqb, sqh, sqn, d, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr):
    """Program (group, head): gather the group's query rows. Returns (q [GROUP, D_PAD], qi, q_ok, row,
    b, h, pid_bh): row indexes the (B*H*G) group lists; padded slots (-1) read zeros, q_ok False."""
    gid = tl.program_id(0)
    pid_bh = tl.program_id(1)
    row = pid_bh.to(tl.int64) * G + gid
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    qi = tl.load(QG + row * GROUP + tl.arange(0, GROUP))
    q_ok = qi >= 0
    qi = tl.where(q_ok, qi, 0)
    q = load_rows(Q + b * sqb + h * sqh, qi, sqn, q_ok, d, HEAD_DIM, D_PAD, True)
    return q, qi, q_ok, row, b, h, pid_bh
