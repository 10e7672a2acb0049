"""Dense flash-attention forward in Triton, optionally returning the row LSE (pass 1 of exact selection).

Twin of ``dense_torch.attention_dense`` (same signature and semantics). On Hopper the TMA kernel of
``attention_hopper`` runs instead (kernels/_hopper.py says when).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _hopper
from ._checks import check_qkv, check_scale
from ._triton_common import (LOG2E, configs, finish, head_dim_pad, kv_tile, last_dim_contiguous, lazy_rescale,
                             load_rows, seq_bucket, store_rows, tune_options)

_CONFIGS = configs(
    # docs/kernel_notes.md: hd128 BM128/BN64/w4/s2-3, hd64 BM128/BN128/w4/s3; at 8 warps hd128 stops spilling on
    # GPUs without TMA, where this kernel runs ("v14")
    [dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3),
     dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=2),
     dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=3),
     dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
     dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2)],
    interpret_pick=dict(BLOCK_M=64, BLOCK_N=64))


@triton.autotune(configs=_CONFIGS, key=["N_BUCKET", "HEAD_DIM", "LAZY"], **tune_options())
@triton.heuristics({"EVEN_N": lambda a: a["N_KV"] % a["BLOCK_N"] == 0})
@triton.jit
def _dense_fwd(Q, K, V, Out, LSE,
               sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,
               H, N_Q, N_KV, qk_scale, N_BUCKET,
               HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, WRITE_LSE: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr, LAZY: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    d = tl.arange(0, D_PAD)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q_ok = offs_m < N_Q
    q = load_rows(Q + b * sqb + h * sqh, offs_m, sqn, q_ok, d, HEAD_DIM, D_PAD, True)
    k_base = K + b * skb + h * skh
    v_base = V + b * svb + h * svh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    n_full = (N_KV // BLOCK_N) * BLOCK_N
    for start_n in range(0, n_full, BLOCK_N):  # full tiles: no masks
        offs_n = start_n + tl.arange(0, BLOCK_N)
        acc, m_i, l_i = kv_tile(acc, m_i, l_i, q, k_base, v_base, offs_n, offs_n < N_KV, skn, svn,
                                qk_scale, d, HEAD_DIM, D_PAD, False, LAZY)
    if not EVEN_N:  # the ragged last tile
        offs_n = n_full + tl.arange(0, BLOCK_N)
        acc, m_i, l_i = kv_tile(acc, m_i, l_i, q, k_base, v_base, offs_n, offs_n < N_KV, skn, svn,
                                qk_scale, d, HEAD_DIM, D_PAD, True, LAZY)
    out, lse = finish(acc, m_i, l_i)
    store_rows(Out + b * sob + h * soh, offs_m, son, q_ok, d, out.to(Out.dtype.element_ty), HEAD_DIM, D_PAD)
    if WRITE_LSE:
        tl.store(LSE + pid_bh.to(tl.int64) * N_Q + offs_m, lse, mask=q_ok)


PATHS = ("auto", "pointer", "tma", "persistent", "warp_spec", "gluon")


def _prepare(q, k, v, scale, return_lse):
    """Checked inputs (the last dim contiguous), the scale, and fresh out (B,H,Nq,D) and lse (B,H,Nq) fp32 (out itself
    when no LSE is asked for, so the kernels always have a pointer)."""
    b, h, nq, nk, d = check_qkv(q, k, v)
    scale = check_scale(scale, d)
    q, k, v = last_dim_contiguous(q, k, v)
    out = torch.empty((b, h, nq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, nq), dtype=torch.float32, device=q.device) if return_lse else out
    return q, k, v, out, lse, scale


def _gluon(q, k, v, out, lse, scale, return_lse, auto):
    """kernels/attention_gluon.py's dense call into out (and lse): its result, or None after a failure the automatic
    choice survives (logged once, the kind then left alone: kernels/_hopper.py, ``attempt``)."""
    from . import attention_gluon
    done = _hopper.attempt("gluon_dense", auto, lambda: attention_gluon.attention(
        q, k, v, out, scale=scale, lse=lse if return_lse else None))
    return None if done is None else ((out, lse) if return_lse else out)


def gluon_attention_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                          return_lse: bool = False):
    """The Gluon kernel's dense call for a caller that asked ``_hopper.use_gluon("gluon_dense", ...)`` already
    (kernels/api.py, which then tries cuDNN when this fails): arguments and result as in ``attention_dense``, or None
    when the kernel failed to compile or launch."""
    return _gluon(*_prepare(q, k, v, scale, return_lse), return_lse, True)


def attention_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                    return_lse: bool = False, path: str = "auto"):
    """Dense attention on the Triton kernels. q: (B,H,Nq,D); k, v: (B,H,Nk,D); fp16/bf16/fp32.

    Returns out (B,H,Nq,D) in q's dtype [+ lse (B,H,Nq) fp32, natural log, -inf for empty rows].
    path: "auto" (on Hopper the Gluon kernel, then the TMA kernel, as kernels/_hopper.py allows; else pointer
    loads) or one variant ("pointer", "tma", "persistent", "warp_spec", "gluon"); an explicit variant that fails
    raises.
    """
    q, k, v, out, lse, scale = _prepare(q, k, v, scale, return_lse)
    b, h, nq, d = q.shape
    nk = k.shape[2]
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    auto = path == "auto"
    if _hopper.use_gluon("gluon_dense", q, k, v, path=path):
        done = _gluon(q, k, v, out, lse, scale, return_lse, auto)
        if done is not None:
            return done
    if auto:
        path = "tma" if _hopper.use_tma("dense", k, v) else "pointer"
    if path != "pointer":
        from . import attention_hopper
        kind = "dense" if path == "tma" else path
        done = _hopper.attempt(kind, auto, lambda: attention_hopper.launch(
            kind, q, k, v, out, scale=scale, block_q=128, block_k=128, mode=attention_hopper.MODE_DENSE,
            lse=lse if return_lse else None))
        if done is not None:
            return (out, lse) if return_lse else out

    def grid(meta):
        return (triton.cdiv(nq, meta["BLOCK_M"]), b * h)

    _dense_fwd[grid](q, k, v, out, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
                     *out.stride()[:3], h, nq, nk, scale * LOG2E, seq_bucket(nk),
                     HEAD_DIM=d, D_PAD=head_dim_pad(d), WRITE_LSE=return_lse, LAZY=lazy_rescale())
    return (out, lse) if return_lse else out
