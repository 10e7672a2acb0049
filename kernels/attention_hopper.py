"""Flash-attention forward for Hopper (sm_90): K/V tiles loaded through TMA tensor descriptors.

One kernel body, four modes (constexpr MODE):

- ``MODE_BLOCKS``: block-sparse over CSR block lists (twin ``block_sparse_torch``), with the fused
  residual epilogue; rows are issued heaviest first.
- ``MODE_DENSE``: dense attention with optional row LSE (twin ``dense_torch``).
- ``MODE_ANCHOR``: one pass over every KV block of a query block, selected blocks first: the online
  softmax state after the selected blocks is the sparse output (exact), the same state continued over the
  complement blocks is the dense output. Writes out_dense, optional LSE, and the residual
  R = out_dense - out_sparse in the model's dtype or as fp8 with a per-row scale (twin ``anchor_torch``); the
  sparse output waits in Out's rows, in Out's dtype, during the second walk.
- ``MODE_RESIDUAL``: block-sparse over the lists, whose epilogue reads a dense output computed before (cuDNN's)
  and writes only R = dense - sparse (and the mass from the given dense LSE): the anchor of a low density costs
  one dense call plus one sparse call (twin ``anchor_torch.block_residual``; docs/kernel_notes.md, "Anchor:
  fused pass or dense call plus residual epilogue").

Descriptors are made in-kernel per (batch, head) with the head's true shape (N, D): the hardware
zero-fills the ragged last tile and padded head-dim lanes, so only the scores of the last KV tile are
masked. ``PERSISTENT`` runs a grid of a few programs per SM that take rows from an atomic counter in
heavy-first order; ``WARP_SPEC`` asks Triton for warp specialisation of the KV loop. kernels/_hopper.py
decides when these kernels run; docs/kernel_notes.md has the measurements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _hopper, fast_launch
from ._triton_common import (LOG2E, add_residual, cdiv, finish, head_dim_pad, lazy_rescale, load_rows, loop_ahead,
                             mass_launch_args, mass_weight, online_softmax_step, pick, residual_launch_args,
                             residual_mode, seq_bucket, store_mass, store_residual_out, store_rows, tune_options)

MODE_BLOCKS, MODE_DENSE, MODE_ANCHOR, MODE_RESIDUAL = 0, 1, 2, 3


@triton.jit
def _scores(q, k_desc, start, N_KV, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """Raw scores q·kᵀ of KV rows [start, start + BLOCK_N); with MASKED, rows >= N_KV (zero-filled) score -inf."""
    k = k_desc.load([start, 0])
    qk = tl.dot(q, k.T)
    if MASKED:
        qk = tl.where((start + tl.arange(0, BLOCK_N))[None, :] < N_KV, qk, float("-inf"))
    return qk


@triton.jit
def _fold(acc, m_i, l_i, qk, v_desc, start, qk_scale, LAZY: tl.constexpr):
    """Fold the scores ``qk`` of KV rows [start, start + BLOCK_N) into the softmax state, loading their values."""
    v = v_desc.load([start, 0])
    return online_softmax_step(acc, m_i, l_i, qk, qk_scale, v, LAZY)


@triton.jit
def _kv_tile(acc, m_i, l_i, q, k_desc, v_desc, start, N_KV, qk_scale,
             BLOCK_N: tl.constexpr, MASKED: tl.constexpr, LAZY: tl.constexpr):
    """Attend KV rows [start, start + BLOCK_N); with MASKED, rows >= N_KV (zero-filled) score -inf."""
    qk = _scores(q, k_desc, start, N_KV, BLOCK_N, MASKED)
    return _fold(acc, m_i, l_i, qk, v_desc, start, qk_scale, LAZY)


@triton.jit
def _tile_start(idx_base, it, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """First KV row of tile ``it`` of a block list: BLOCK_K // BLOCK_N tiles per listed block."""
    MULT: tl.constexpr = BLOCK_K // BLOCK_N
    return tl.load(idx_base + it // MULT) * BLOCK_K + (it % MULT) * BLOCK_N


@triton.jit
def _walk_blocks(acc, m_i, l_i, q, k_desc, v_desc, idx_base, count, N_KV, N_KBLK, qk_scale,
                 BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr, WARP_SPEC: tl.constexpr,
                 LAZY: tl.constexpr, AHEAD: tl.constexpr):
    """Attend the sorted KV blocks idx_base[0:count]. Only the last entry can be the ragged last KV block,
    so only its tiles are masked. AHEAD: each tile's scores are computed one iteration before its softmax
    (kernels/_triton_common.py, loop_ahead)."""
    MULT: tl.constexpr = BLOCK_K // BLOCK_N
    n_iter = count * MULT
    n_full = n_iter
    if not EVEN_K:
        if count > 0:
            if tl.load(idx_base + count - 1) == N_KBLK - 1:
                n_full = n_iter - MULT
    if AHEAD:
        if n_full > 0:
            start = _tile_start(idx_base, 0, BLOCK_K, BLOCK_N)
            qk = _scores(q, k_desc, start, N_KV, BLOCK_N, False)
            for it in tl.range(1, n_full, warp_specialize=WARP_SPEC):
                nxt = _tile_start(idx_base, it, BLOCK_K, BLOCK_N)
                qk_next = _scores(q, k_desc, nxt, N_KV, BLOCK_N, False)
                acc, m_i, l_i = _fold(acc, m_i, l_i, qk, v_desc, start, qk_scale, LAZY)
                qk = qk_next
                start = nxt
            acc, m_i, l_i = _fold(acc, m_i, l_i, qk, v_desc, start, qk_scale, LAZY)
    else:
        for it in tl.range(0, n_full, warp_specialize=WARP_SPEC):
            acc, m_i, l_i = _kv_tile(acc, m_i, l_i, q, k_desc, v_desc, _tile_start(idx_base, it, BLOCK_K, BLOCK_N),
                                     N_KV, qk_scale, BLOCK_N, False, LAZY)
    for j in tl.static_range(MULT):  # the masked tail, unrolled: a loop here would get its own pipeline buffers
        if n_full + j < n_iter:
            blk = tl.load(idx_base + (n_full + j) // MULT)
            acc, m_i, l_i = _kv_tile(acc, m_i, l_i, q, k_desc, v_desc, blk * BLOCK_K + j * BLOCK_N,
                                     N_KV, qk_scale, BLOCK_N, True, LAZY)
    return acc, m_i, l_i


@triton.jit
def _row(row, Q, K, V, Out, Lse, R, RS, RO, ROS, MS, KV_IDX, KV_CNT, CMP_IDX, CMP_CNT,
         sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, srb, srh, srn, ssb, ssh, ssn, msb, msh, msn,
         H, N_Q, N_KV, NQB, N_KBLK, MAX_K, MAX_C, qk_scale,
         HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
         BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, MODE: tl.constexpr,
         RESIDUAL: tl.constexpr, RES_OUT: tl.constexpr, WRITE_LSE: tl.constexpr, WARP_SPEC: tl.constexpr,
         LAZY: tl.constexpr, AHEAD: tl.constexpr, MASS: tl.constexpr):
    """One query block: row = (b * H + h) * NQB + query block. MASS: the anchor writes the rows' mass to MS, a
    block-sparse call weights its residual by the mass read from MS (kernels/_residual.py). MODE 3 reads the dense
    output from R (strides srb, srh, srn) and its LSE from Lse, writes R = dense - sparse to RO (Out's strides) and
    the mass, and leaves Out alone."""
    pid_bh = row // NQB
    qb = row % NQB
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    d = tl.arange(0, D_PAD)
    offs_m = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    q_ok = offs_m < N_Q
    q = load_rows(Q + b * sqb + h * sqh, offs_m, sqn, q_ok, d, HEAD_DIM, D_PAD, True)
    k_desc = tl.make_tensor_descriptor(K + b * skb + h * skh, shape=[N_KV, HEAD_DIM], strides=[skn, 1],
                                       block_shape=[BLOCK_N, D_PAD])
    v_desc = tl.make_tensor_descriptor(V + b * svb + h * svh, shape=[N_KV, HEAD_DIM], strides=[svn, 1],
                                       block_shape=[BLOCK_N, D_PAD])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    if MODE == 1:  # dense: every tile, the ragged last one masked
        n_full = (N_KV // BLOCK_N) * BLOCK_N
        if AHEAD:
            if n_full > 0:
                qk = _scores(q, k_desc, 0, N_KV, BLOCK_N, False)
                for start in tl.range(BLOCK_N, n_full, BLOCK_N, warp_specialize=WARP_SPEC):
                    qk_next = _scores(q, k_desc, start, N_KV, BLOCK_N, False)
                    acc, m_i, l_i = _fold(acc, m_i, l_i, qk, v_desc, start - BLOCK_N, qk_scale, LAZY)
                    qk = qk_next
                acc, m_i, l_i = _fold(acc, m_i, l_i, qk, v_desc, n_full - BLOCK_N, qk_scale, LAZY)
        else:
            for start in tl.range(0, n_full, BLOCK_N, warp_specialize=WARP_SPEC):
                acc, m_i, l_i = _kv_tile(acc, m_i, l_i, q, k_desc, v_desc, start, N_KV, qk_scale, BLOCK_N, False,
                                         LAZY)
        if not EVEN_N:
            acc, m_i, l_i = _kv_tile(acc, m_i, l_i, q, k_desc, v_desc, n_full, N_KV, qk_scale, BLOCK_N, True, LAZY)
        out, lse = finish(acc, m_i, l_i)
    else:
        count = tl.load(KV_CNT + row)
        acc, m_i, l_i = _walk_blocks(acc, m_i, l_i, q, k_desc, v_desc, KV_IDX + row.to(tl.int64) * MAX_K, count,
                                     N_KV, N_KBLK, qk_scale, BLOCK_K, BLOCK_N, EVEN_K, WARP_SPEC, LAZY, AHEAD)
        out, lse = finish(acc, m_i, l_i)
        if MODE == 2:  # the selected blocks' state is the sparse output; continue over the complement
            # The sparse output waits in Out (this row's own rows, in Out's dtype) rather than in registers: held
            # live through the complement walk it took 64 more registers a thread, which spilled under the
            # 128-register cap that lets two programs share an SM (docs/kernel_notes.md, "v16"). R is then formed
            # from both outputs rounded to Out's dtype, as the twin forms it.
            base_o = Out + b * sob + h * soh
            store_rows(base_o, offs_m, son, q_ok, d, out.to(Out.dtype.element_ty), HEAD_DIM, D_PAD)
            lse_s = lse
            c_count = tl.load(CMP_CNT + row)
            acc, m_i, l_i = _walk_blocks(acc, m_i, l_i, q, k_desc, v_desc, CMP_IDX + row.to(tl.int64) * MAX_C,
                                         c_count, N_KV, N_KBLK, qk_scale, BLOCK_K, BLOCK_N, EVEN_K, WARP_SPEC, LAZY,
                                         AHEAD)
            out, lse = finish(acc, m_i, l_i)
            # both outputs rounded to Out's dtype, as the twin rounds them: a row that kept every block gets R = 0
            out = out.to(Out.dtype.element_ty)
            tl.debug_barrier()  # every thread's stores of the sparse rows are visible to the loads below
            res = out.to(tl.float32) - load_rows(base_o, offs_m, son, q_ok, d, HEAD_DIM, D_PAD, True).to(tl.float32)
            tl.debug_barrier()  # and every thread has read them before the dense rows overwrite them
            # the dense rows first: the dense tile is then dead while the residual is scaled and cast
            store_rows(base_o, offs_m, son, q_ok, d, out, HEAD_DIM, D_PAD)
            store_residual_out(RO, ROS, b, h, pid_bh, offs_m, q_ok, sob, soh, son, N_Q, res, d,
                               HEAD_DIM, D_PAD, RES_OUT == 2)
            if MASS:
                store_mass(MS, b, h, offs_m, q_ok, msb, msh, msn, lse_s, lse)
        if MODE == 3:  # the dense output is given: the epilogue only forms the residual
            dense = load_rows(R + b * srb + h * srh, offs_m, srn, q_ok, d, HEAD_DIM, D_PAD, True).to(tl.float32)
            store_residual_out(RO, ROS, b, h, pid_bh, offs_m, q_ok, sob, soh, son, N_Q, dense - out, d,
                               HEAD_DIM, D_PAD, RES_OUT == 2)
            if MASS:
                lse_d = tl.load(Lse + pid_bh.to(tl.int64) * N_Q + offs_m, mask=q_ok, other=0.0)
                store_mass(MS, b, h, offs_m, q_ok, msb, msh, msn, lse, lse_d)
    if MODE == 0:
        w = 1.0
        if MASS:
            w = mass_weight(lse, MS, b, h, offs_m, q_ok, msb, msh, msn)
        out = add_residual(out, R, RS, b, h, offs_m, q_ok, srb, srh, srn, ssb, ssh, ssn, d, HEAD_DIM, D_PAD,
                           RESIDUAL, w, MASS)
    if MODE < 2:  # the anchor stored its dense rows above; the residual mode leaves Out alone
        store_rows(Out + b * sob + h * soh, offs_m, son, q_ok, d, out.to(Out.dtype.element_ty), HEAD_DIM, D_PAD)
    if MODE != 3:
        if WRITE_LSE:
            tl.store(Lse + pid_bh.to(tl.int64) * N_Q + offs_m, lse, mask=q_ok)


@triton.jit
def _attn_tma(Q, K, V, Out, Lse, R, RS, RO, ROS, MS, KV_IDX, KV_CNT, CMP_IDX, CMP_CNT, ORDER, COUNTER,
              sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, srb, srh, srn, ssb, ssh, ssn, msb, msh, msn,
              H, N_Q, N_KV, NQB, N_KBLK, MAX_K, MAX_C, qk_scale, N_ROWS, N_BUCKET,
              HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
              BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, MODE: tl.constexpr,
              RESIDUAL: tl.constexpr, RES_OUT: tl.constexpr, WRITE_LSE: tl.constexpr, ORDERED: tl.constexpr,
              PERSISTENT: tl.constexpr, WARP_SPEC: tl.constexpr, PROGS_PER_SM: tl.constexpr,
              LAZY: tl.constexpr, AHEAD: tl.constexpr, MASS: tl.constexpr):
    if PERSISTENT:  # greedy: each program takes the next row (heaviest first) when it finishes one
        t = tl.atomic_add(COUNTER, 1)
        while t < N_ROWS:
            row = t
            if ORDERED:
                row = tl.load(ORDER + t)
            _row(row, Q, K, V, Out, Lse, R, RS, RO, ROS, MS, KV_IDX, KV_CNT, CMP_IDX, CMP_CNT,
                 sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, srb, srh, srn, ssb, ssh, ssn,
                 msb, msh, msn,
                 H, N_Q, N_KV, NQB, N_KBLK, MAX_K, MAX_C, qk_scale, HEAD_DIM, D_PAD, BLOCK_M, BLOCK_K, BLOCK_N,
                 EVEN_K, EVEN_N, MODE, RESIDUAL, RES_OUT, WRITE_LSE, WARP_SPEC, LAZY, AHEAD,
                 MASS)
            t = tl.atomic_add(COUNTER, 1)
    else:
        row = tl.program_id(0)
        if ORDERED:
            row = tl.load(ORDER + row)
        _row(row, Q, K, V, Out, Lse, R, RS, RO, ROS, MS, KV_IDX, KV_CNT, CMP_IDX, CMP_CNT,
             sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, srb, srh, srn, ssb, ssh, ssn, msb, msh, msn,
             H, N_Q, N_KV, NQB, N_KBLK, MAX_K, MAX_C, qk_scale, HEAD_DIM, D_PAD, BLOCK_M, BLOCK_K, BLOCK_N,
             EVEN_K, EVEN_N, MODE, RESIDUAL, RES_OUT, WRITE_LSE, WARP_SPEC, LAZY, AHEAD,
                 MASS)


def _cfg(bn, w, s, per_sm=1, maxnreg=None):
    return triton.Config({"BLOCK_N": bn, "PROGS_PER_SM": per_sm}, num_warps=w, num_stages=s, maxnreg=maxnreg)


# Candidates, from the sm_90 compiler reports (docs/kernel_notes.md): with BLOCK_M 128 and D 128, 4 warps
# spill (the 128 x 128 fp32 accumulator takes 128 registers a thread) while 8 warps fit (149-229
# registers); capped at 128 registers, two 8-warp programs share an SM. Stages: the pipeliner splits its
# latency budget over the index load and the K/V loads that depend on it, so block lists need 5 stages for
# K/V two tiles ahead (3 and 4 give one); dense tiles are one load deep. The masked tail is unrolled so it
# takes no buffers of its own.
SPARSE_CONFIGS = [_cfg(64, 8, 5), _cfg(64, 8, 3), _cfg(64, 8, 3, maxnreg=128), _cfg(128, 8, 3), _cfg(64, 4, 5),
                  _cfg(128, 4, 3)]
DENSE_CONFIGS = [_cfg(64, 8, 2), _cfg(64, 8, 2, maxnreg=128), _cfg(64, 8, 3), _cfg(128, 8, 2), _cfg(64, 4, 2)]
# The anchor as the dense tiles: capped at 128 registers, two programs an SM; the uncapped 64-wide tilings were slower
# at every density and shape timed (docs/kernel_notes.md, "v16"); the 128-wide one won one of the nine (by 1 %).
ANCHOR_CONFIGS = [_cfg(64, 8, 2, maxnreg=128), _cfg(64, 8, 3, maxnreg=128), _cfg(128, 8, 3)]
PERSISTENT_CONFIGS = [_cfg(64, 8, 5, 1), _cfg(64, 8, 3, 2, maxnreg=128), _cfg(128, 8, 3, 1)]
# Triton 3.6 leaves Hopper loops unspecialised at 8 warps and fails to compile them at 4 (kernel notes)
WARP_SPEC_CONFIGS = [_cfg(64, 8, 5)]
INTERPRET_CONFIG = [_cfg(32, 4, 1)]


def _prune(configs_, named_args, **kwargs):
    """Keep configs whose KV tile fits the KV block; 8 warps need 128 query rows; BLOCK_N 128 with 4
    warps only for 64 query rows (with 128 it spills)."""
    bk = kwargs.get("BLOCK_K", named_args.get("BLOCK_K"))
    bm = kwargs.get("BLOCK_M", named_args.get("BLOCK_M"))
    kept = [c for c in configs_ if c.kwargs["BLOCK_N"] <= bk and not (bm == 64 and c.num_warps == 8)
            and not (bm == 128 and c.num_warps == 4 and c.kwargs["BLOCK_N"] == 128)]
    return kept or [_cfg(min(64, bk), 4, 3)]


# residual and LSE flags are not in the key, but Triton adds every tensor argument's dtype to it: a variant
# whose residual or LSE tensors differ in dtype from the dummies is tuned once more (docs/kernel_notes.md, "v7")
_KEY = ["N_BUCKET", "HEAD_DIM", "BLOCK_M", "BLOCK_K", "MODE", "LAZY", "AHEAD"]
_HEUR = {"EVEN_K": lambda a: a["N_KV"] % a["BLOCK_K"] == 0, "EVEN_N": lambda a: a["N_KV"] % a["BLOCK_N"] == 0}
_tuned: dict[str, object] = {}


def _kernel(kind: str):
    """The autotuned kernel of ``kind`` (sparse, dense, anchor, persistent, warp_spec), built on first use."""
    if kind not in _tuned:
        configs = pick({"sparse": SPARSE_CONFIGS, "dense": DENSE_CONFIGS, "anchor": ANCHOR_CONFIGS,
                        "persistent": PERSISTENT_CONFIGS, "warp_spec": WARP_SPEC_CONFIGS}[kind], INTERPRET_CONFIG)
        extra = {"reset_to_zero": ["COUNTER"]} if kind == "persistent" else {}
        _tuned[kind] = triton.autotune(configs=configs, key=_KEY, prune_configs_by={"early_config_prune": _prune},
                                       **tune_options(), **extra)(triton.heuristics(_HEUR)(_attn_tma))
    return _tuned[kind]


def last_config(kind: str):
    """The config the autotuner picked for the last launch of ``kind`` (None before any)."""
    k = _tuned.get(kind)
    return None if k is None else getattr(k, "best_config", None)


def launch(kind, q, k, v, out, *, scale, block_q, block_k, mode, lse=None, res=None, res_out=None,
           res_fp8=False, idx=None, cnt=None, cmp_idx=None, cmp_cnt=None, order=None, mass=None):
    """Launch the TMA kernel. q: (B,H,Nq,D), k/v: (B,H,Nk,D) with TMA-aligned k/v; out like q.
    idx/cnt (and cmp_idx/cmp_cnt for the anchor): int32 contiguous lists; order: int32 row order or None.
    res: checked residual pair to add (sparse mode), or (dense output (B,H,Nq,D), None) to read (residual mode);
    res_out: (data, scale-or-None) tensors to write (anchor, residual mode; in residual mode ``out`` is the data).
    lse: contiguous fp32 (B,H,Nq), written, or in residual mode the dense LSE, read.
    mass: contiguous fp32 (B,H,Nq,2): read to weight ``res`` (sparse mode) or written (anchor, residual mode)."""
    b, h, nq, d = q.shape
    nk = k.shape[2]
    nqb = cdiv(nq, block_q)
    n_rows = b * h * nqb
    dummy = out
    ro, ros = res_out if res_out is not None else (dummy, None)
    kern = _kernel(kind)
    persistent = kind == "persistent"
    counter = torch.zeros(1, dtype=torch.int32, device=q.device) if persistent else dummy
    if persistent:
        sms = _hopper.num_sms(q.device)

        def grid(meta):
            return (min(n_rows, sms * meta["PROGS_PER_SM"]),)
    else:
        grid = (n_rows,)
    res_args, mass_args = residual_launch_args(res, out), mass_launch_args(mass, out)
    fast_launch.launch(kern, grid, (
        q, k, v, out, lse if lse is not None else dummy, *res_args[:2], ro,
        ros if ros is not None else dummy, mass_args[0],
        idx if idx is not None else dummy, cnt if cnt is not None else dummy,
        cmp_idx if cmp_idx is not None else dummy, cmp_cnt if cmp_cnt is not None else dummy,
        order if order is not None else dummy, counter,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], *res_args[2:], *mass_args[1:],
        h, nq, nk, nqb, cdiv(nk, block_k), idx.shape[-1] if idx is not None else 1,
        cmp_idx.shape[-1] if cmp_idx is not None else 1, scale * LOG2E, n_rows, seq_bucket(nk)), dict(
        HEAD_DIM=d, D_PAD=head_dim_pad(d), BLOCK_M=block_q, BLOCK_K=block_k, MODE=mode,
        RESIDUAL=residual_mode(res), RES_OUT=(2 if res_fp8 else 1) if res_out is not None else 0,
        WRITE_LSE=lse is not None and mode != MODE_RESIDUAL, ORDERED=order is not None, PERSISTENT=persistent,
        WARP_SPEC=kind == "warp_spec", LAZY=lazy_rescale(), AHEAD=loop_ahead(), MASS=mass is not None),
        before=_hopper.scratch_setter(q.device))
    return out


def complement_lists(kv_indices: torch.Tensor, kv_counts: torch.Tensor, n_kblk: int, chunk_rows: int = 4096):
    """The KV blocks NOT in each row's list, sorted: (int32 (B,H,nqb,n_kblk) lists, int32 (B,H,nqb)
    counts). kv_indices (B,H,nqb,max_k) sorted within kv_counts. Elementwise work, no host sync, ``chunk_rows`` list
    rows at a time: the temporaries of all rows at once would be ~0.6 GB at Wan 14B with a CFG batch (47 000 rows x 591
    blocks; the Gluon anchor builds these lists at every density, kernels/anchor_gluon.py)."""
    lead = kv_indices.shape[:3]
    rows = kv_indices.reshape(-1, kv_indices.shape[-1])
    cnt = kv_counts.reshape(-1)
    dev = rows.device
    out = torch.empty((rows.shape[0], n_kblk), dtype=torch.int32, device=dev)
    cols = torch.arange(rows.shape[-1], device=dev).view(1, -1)
    blk = torch.arange(n_kblk, device=dev, dtype=torch.int32).view(1, -1)
    for r0 in range(0, rows.shape[0], chunk_rows):
        part = rows[r0:r0 + chunk_rows].long()
        valid = cols < cnt[r0:r0 + chunk_rows].long().view(-1, 1)
        taken = torch.zeros((part.shape[0], n_kblk + 1), dtype=torch.bool, device=dev)
        taken.scatter_(1, torch.where(valid, part, n_kblk), True)
        free = ~taken[:, :n_kblk]
        pos = torch.cumsum(free, 1, dtype=torch.int32) - 1  # slot of each free block in its row's complement list
        lists = torch.full((part.shape[0], n_kblk + 1), -1, dtype=torch.int32, device=dev)
        lists.scatter_(1, torch.where(free, pos, n_kblk).long(), blk.expand(part.shape[0], -1))
        out[r0:r0 + part.shape[0]] = lists[:, :n_kblk]
    return out.reshape(*lead, n_kblk), (n_kblk - cnt.long()).to(torch.int32).reshape(lead)
