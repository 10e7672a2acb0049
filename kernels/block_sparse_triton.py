"""Block-sparse flash-attention forward in Triton over CSR-like block lists.

The sparse index is laid over the flash tile loop (docs/method.md, "Block selection"): each program owns one query block
and walks only its active KV blocks, with an online softmax, so skipped blocks count as -inf. Programs
are issued heaviest row first (longest block list), so long dense rows (text, sinks) start early
instead of forming the grid's tail. A residual (kernels/_residual.py) is added in the epilogue. On Hopper
the TMA kernel of ``attention_hopper`` runs instead (kernels/_hopper.py says when). Twin of
``block_sparse_torch.block_sparse_attention``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _hopper, fast_launch
from ._checks import check_qkv, check_scale
from ._residual import check_residual, contiguous_residual, residual_mass
from ._triton_common import (LOG2E, add_residual, cdiv, configs, finish, head_dim_pad, kv_tile, last_dim_contiguous,
                             lazy_rescale, load_rows, mass_launch_args, mass_weight, residual_launch_args,
                             residual_mode, seq_bucket, store_rows, tune_options)
from .block_sparse_torch import check_block_lists

# The pointer kernel runs on GPUs without TMA (Ampere, Ada, Blackwell's RTX cards). With BLOCK_M 128 and D 128 every
# 4-warp candidate spills 0.8-4 KB a thread there (sm_80/86/89/120, Triton 3.6) while BLOCK_N 64 at 8 warps fits
# in 238-252 registers without spilling (docs/kernel_notes.md, "v14"); the autotuner times them all on the card.
_CONFIGS = configs(
    [dict(BLOCK_N=64, num_warps=4, num_stages=3),
     dict(BLOCK_N=64, num_warps=4, num_stages=2),
     dict(BLOCK_N=128, num_warps=4, num_stages=3),
     dict(BLOCK_N=64, num_warps=8, num_stages=3),
     dict(BLOCK_N=64, num_warps=8, num_stages=2)],
    interpret_pick=dict(BLOCK_N=64))


def _prune(configs_, named_args, **kwargs):
    bk = kwargs.get("BLOCK_K", named_args.get("BLOCK_K"))
    bm = kwargs.get("BLOCK_M", named_args.get("BLOCK_M"))
    kept = [c for c in configs_ if c.kwargs["BLOCK_N"] <= bk and not (bm == 64 and c.num_warps == 8)]
    return kept or [configs_[0]]


@triton.autotune(configs=_CONFIGS, key=["N_BUCKET", "HEAD_DIM", "BLOCK_M", "BLOCK_K", "LAZY"],
                 prune_configs_by={"early_config_prune": _prune}, **tune_options())
@triton.heuristics({"EVEN_K": lambda a: a["N_KV"] % a["BLOCK_K"] == 0})
@triton.jit
def _bsa_fwd(Q, K, V, Out, R, RS, MS, Lse, KV_IDX, KV_CNT, ORDER,
             sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, srb, srh, srn, ssb, ssh, ssn, msb, msh, msn,
             H, N_Q, N_KV, NQB, N_KBLK, MAX_K, qk_scale, N_BUCKET,
             HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, RESIDUAL: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr,
             LAZY: tl.constexpr, MASS: tl.constexpr, WRITE_LSE: tl.constexpr):
    row = tl.load(ORDER + tl.program_id(0))          # heaviest rows first
    pid_bh = row // NQB
    qb = row % NQB
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    d = tl.arange(0, D_PAD)
    offs_m = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    q_ok = offs_m < N_Q
    q = load_rows(Q + b * sqb + h * sqh, offs_m, sqn, q_ok, d, HEAD_DIM, D_PAD, True)
    k_base = K + b * skb + h * skh
    v_base = V + b * svb + h * svh
    idx_base = KV_IDX + row.to(tl.int64) * MAX_K
    count = tl.load(KV_CNT + row)
    MULT: tl.constexpr = BLOCK_K // BLOCK_N
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    # Lists are sorted, so only the last entry can be the ragged last KV block: its tiles are masked.
    n_iter = count * MULT
    n_full = n_iter
    if not EVEN_K:
        if count > 0:
            last = tl.load(idx_base + count - 1)
            if last == N_KBLK - 1:
                n_full = n_iter - MULT
    for it in range(0, n_full):
        blk = tl.load(idx_base + it // MULT)
        offs_n = blk * BLOCK_K + (it % MULT) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc, m_i, l_i = kv_tile(acc, m_i, l_i, q, k_base, v_base, offs_n, offs_n < N_KV, skn, svn,
                                qk_scale, d, HEAD_DIM, D_PAD, False, LAZY)
    for j in tl.static_range(MULT):  # the masked tail, unrolled: a loop here would get its own pipeline buffers
        if n_full + j < n_iter:
            blk = tl.load(idx_base + (n_full + j) // MULT)
            offs_n = blk * BLOCK_K + j * BLOCK_N + tl.arange(0, BLOCK_N)
            acc, m_i, l_i = kv_tile(acc, m_i, l_i, q, k_base, v_base, offs_n, offs_n < N_KV, skn, svn,
                                    qk_scale, d, HEAD_DIM, D_PAD, True, LAZY)
    out, lse = finish(acc, m_i, l_i)
    w = 1.0
    if MASS:
        w = mass_weight(lse, MS, b, h, offs_m, q_ok, msb, msh, msn)
    out = add_residual(out, R, RS, b, h, offs_m, q_ok, srb, srh, srn, ssb, ssh, ssn, d, HEAD_DIM, D_PAD, RESIDUAL,
                       w, MASS)
    store_rows(Out + b * sob + h * soh, offs_m, son, q_ok, d, out.to(Out.dtype.element_ty), HEAD_DIM, D_PAD)
    if WRITE_LSE:
        tl.store(Lse + pid_bh.to(tl.int64) * N_Q + offs_m, lse, mask=q_ok)


_ORDER_ATTR = "_sparse_attn_heavy_first"


def heavy_first_order(kv_counts: torch.Tensor) -> torch.Tensor:
    """int32 (B*H*nqb,) row order, longest block list first (stable, so equal rows keep head locality).

    Remembered on the counts tensor itself: a cached selection is launched on every reuse step, and the sort is
    several kernel launches of host time each call (docs/benchmarks.md, "Host overhead at 4 608 tokens"). An
    in-place change of the counts bumps the tensor's version counter and sorts again. Inference tensors (ComfyUI
    samples under torch.inference_mode) have no version counter: their order is kept as long as the element count
    holds. The kernels take any permutation of the rows (the order only schedules them, heaviest first), so a
    stale order costs balance, never correctness."""
    version = None if kv_counts.is_inference() else kv_counts._version
    memo = getattr(kv_counts, _ORDER_ATTR, None)
    if memo is not None and memo[0] == version and memo[1].numel() == kv_counts.numel():
        return memo[1]
    order = torch.argsort(kv_counts.reshape(-1), descending=True, stable=True).to(torch.int32)
    setattr(kv_counts, _ORDER_ATTR, (version, order))
    return order


PATHS = ("auto", "pointer", "tma", "persistent", "warp_spec", "gluon", "gluon_persistent")


def block_sparse_attention(q, k, v, kv_indices, kv_counts, *, block_q, block_k, scale=None, validate=True,
                           residual=None, path="auto", return_lse=False):
    """Block-sparse attention on the Triton kernels; arguments as in the PyTorch twin.

    q: (B,H,Nq,D); k, v: (B,H,Nk,D); kv_indices int32 (B,H,ceil(Nq/block_q),max_k) sorted per row;
    kv_counts int32 (B,H,ceil(Nq/block_q)); residual: None, (data, scale) added in the epilogue, or (data, scale,
    mass) weighted by the mass there (kernels/_residual.py). Returns out (B,H,Nq,D), with ``return_lse`` (out, lse
    fp32 (B,H,Nq)).
    ``validate=False`` skips the index checks (which synchronise with the GPU) for trusted lists.
    path: "auto" (on Hopper the Gluon kernel, then the TMA kernel, as kernels/_hopper.py allows; else pointer
    loads), or one variant: "pointer", "tma", "persistent" (TMA, persistent grid), "warp_spec" (TMA,
    warp-specialised), "gluon" (kernels/attention_gluon.py; block_q 128, block_k 64 or 128, D 64 or 128),
    "gluon_persistent" (its persistent grid: one program per SM over the rows heaviest first; explicit only until timed,
    docs/kernel_notes.md "v19").
    """
    b, h, nq, nk, d = check_qkv(q, k, v)
    scale = check_scale(scale, d)
    n_qblk, _, max_k = check_block_lists(q, k, kv_indices, kv_counts, block_q, block_k, validate)
    res = contiguous_residual(check_residual(residual, q))
    mass = residual_mass(residual, q) if res is not None else None
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    q, k, v = last_dim_contiguous(q, k, v)
    idx = kv_indices.to(torch.int32).contiguous()
    cnt = kv_counts.to(torch.int32).contiguous()
    out = torch.empty((b, h, nq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, nq), dtype=torch.float32, device=q.device) if return_lse else None
    order = heavy_first_order(cnt)
    auto = path == "auto"
    persistent = path == "gluon_persistent"
    if _hopper.use_gluon("gluon_sparse", q, k, v, block_q, block_k, "gluon" if persistent else path):
        from . import attention_gluon
        done = _hopper.attempt("gluon_sparse", auto, lambda: attention_gluon.attention(
            q, k, v, out, scale=scale, block_k=block_k, idx=idx, cnt=cnt, order=order, lse=lse, res=res,
            mass=mass, persistent=persistent))
        if done is not None:
            return (done, lse) if return_lse else done
    if auto:
        path = "tma" if _hopper.use_tma("sparse", k, v) else "pointer"
    if path != "pointer":
        from . import attention_hopper
        kind = "sparse" if path == "tma" else path
        done = _hopper.attempt(kind, auto, lambda: attention_hopper.launch(
            kind, q, k, v, out, scale=scale, block_q=block_q, block_k=block_k, mode=attention_hopper.MODE_BLOCKS,
            res=res, idx=idx, cnt=cnt, order=order, lse=lse, mass=mass))
        if done is not None:
            return (done, lse) if return_lse else done
    res_args, mass_args = residual_launch_args(res, out), mass_launch_args(mass, out)
    fast_launch.launch(_bsa_fwd, (b * h * n_qblk,), (
        q, k, v, out, *res_args[:2], mass_args[0],
        lse if lse is not None else out, idx, cnt, order, *q.stride()[:3], *k.stride()[:3],
        *v.stride()[:3], *out.stride()[:3], *res_args[2:], *mass_args[1:],
        h, nq, nk, n_qblk, cdiv(nk, block_k), max_k, scale * LOG2E, seq_bucket(nk)), dict(
        HEAD_DIM=d, D_PAD=head_dim_pad(d), RESIDUAL=residual_mode(res), BLOCK_M=block_q, BLOCK_K=block_k,
        LAZY=lazy_rescale(), MASS=mass is not None, WRITE_LSE=return_lse))
    return (out, lse) if return_lse else out
