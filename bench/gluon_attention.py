"""A hand-scheduled Hopper attention kernel in Gluon (Triton's explicit-layout language): the probe of issue 14's
one untried lever (docs/kernel_notes.md, "v17").

What Triton's compiler does not do for our kernels (docs/kernel_notes.md, v4 and v8): keep the next tile's QKᵀ on the
tensor cores while the softmax of this one runs, and split loading from computing across warps. This kernel does both
by hand, FlashAttention-3's way:

- a loader partition (one warp, few registers) walks the row's KV block list and issues TMA copies of K and V into a
  ring of STAGES buffers, each with a "ready" barrier (TMA's byte count) and an "empty" barrier (the consumers');
- the default partition (two warpgroups, 64 query rows each) runs, per KV tile j: QKᵀ of tile j issued
  asynchronously, then the PV of tile j-1 issued asynchronously, wait for QKᵀ only (wgmma groups complete in order),
  the softmax of tile j while PV(j-1) is on the tensor cores, then wait for PV(j-1) and rescale.

Dense (the list is 0 … nkb-1) or block-sparse (CSR lists kv_indices (B,H,nqb,max_k) int32 / kv_counts (B,H,nqb) int32,
the engine's layout), block_q = BLOCK_M = 128 and block_k = BLOCK_N. q, k, v: (B,H,N,D) bf16/fp16, contiguous, D 64 or
128. Returns (B,H,N,D) in q's dtype; rows with no block get 0. No residual, no LSE: this is a speed probe; the product
kernels stay in kernels/ until it wins (then it moves there beside its twin).

Usage on the H200/H100: ``python3 bench/gluon_attention.py --out $OUT`` (checks it against the PyTorch twin at real
sizes, then times it against cuDNN and our TMA kernel; bench/device_gluon.sh). Offline, without a GPU:
``python bench/gluon_attention.py --compile-only`` compiles every configuration for sm_90a and reports registers,
spills and shared memory (Triton >= 3.6 with Gluon).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

LOG2E = 1.4426950408889634


@gluon.jit
def _loader(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, idx_row, count, kv_row0,
            DENSE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """One warp: K and V tiles of the row's blocks into the ring, each slot refilled once its consumers released it.
    A fresh barrier counts its phase -1 as complete, so the first pass over the ring does not wait (parity ph ^ 1)."""
    for i in range(count):
        s = i % STAGES
        ph = (i // STAGES) & 1
        if DENSE:
            blk = i
        else:
            blk = gl.load(idx_row + i)
        row = kv_row0 + blk * BLOCK_N
        mbarrier.wait(k_empty.index(s), ph ^ 1)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row, 0], k_ready.index(s), k_bufs.index(s))
        mbarrier.wait(v_empty.index(s), ph ^ 1)
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row, 0], v_ready.index(s), v_bufs.index(s))


@gluon.jit
def _scores(s_raw, blk, n_kv, qk_scale, s_layout: gl.constexpr, BLOCK_N: gl.constexpr):
    """Scores in base 2; keys past the head's end (the ragged last block reads the next head's rows) at -inf."""
    s = s_raw * qk_scale
    if (blk + 1) * BLOCK_N > n_kv:
        col = blk * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = gl.where(gl.expand_dims(col < n_kv, 0), s, float("-inf"))
    return s


@gluon.jit
def _consumer(q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, idx_row, count, n_kv, qk_scale,
              Out, out_row0, q_first,
              DENSE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
              STAGES: gl.constexpr, num_warps: gl.constexpr):
    """A consumer: BLOCK_M query rows (q_smem, rows q_first … of the head) against every tile of the list; stores its
    rows of Out (the head's rows start at out_row0 of the (B·H·N, D) view). One warpgroup per 64 rows."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = q_smem.dtype

    acc = gl.zeros([BLOCK_M, HEAD_D], gl.float32, o_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_s)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    if count > 0:
        # tile 0: scores, softmax; its PV is issued in the next iteration (or after the loop)
        mbarrier.wait(k_ready.index(0), 0)
        s_tok = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s_raw, _, _ = warpgroup_mma_wait(0, deps=(s_tok, q_smem, k_bufs.index(0)))
        mbarrier.arrive(k_empty.index(0), count=1)
        blk = 0 if DENSE else gl.load(idx_row)
        s = _scores(s_raw, blk, n_kv, qk_scale, s_layout, BLOCK_N)
        m_i = gl.max(s, 1)
        m_i = gl.where(m_i == float("-inf"), 0.0, m_i)
        p = gl.exp2(s - gl.expand_dims(m_i, 1))
        l_i = gl.sum(p, 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        for i in range(1, count):
            s_slot = i % STAGES
            v_slot = (i - 1) % STAGES
            mbarrier.wait(k_ready.index(s_slot), (i // STAGES) & 1)
            s_tok = warpgroup_mma(q_smem, k_bufs.index(s_slot).permute((1, 0)), s_zero, use_acc=False,
                                  is_async=True)
            mbarrier.wait(v_ready.index(v_slot), ((i - 1) // STAGES) & 1)
            o_tok = warpgroup_mma(p_op, v_bufs.index(v_slot), acc, is_async=True)
            # groups complete in order: one outstanding means the scores are in, PV(i-1) may still run
            s_raw, _, _ = warpgroup_mma_wait(1, deps=(s_tok, q_smem, k_bufs.index(s_slot)))
            mbarrier.arrive(k_empty.index(s_slot), count=1)
            blk = i if DENSE else gl.load(idx_row + i)
            s = _scores(s_raw, blk, n_kv, qk_scale, s_layout, BLOCK_N)
            m_new = gl.maximum(m_i, gl.max(s, 1))
            m_new = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s - gl.expand_dims(m_new, 1))
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
            acc, _, _ = warpgroup_mma_wait(0, deps=(o_tok, p_op, v_bufs.index(v_slot)))
            mbarrier.arrive(v_empty.index(v_slot), count=1)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
        v_slot = (count - 1) % STAGES
        mbarrier.wait(v_ready.index(v_slot), ((count - 1) // STAGES) & 1)
        o_tok = warpgroup_mma(p_op, v_bufs.index(v_slot), acc, is_async=True)
        acc, _, _ = warpgroup_mma_wait(0, deps=(o_tok, p_op, v_bufs.index(v_slot)))
        mbarrier.arrive(v_empty.index(v_slot), count=1)
    l_o = gl.convert_layout(l_i, row_o)
    out = acc / gl.expand_dims(gl.where(l_o > 0, l_o, 1.0), 1)
    # stored from the accumulator's own layout: a conversion would take 16-32 KB of shared memory the ring needs
    rows = q_first + gl.arange(0, BLOCK_M, layout=row_o)
    cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, o_layout))
    ptrs = Out + (out_row0 + gl.expand_dims(rows, 1)).to(gl.int64) * HEAD_D + gl.expand_dims(cols, 0)
    gl.store(ptrs, out.to(dtype), mask=gl.expand_dims(rows < n_kv, 1))


@gluon.jit
def _attention_fwd(q_desc, k_desc, v_desc, Out, IDX, CNT, N, NQB, MAX_K, qk_scale,
                   DENSE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                   STAGES: gl.constexpr, SPLIT: gl.constexpr, num_warps: gl.constexpr):
    """One program per (query block, batch × head); q/k/v descriptors over the (B·H·N, D) view. SPLIT False: one
    consumer partition of 8 warps for the 128 rows (the compiler syncs its two warpgroups before each barrier
    arrival); True: two consumer partitions of 4 warps, 64 rows each, each arriving on its own (FlashAttention-3's
    split; launched with num_warps 4)."""
    qb = gl.program_id(0)
    bh = gl.program_id(1)
    row0 = bh * N
    if DENSE:
        count = gl.cdiv(N, BLOCK_N)
        idx_row = IDX
    else:
        count = gl.load(CNT + bh * NQB + qb)
        idx_row = IDX + (bh * NQB + qb) * MAX_K

    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_D], q_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], v_desc.layout)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_bar = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    consumers: gl.constexpr = 2 if SPLIT else 1
    mbarrier.init(q_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(k_empty.index(s), count=consumers)
        mbarrier.init(v_empty.index(s), count=consumers)
    fence_async_shared()
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row0 + qb * BLOCK_M, 0], q_bar, q_smem)
    mbarrier.wait(q_bar, 0)

    if SPLIT:
        half: gl.constexpr = BLOCK_M // 2
        gl.warp_specialize([
            (_consumer, (q_smem.slice(0, half), k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, idx_row, count,
                         N, qk_scale, Out, row0, qb * BLOCK_M, DENSE, half, BLOCK_N, HEAD_D, STAGES, 4)),
            (_consumer, (q_smem.slice(half, half), k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, idx_row,
                         count, N, qk_scale, Out, row0, qb * BLOCK_M + half, DENSE, half, BLOCK_N, HEAD_D, STAGES,
                         4)),
            (_loader, (k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, idx_row, count, row0,
                       DENSE, BLOCK_N, STAGES)),
        ], [4, 1], [240, 24])
    else:
        gl.warp_specialize([
            (_consumer, (q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, idx_row, count, N, qk_scale,
                         Out, row0, qb * BLOCK_M, DENSE, BLOCK_M, BLOCK_N, HEAD_D, STAGES, num_warps)),
            (_loader, (k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, idx_row, count, row0,
                       DENSE, BLOCK_N, STAGES)),
        ], [1], [24])


CONFIGS = [dict(BLOCK_N=128, STAGES=2, SPLIT=False), dict(BLOCK_N=128, STAGES=2, SPLIT=True),
           dict(BLOCK_N=128, STAGES=3, SPLIT=True), dict(BLOCK_N=64, STAGES=4, SPLIT=True),
           dict(BLOCK_N=64, STAGES=4, SPLIT=False)]


CONFIGS_ALL = list(CONFIGS)


def _tag(cfg):
    """A configuration's label: 'BN128 s2 split'."""
    return f"BN{cfg['BLOCK_N']} s{cfg['STAGES']} {'split' if cfg['SPLIT'] else 'w8'}"


def _gl_dtype(dtype):
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]


def attention(q, k, v, kv_indices=None, kv_counts=None, *, block_n=128, stages=2, split=True, scale=None):
    """Dense (kv_indices None) or block-sparse attention on the Gluon kernel.

    q, k, v: (B,H,N,D) bf16/fp16 contiguous, D in {64, 128}; kv_indices (B,H,nqb,max_k) int32 sorted block lists
    (block_q 128, block_k ``block_n``), kv_counts (B,H,nqb) int32. Returns (B,H,N,D) in q's dtype."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    b, h, n, d = q.shape
    if d not in (64, 128) or q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"the Gluon probe takes D 64/128 in bf16/fp16, got D {d} {q.dtype}")
    q, k, v = (t.contiguous() for t in (q, k, v))
    scale = scale if scale is not None else d ** -0.5
    out = torch.empty_like(q)
    gdt = _gl_dtype(q.dtype)
    q_layout = gl.NVMMASharedLayout.get_default_for([128, d], gdt)
    kv_layout = gl.NVMMASharedLayout.get_default_for([block_n, d], gdt)
    flat = lambda t: t.view(b * h * n, d)  # noqa: E731
    q_desc = TensorDescriptor(flat(q), [b * h * n, d], [d, 1], [128, d], q_layout)
    k_desc = TensorDescriptor(flat(k), [b * h * n, d], [d, 1], [block_n, d], kv_layout)
    v_desc = TensorDescriptor(flat(v), [b * h * n, d], [d, 1], [block_n, d], kv_layout)
    nqb = triton.cdiv(n, 128)
    dense = kv_indices is None
    if dense:
        idx = torch.zeros(1, dtype=torch.int32, device=q.device)
        cnt, max_k = idx, 1
    else:
        idx, cnt, max_k = kv_indices.contiguous(), kv_counts.contiguous(), kv_indices.shape[-1]
    _attention_fwd[(nqb, b * h)](q_desc, k_desc, v_desc, out, idx, cnt, n, nqb, max_k, scale * LOG2E,
                                 DENSE=dense, BLOCK_M=128, BLOCK_N=block_n, HEAD_D=d, STAGES=stages, SPLIT=split,
                                 num_warps=4 if split else 8)
    return out


def compile_report(configs=None, modes=(True, False)):
    """Configurations (default every one of CONFIGS) compiled for sm_90a without a GPU, dense (True) and block-sparse
    (False): [(label, resources)] (tools/compile_report.py: regs, spill bytes, shared bytes, tma, wgmma)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from compile_report import compile_one
    from triton.experimental.gluon._runtime import GluonASTSource
    fn = _attention_fwd
    rows = []
    for dense in modes:
        for cfg in configs or CONFIGS:
            bn, st, split = cfg["BLOCK_N"], cfg["STAGES"], cfg["SPLIT"]
            warps = 4 if split else 8
            q_layout = gl.NVMMASharedLayout.get_default_for([128, 128], gl.bfloat16)
            kv_layout = gl.NVMMASharedLayout.get_default_for([bn, 128], gl.bfloat16)
            types = dict(q_desc=f"tensordesc<bf16[128, 128],{q_layout!r}>",
                         k_desc=f"tensordesc<bf16[{bn}, 128],{kv_layout!r}>",
                         v_desc=f"tensordesc<bf16[{bn}, 128],{kv_layout!r}>",
                         Out="*bf16", IDX="*i32", CNT="*i32", qk_scale="fp32")
            consts = dict(DENSE=dense, BLOCK_M=128, BLOCK_N=bn, HEAD_D=128, STAGES=st, SPLIT=split, num_warps=warps)
            label = f"{'dense' if dense else 'sparse'} {_tag(cfg)}"
            conf = argparse.Namespace(num_warps=warps, num_stages=1, maxnreg=None)
            res = compile_one(fn, types, consts, ["Out", "IDX", "CNT"], conf, source=GluonASTSource)
            rows.append((label, res))
    return rows


def _check(K, log):
    """Against fp32 SDPA (dense) and the PyTorch twin (block-sparse) on the GPU: ragged N, empty rows, a row over every
    block, every configuration. q is scaled so that attention is peaked (outputs of order 1: a tile missed or counted
    twice shows far above bf16 rounding); each error must stay within 3x (+2e-3) of our Triton kernel's on the same
    call. Returns [(label, max abs error, ok)]."""
    import torch.nn.functional as F
    import kernels as kb  # bench/kernels.py (bench/ is on the path: the script's folder): SHAPES, block_lists, bench
    out = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    for h, n in ((2, 4133), (3, 32760)):
        q, k, v = (torch.randn(1, h, n, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
        q = (q * 2.5).to(q.dtype)
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        ours = K.attention_dense(q, k, v, backend="triton")
        ours_err = (ours.float() - ref).abs().max().item()
        log(f"dense {h}x{n}: our Triton kernel's max |err| {ours_err:.2e}")
        lists = {}
        for bn in sorted({c["BLOCK_N"] for c in CONFIGS}):
            nqb, nkb = triton.cdiv(n, 128), triton.cdiv(n, bn)
            idx, cnt = kb.block_lists(h, nqb, nkb, 0.25, True, gen)
            idx = torch.cat([idx, torch.full((1, h, nqb, max(0, nkb - idx.shape[-1])), -1, dtype=idx.dtype,
                                             device=idx.device)], -1)
            cnt[0, 0, :3] = 0  # empty rows
            cnt[0, -1, -1] = nkb  # the last (ragged) query block over every key block, the ragged last one included
            idx[0, -1, -1, :nkb] = torch.arange(nkb, device=idx.device, dtype=idx.dtype)
            twin = K.block_sparse_attention(q, k, v, idx, cnt, block_q=128, block_k=bn, backend="torch").float()
            mine = K.block_sparse_attention(q, k, v, idx, cnt, block_q=128, block_k=bn, backend="triton")
            lists[bn] = (idx, cnt, twin, (mine.float() - twin).abs().max().item())
            log(f"sparse {h}x{n} bk{bn}: our Triton kernel's max |err| {lists[bn][3]:.2e}")
        for cfg in CONFIGS:
            bn = cfg["BLOCK_N"]
            tag = f"{h}x{n} {_tag(cfg)}"
            idx, cnt, twin, mine_err = lists[bn]
            for kind, lists_, want, tol in (("dense", (), ref, ours_err), ("sparse", (idx, cnt), twin, mine_err)):
                try:
                    got = attention(q, k, v, *lists_, block_n=bn, stages=cfg["STAGES"], split=cfg["SPLIT"])
                    err = (got.float() - want).abs().max().item()
                except Exception as exc:  # a compile or launch failure fails this configuration only
                    log(f"{kind} {tag}: {type(exc).__name__}: {str(exc)[:400]}")
                    out.append((f"{kind} {tag}", float("nan"), False))
                    continue
                out.append((f"{kind} {tag}", err, err <= 3 * tol + 2e-3))
                log(f"{kind} {tag}: max |err| {err:.2e}")
    return out


def _time(K, shapes, log, budget_s, configs, densities=(0.25, 0.1, 0.5)):
    """ms of cuDNN dense, our TMA dense kernel, every Gluon configuration dense, and at d 0.5 / 0.25 / 0.1 our
    block-sparse kernel and the Gluon kernel (lists of 128 × BLOCK_N blocks), on random bf16 inputs."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import kernels as kb  # bench/kernels.py (bench/ is on the path: the script's folder): SHAPES, block_lists, bench
    t_end = time.time() + budget_s
    rows = []
    for name in shapes:
        h, n, d = kb.SHAPES[name]
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
        flops = 4.0 * h * n * n * d

        def rec(kind, variant, fn, density=1.0):
            try:
                ms = kb.bench(fn)
            except Exception as exc:
                log(f"{name:7s} {kind:6s} {variant:28s} failed: {type(exc).__name__}: {str(exc)[:300]}")
                return
            r = dict(shape=name, kind=kind, variant=variant, density=density, ms=ms,
                     tflops=flops * density / ms / 1e9)
            rows.append(r)
            log(f"{name:7s} {kind:6s} {variant:28s} d={density:.2f} {ms:9.3f} ms {r['tflops']:6.1f} TF/s")
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            rec("dense", "cudnn", lambda: F.scaled_dot_product_attention(q, k, v))
        rec("dense", "ours tma (+lse)", lambda: K.attention_dense(q, k, v, return_lse=True, backend="triton"))
        for cfg in configs:
            if time.time() > t_end:
                break
            tag = f"gluon {_tag(cfg)}"
            rec("dense", tag, lambda: attention(q, k, v, block_n=cfg["BLOCK_N"], stages=cfg["STAGES"],
                                                split=cfg["SPLIT"]))
        for dens in densities:
            if time.time() > t_end:
                break
            nqb = triton.cdiv(n, 128)
            lists = {}
            for bn in sorted({128} | {c["BLOCK_N"] for c in configs}):
                lists[bn] = kb.block_lists(h, nqb, triton.cdiv(n, bn), dens, False, gen)
            idx, cnt = lists[128]
            kept = kb.kept_fraction(cnt, n, 128, 128)
            rec("sparse", "ours tma bk128", lambda: K.block_sparse_attention(
                q, k, v, idx, cnt, block_q=128, block_k=128, validate=False), kept)
            for cfg in configs:
                bn = cfg["BLOCK_N"]
                i2, c2 = lists[bn]
                kept = kb.kept_fraction(c2, n, 128, bn)
                tag = f"gluon {_tag(cfg)} bk{bn}"
                rec("sparse", tag, lambda: attention(q, k, v, i2, c2, block_n=bn, stages=cfg["STAGES"],
                                                     split=cfg["SPLIT"]), kept)
            if 64 in lists:
                i2, c2 = lists[64]
                rec("sparse", "ours tma bk64", lambda: K.block_sparse_attention(
                    q, k, v, i2, c2, block_q=128, block_k=64, validate=False), kb.kept_fraction(c2, n, 128, 64))
        q = k = v = None  # noqa: F841  (the next shape's inputs take their memory)
        torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder for gluon.json and the compiler report")
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90a and report; no GPU needed")
    ap.add_argument("--shapes", default="wan14b,hyv,wan13b")
    ap.add_argument("--budget", type=float, default=300.0, help="seconds for the timings")
    ap.add_argument("--configs", default="", help="only these configurations, e.g. 'BN128 s2 split,BN128 s2 w8'")
    ap.add_argument("--densities", default="0.25,0.1,0.5", help="block-sparse densities timed ('' for dense only)")
    ap.add_argument("--list-configs", action="store_true", help="print the configurations' labels, one a line")
    ap.add_argument("--check-only", action="store_true",
                    help="only the checks against the twins (exit 0 when every configuration passes): "
                         "bench/device_gluon.sh runs each configuration so in its own process first, so that a "
                         "configuration that hangs the GPU costs its own timeout, not the run")
    args = ap.parse_args()
    global CONFIGS
    if args.list_configs:
        sys.stdout.write("".join(_tag(c) + "\n" for c in CONFIGS))
        return 0
    if args.configs:
        want = {c.strip() for c in args.configs.split(",")}
        CONFIGS = [c for c in CONFIGS if _tag(c) in want]
        if not CONFIGS:
            ap.error(f"--configs: none of {sorted(want)} is a configuration ({[_tag(c) for c in CONFIGS_ALL]})")
    log_file = None
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        log_file = open(Path(args.out, "gluon.log"), "a")  # noqa: SIM115  (line by line: a hang keeps what came before)

    def log(msg):
        sys.stderr.write(msg + "\n")
        sys.stderr.flush()
        if log_file:
            log_file.write(msg + "\n")
            log_file.flush()
    report = compile_report() if args.compile_only else []  # offline it says the same (same Triton, same target)
    for label, res in report:
        log(f"{label}: {res}")
    result = dict(report=report)
    if not args.compile_only:
        from _pack import load  # bench/_pack.py
        K = load("kernels")
        log(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
        checks = _check(K, log)
        result["checks"] = checks
        failed = {label.split(" ", 2)[2] for label, _, ok in checks if not ok}
        passed = [c for c in CONFIGS if _tag(c) not in failed]
        if failed:
            log(f"checks failed for {sorted(failed)}: those are not timed")
        if passed and not args.check_only:
            result["rows"] = _time(K, [s for s in args.shapes.split(",") if s], log, args.budget, passed,
                                   [float(x) for x in args.densities.split(",") if x.strip()])
    if args.out and not args.check_only:  # a check-only run's results are in the log (one process a configuration)
        Path(args.out, "gluon.json").write_text(json.dumps(result, indent=1))
    return 0 if all(ok for _, _, ok in result.get("checks", [])) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
