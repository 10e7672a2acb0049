"""Dense and block-sparse flash attention for Hopper written in Gluon (Triton's explicit-layout language), scheduled
by hand the way FlashAttention-3 is; twins ``dense_torch.attention_dense`` and ``block_sparse_torch``.

Why a second Hopper kernel: every Triton-level lever left our TMA kernel (kernels/attention_hopper.py) at 0.91-0.94 of
cuDNN's dense rate, and the block-sparse rate and the anchor are bounded by it. This one beats cuDNN: on the H200 at
Wan 2.1 14B (40 heads x 75 600 tokens, D 128) dense 188.8 ms against cuDNN's 206.8 ms and our TMA kernel's 218.3 ms;
block-sparse at d 0.25 / 0.1 / 0.5 in 49.8 / 20.9 / 100.0 ms against 61.8 / 25.6 / 123.6 ms (docs/kernel_notes.md,
"v17"; docs/benchmarks.md, "A Hopper kernel in Gluon"). How:

- a loader partition (one warp, 24 registers) walks the row's KV block list and copies K and V tiles by TMA into a
  ring of STAGES buffers, each slot with a "ready" barrier (TMA's byte count) and an "empty" barrier (its consumers');
- two consumer partitions of one warpgroup each (64 query rows each, 240 registers) issue, per KV tile j, QK^T of j
  and PV of j-1 asynchronously, wait for QK^T only (wgmma groups complete in order), run the softmax of j while PV(j-1)
  is on the tensor cores, then wait for PV and rescale;
- each consumer finishes its rows itself: LSE, the residual (model dtype or fp8 with its per-row scale, weighted by
  the mass: kernels/_residual.py), stored by pointer from the accumulator's layout (a layout conversion would take
  shared memory the ring needs).

Layouts: q, k, v are addressed through 2-D TMA descriptors, either over a contiguous (B, H, N, D) tensor (rows
(b*H + h)*N + n, column 0) or over a (B, N, H, D) tensor seen as (B, H, N, D) (rows b*N + n, column h*D: the
transposed views ComfyUI's (B, N, H*D) attention inputs arrive as), with no copy; anything else is copied contiguous.
A query or KV tile past a head's end reads the next head's rows (or TMA's zero fill): those keys are masked to -inf and
those query rows are not stored. (Their weight is exactly 0, but a non-finite value in those V rows still reaches the
row through 0 x inf = NaN in PV, where the TMA kernels' per-head descriptors read zeros: an inf in a model's V already
makes every output of its own head that attends it non-finite, so a run with one is broken either way.) Out, LSE,
the residual and its scale and mass are contiguous (B, H, N, ...).

kernels/_hopper.py (``gluon_problem``) says when this kernel may run; it is imported only there, so a Triton without
Gluon costs nothing. There is no interpreter for Gluon: tests/test_gluon_kernels.py compiles every variant for sm_90a
on the CPU, and the GPU tests check each against its twin.
"""

from __future__ import annotations

import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ._hopper import num_sms, rows_layout
from ._residual import MASS_EPS
from ._triton_common import LOG2E

BLOCK_M = 128  # query rows of a program: two consumers of 64
LOG_MASS_EPS = gl.constexpr(math.log(MASS_EPS))
LN2 = gl.constexpr(0.6931471805599453)
# (BLOCK_N, STAGES) per KV block size: the fastest of the configurations timed on the H200 (docs/kernel_notes.md, v17:
# 128-wide tiles three deep won the dense rows and most sparse ones; 64-wide tiles four deep where lists are of 64)
TILES = {128: (128, 3), 64: (64, 4)}
RES_NONE, RES_MODEL, RES_FP8 = 0, 1, 2


@gluon.jit
def _loader(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, idx_row, count, kv_row0, kv_col,
            DENSE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, base=0, first=0):
    """One warp: the K and V tiles first ... count - 1 of the row's blocks into the ring, each slot refilled once both
    consumers released it. A fresh barrier counts its phase -1 as complete, so the first pass over the ring does not
    wait (parity ^ 1). ``base``: the tiles this program's ring carried before this row (the persistent kernel's rows
    share one ring)."""
    for i in range(first, count):
        s = (base + i) % STAGES
        ph = ((base + i) // STAGES) & 1
        if DENSE:
            blk = i
        else:
            blk = gl.load(idx_row + i)
        row = kv_row0 + blk * BLOCK_N
        mbarrier.wait(k_empty.index(s), ph ^ 1)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row, kv_col], k_ready.index(s), k_bufs.index(s))
        mbarrier.wait(v_empty.index(s), ph ^ 1)
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row, kv_col], v_ready.index(s), v_bufs.index(s))


@gluon.jit
def _scores(s_raw, blk, n_kv, qk_scale, s_layout: gl.constexpr, BLOCK_N: gl.constexpr):
    """Scores in base 2; keys past the head's end (the ragged last tile reads the next head's rows) at -inf."""
    s = s_raw * qk_scale
    if (blk + 1) * BLOCK_N > n_kv:
        col = blk * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = gl.where(gl.expand_dims(col < n_kv, 0), s, float("-inf"))
    return s


@gluon.jit
def _finish(acc, m_i, l_i, bh, q_first, n_q, q_rows, o_layout: gl.constexpr, ROWS: gl.constexpr,
            HEAD_D: gl.constexpr, GATHER: gl.constexpr):
    """A consumer's rows finished: (out = acc / l fp32 [ROWS, HEAD_D] in o_layout, the row LSE (natural log, -inf for
    a row that attended nothing), the rows' index in the contiguous (B*H*N_Q, ...) tensors, the elements' offsets in
    the (B*H*N_Q, HEAD_D) ones, the rows' mask, the elements' mask). Rows q_first ... of head bh, or (GATHER) the
    rows q_rows[q_first ...] lists, -1 for none."""
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    l_o = gl.convert_layout(l_i, row_o)
    m_o = gl.convert_layout(m_i, row_o)
    empty = l_o == 0.0
    out = acc / gl.expand_dims(gl.where(empty, 1.0, l_o), 1)
    if GATHER:
        rows = gl.load(q_rows + q_first + gl.arange(0, ROWS, layout=row_o))
        ok = rows >= 0
    else:
        rows = q_first + gl.arange(0, ROWS, layout=row_o)
        ok = rows < n_q
    flat = bh.to(gl.int64) * n_q + rows
    lse = gl.where(empty, float("-inf"), (m_o + gl.log2(gl.where(empty, 1.0, l_o))) * LN2)
    cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, o_layout))
    offs = gl.expand_dims(flat, 1) * HEAD_D + gl.expand_dims(cols, 0)
    return out, lse, flat, offs, ok, gl.expand_dims(ok, 1)


@gluon.jit
def _epilogue(acc, m_i, l_i, Out, Lse, R, RS, MS, bh, q_first, n_q, q_rows,
              o_layout: gl.constexpr, ROWS: gl.constexpr, HEAD_D: gl.constexpr, RESIDUAL: gl.constexpr,
              MASS: gl.constexpr, WRITE_LSE: gl.constexpr, GATHER: gl.constexpr):
    """Rows q_first ... of head bh (GATHER: the rows q_rows[q_first ...] lists, -1 for none): out = acc / l plus the
    residual (times the mass weight), stored to Out; the row LSE (natural log, -inf for a row that attended nothing)
    to Lse. Out/R are contiguous (B*H*N_Q, D), RS/Lse (B*H*N_Q), MS (B*H*N_Q, 2)."""
    out, lse, flat, offs, ok, ok2 = _finish(acc, m_i, l_i, bh, q_first, n_q, q_rows, o_layout, ROWS, HEAD_D, GATHER)
    if RESIDUAL != 0:
        r = gl.load(R + offs, mask=ok2, other=0.0).to(gl.float32)
        if RESIDUAL == 2:
            r = r * gl.expand_dims(gl.load(RS + flat, mask=ok, other=0.0), 1)
        if MASS:  # kernels/_residual.py, mass_weight: the complement's share now over its share at the anchor
            log_c = gl.load(MS + flat * 2, mask=ok, other=0.0)
            log_beta = gl.load(MS + flat * 2 + 1, mask=ok, other=0.0)
            x = log_c - lse  # +inf where this call kept nothing
            share = gl.minimum(x, 0.0) - gl.log(1.0 + gl.exp(-gl.abs(x)))
            w = gl.where(log_beta > LOG_MASS_EPS, gl.exp(share - log_beta), 1.0)
            r = r * gl.expand_dims(w, 1)
        out = out + r
    gl.store(Out + offs, out.to(Out.dtype.element_ty), mask=ok2)
    if WRITE_LSE:
        gl.store(Lse + flat, lse, mask=ok)


@gluon.jit
def _consumer(q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, idx_row, count, n_q, n_kv, qk_scale,
              Out, Lse, R, RS, MS, bh, q_first, q_rows,
              DENSE: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
              STAGES: gl.constexpr, RESIDUAL: gl.constexpr, MASS: gl.constexpr, WRITE_LSE: gl.constexpr,
              WARPS: gl.constexpr, GATHER: gl.constexpr):
    """A consumer partition of WARPS warps (one warpgroup per 64 rows): ROWS query rows (q_smem; rows q_first ... of
    head bh) against every tile of the list, then the epilogue. GATHER (kernels/token_sparse_gluon.py): the tiles are
    gathered token rows written by cp.async (count tiles, DENSE, n_kv the list's length: its tail's slots masked), so
    each wait is followed by a proxy fence before the tensor cores read the tile, and the rows are stored where q_rows
    says."""
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    acc, m_i, l_i = _attend(q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, idx_row, count, n_kv,
                            qk_scale, 0, DENSE, ROWS, BLOCK_N, HEAD_D, STAGES, WARPS, GATHER)
    _epilogue(acc, m_i, l_i, Out, Lse, R, RS, MS, bh, q_first, n_q, q_rows, o_layout, ROWS, HEAD_D, RESIDUAL, MASS,
              WRITE_LSE, GATHER)


@gluon.jit
def _wait_tile(ready, s, t, STAGES: gl.constexpr, GATHER: gl.constexpr):
    """Wait until the ring's t-th tile (in slot s = t % STAGES) landed; GATHER: cp.async wrote it through the generic
    proxy, so a proxy fence orders it before the tensor cores read it."""
    mbarrier.wait(ready.index(s), (t // STAGES) & 1)
    if GATHER:
        fence_async_shared()


@gluon.jit
def _attend(q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, idx_row, count, n_kv, qk_scale, base,
            DENSE: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
            STAGES: gl.constexpr, WARPS: gl.constexpr, GATHER: gl.constexpr):
    """The online softmax of ROWS query rows (q_smem) over the row's ``count`` tiles, taken from the ring where the
    loader put them: tile i in slot (base + i) % STAGES (``base``: the tiles the ring carried before this row).
    Returns (acc [ROWS, HEAD_D] fp32 unnormalised, running max m_i (base 2), running sum l_i); every wgmma on q_smem
    has completed when it returns."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    acc = gl.zeros([ROWS, HEAD_D], gl.float32, o_layout)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    return _attend_more(q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, idx_row, count, n_kv, qk_scale,
                        base, acc, m_i, l_i, DENSE, ROWS, BLOCK_N, HEAD_D, STAGES, WARPS, GATHER, False)


@gluon.jit
def _attend_more(q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, idx_row, count, n_kv, qk_scale, base,
                 acc, m_i, l_i, DENSE: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                 HEAD_D: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr, GATHER: gl.constexpr,
                 CARRY: gl.constexpr):
    """``_attend`` from a state (acc, m_i, l_i) as it returns them: CARRY, the walk goes on from that state (the
    fused anchor's complement after its selected tiles: kernels/anchor_gluon.py); otherwise the state is the fresh
    one (acc 0, m_i -inf, l_i 0) and the first tile starts it without rescaling."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = q_smem.dtype

    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    if count > 0:
        # tile 0: scores and softmax; its PV is issued in the next iteration (or after the loop)
        s0 = base % STAGES
        _wait_tile(k_ready, s0, base, STAGES, GATHER)
        s_tok = warpgroup_mma(q_smem, k_bufs.index(s0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s_raw, _, _ = warpgroup_mma_wait(0, deps=(s_tok, q_smem, k_bufs.index(s0)))
        mbarrier.arrive(k_empty.index(s0), count=1)
        blk = 0 if DENSE else gl.load(idx_row)
        s = _scores(s_raw, blk, n_kv, qk_scale, s_layout, BLOCK_N)
        m_new = gl.max(s, 1)
        if CARRY:
            m_new = gl.maximum(m_i, m_new)
        m_new = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - gl.expand_dims(m_new, 1))
        if CARRY:  # a row that kept nothing before has m_i -inf: alpha 0 on its zero state
            alpha = gl.exp2(m_i - m_new)
            l_i = l_i * alpha + gl.sum(p, 1)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        else:
            l_i = gl.sum(p, 1)
        m_i = m_new
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        for i in range(1, count):
            s_slot = (base + i) % STAGES
            v_slot = (base + i - 1) % STAGES
            _wait_tile(k_ready, s_slot, base + i, STAGES, GATHER)
            s_tok = warpgroup_mma(q_smem, k_bufs.index(s_slot).permute((1, 0)), s_zero, use_acc=False,
                                  is_async=True)
            _wait_tile(v_ready, v_slot, base + i - 1, STAGES, GATHER)
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
        v_slot = (base + count - 1) % STAGES
        _wait_tile(v_ready, v_slot, base + count - 1, STAGES, GATHER)
        o_tok = warpgroup_mma(p_op, v_bufs.index(v_slot), acc, is_async=True)
        acc, _, _ = warpgroup_mma_wait(0, deps=(o_tok, p_op, v_bufs.index(v_slot)))
        mbarrier.arrive(v_empty.index(v_slot), count=1)
    return acc, m_i, l_i


@gluon.jit
def _list_row(row, IDX, CNT, NQB, MAX_K):
    """Row ``row`` of the B*H*NQB block lists: (head bh, query block qb, its count, its index row in IDX)."""
    return row // NQB, row % NQB, gl.load(CNT + row), IDX + row.to(gl.int64) * MAX_K


@gluon.jit
def _origins(bh, H, N_Q, N_KV, Q_BNHD: gl.constexpr, KV_BNHD: gl.constexpr, HEAD_D: gl.constexpr):
    """(first row, column) of head bh in the Q descriptor and in the K/V ones: rows of (B*H*N, D), or of (B*N, H*D)
    with the head as a column offset (the module docstring's layouts)."""
    b = bh // H
    h = bh % H
    if Q_BNHD:
        q_row0 = b * N_Q
        q_col = h * HEAD_D
    else:
        q_row0 = bh * N_Q
        q_col = 0
    if KV_BNHD:
        kv_row0 = b * N_KV
        kv_col = h * HEAD_D
    else:
        kv_row0 = bh * N_KV
        kv_col = 0
    return q_row0, q_col, kv_row0, kv_col


@gluon.jit
def _ring(q_desc, k_desc, v_desc, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
          CONSUMERS: gl.constexpr):
    """Shared memory of a program: the 128-row query tile, STAGES K and V slots, and their barriers (the query tile's
    and each slot's ready barrier count one TMA arrival, each slot's empty one the CONSUMERS' releases)."""
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [128, HEAD_D], q_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], v_desc.layout)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_bar = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    mbarrier.init(q_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(k_empty.index(s), count=CONSUMERS)  # every consumer releases a slot
        mbarrier.init(v_empty.index(s), count=CONSUMERS)
    return q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, k_empty, v_empty


@gluon.jit
def _attention_fwd(q_desc, k_desc, v_desc, Out, Lse, R, RS, MS, IDX, CNT, ORDER, H, N_Q, N_KV, NQB, MAX_K, qk_scale,
                   DENSE: gl.constexpr, ORDERED: gl.constexpr, Q_BNHD: gl.constexpr, KV_BNHD: gl.constexpr,
                   BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr, RESIDUAL: gl.constexpr,
                   MASS: gl.constexpr, WRITE_LSE: gl.constexpr, SPLIT: gl.constexpr):
    """Dense: grid (query blocks, B*H). Block-sparse: a 1-D grid over the B*H*NQB rows of the lists, taken in
    ORDER (heaviest first) when ORDERED. Q_BNHD / KV_BNHD: the descriptor is over (B*N, H*D) rather than
    (B*H*N, D) (module docstring). SPLIT (the product's layout): two consumer partitions of one warpgroup, 64 rows
    each, launched with 4 warps (warp_specialize adds the consumers' and the loader's); False: one 8-warp consumer
    for the 128 rows, launched with 8 warps (slower: the compiler syncs its two warpgroups before every barrier
    arrival; kept for bench/gluon_attention.py's comparison, docs/kernel_notes.md "v17")."""
    if DENSE:
        qb = gl.program_id(0)
        bh = gl.program_id(1)
        count = gl.cdiv(N_KV, BLOCK_N)
        idx_row = IDX
    else:
        row = gl.program_id(0)
        if ORDERED:
            row = gl.load(ORDER + row)
        bh, qb, count, idx_row = _list_row(row, IDX, CNT, NQB, MAX_K)
    q_row0, q_col, kv_row0, kv_col = _origins(bh, H, N_Q, N_KV, Q_BNHD, KV_BNHD, HEAD_D)

    half: gl.constexpr = 64
    q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, k_empty, v_empty = _ring(q_desc, k_desc, v_desc, BLOCK_N,
                                                                              HEAD_D, STAGES, 2 if SPLIT else 1)
    fence_async_shared()
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row0 + qb * (2 * half), q_col], q_bar, q_smem)
    mbarrier.wait(q_bar, 0)

    if SPLIT:
        gl.warp_specialize([
            (_consumer, (q_smem.slice(0, half), k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, idx_row, count,
                         N_Q, N_KV, qk_scale, Out, Lse, R, RS, MS, bh, qb * (2 * half), idx_row, DENSE, half,
                         BLOCK_N, HEAD_D, STAGES, RESIDUAL, MASS, WRITE_LSE, 4, False)),
            (_consumer, (q_smem.slice(half, half), k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, idx_row,
                         count, N_Q, N_KV, qk_scale, Out, Lse, R, RS, MS, bh, qb * (2 * half) + half, idx_row,
                         DENSE, half, BLOCK_N, HEAD_D, STAGES, RESIDUAL, MASS, WRITE_LSE, 4, False)),
            (_loader, (k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, idx_row, count, kv_row0,
                       kv_col, DENSE, BLOCK_N, STAGES)),
        ], [4, 1], [240, 24])
    else:
        gl.warp_specialize([
            (_consumer, (q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, idx_row, count, N_Q, N_KV,
                         qk_scale, Out, Lse, R, RS, MS, bh, qb * (2 * half), idx_row, DENSE, 2 * half, BLOCK_N,
                         HEAD_D, STAGES, RESIDUAL, MASS, WRITE_LSE, 8, False)),
            (_loader, (k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, idx_row, count, kv_row0,
                       kv_col, DENSE, BLOCK_N, STAGES)),
        ], [1], [24])


@gluon.jit
def _row_of(r, IDX, CNT, ORDER, H, N_Q, N_KV, NQB, MAX_K, Q_BNHD: gl.constexpr, KV_BNHD: gl.constexpr,
            HEAD_D: gl.constexpr):
    """List row ``ORDER[r]`` of the persistent kernel: (head bh, query block qb, its tile count, its index row, the
    first Q row and column of its descriptor, the same for K/V)."""
    bh, qb, count, idx_row = _list_row(gl.load(ORDER + r), IDX, CNT, NQB, MAX_K)
    q_row0, q_col, kv_row0, kv_col = _origins(bh, H, N_Q, N_KV, Q_BNHD, KV_BNHD, HEAD_D)
    return bh, qb, count, idx_row, q_row0 + qb * 128, q_col, kv_row0, kv_col


@gluon.jit
def _persistent_loader(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, k_empty,
                       v_empty, IDX, CNT, ORDER, H, N_Q, N_KV, NQB, MAX_K, N_ROWS, Q_BNHD: gl.constexpr,
                       KV_BNHD: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr):
    """One warp, for every row this program takes (ORDER[pid], ORDER[pid + programs], ...): the row's first K/V tiles
    (as many as the ring holds: the slots free up while the consumers finish the previous row, which needs nothing
    more from here), then its query tile once both consumers released the last one (they do before their epilogue),
    then the rest of its tiles. The ring carries on across rows."""
    it = 0
    n = 0
    for r in range(gl.program_id(0), N_ROWS, gl.num_programs(0)):
        bh, qb, count, idx_row, q_row0, q_col, kv_row0, kv_col = _row_of(r, IDX, CNT, ORDER, H, N_Q, N_KV, NQB,
                                                                         MAX_K, Q_BNHD, KV_BNHD, HEAD_D)
        head = gl.minimum(count, STAGES)
        _loader(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, idx_row, head, kv_row0, kv_col,
                False, BLOCK_N, STAGES, it, 0)
        mbarrier.wait(q_empty, (n & 1) ^ 1)
        mbarrier.expect(q_ready, q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row0, q_col], q_ready, q_smem)
        _loader(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, idx_row, count, kv_row0, kv_col,
                False, BLOCK_N, STAGES, it, head)
        it += count
        n += 1


@gluon.jit
def _persistent_consumer(q_smem, q_ready, q_empty, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, IDX, CNT,
                         ORDER, H, N_Q, N_KV, NQB, MAX_K, N_ROWS, qk_scale, Out, Lse, R, RS, MS, half,
                         Q_BNHD: gl.constexpr, KV_BNHD: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                         STAGES: gl.constexpr, RESIDUAL: gl.constexpr, MASS: gl.constexpr, WRITE_LSE: gl.constexpr):
    """One warpgroup, 64 query rows (``half``: 0 or 64 into the tile) of every row the loader takes, in its order:
    waits for the row's Q, attends its tiles, releases Q, then stores."""
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    it = 0
    n = 0
    for r in range(gl.program_id(0), N_ROWS, gl.num_programs(0)):
        bh, qb, count, idx_row, q_row0, q_col, kv_row0, kv_col = _row_of(r, IDX, CNT, ORDER, H, N_Q, N_KV, NQB,
                                                                         MAX_K, Q_BNHD, KV_BNHD, HEAD_D)
        mbarrier.wait(q_ready, n & 1)
        acc, m_i, l_i = _attend(q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, idx_row, count, N_KV,
                                qk_scale, it, False, 64, BLOCK_N, HEAD_D, STAGES, 4, False)
        mbarrier.arrive(q_empty, count=1)
        _epilogue(acc, m_i, l_i, Out, Lse, R, RS, MS, bh, qb * 128 + half, N_Q, idx_row, o_layout, 64, HEAD_D,
                  RESIDUAL, MASS, WRITE_LSE, False)
        it += count
        n += 1


@gluon.jit
def _attention_persistent(q_desc, k_desc, v_desc, Out, Lse, R, RS, MS, IDX, CNT, ORDER, H, N_Q, N_KV, NQB, MAX_K,
                          N_ROWS, qk_scale, Q_BNHD: gl.constexpr, KV_BNHD: gl.constexpr, BLOCK_N: gl.constexpr,
                          HEAD_D: gl.constexpr, STAGES: gl.constexpr, RESIDUAL: gl.constexpr, MASS: gl.constexpr,
                          WRITE_LSE: gl.constexpr):
    """Block-sparse, persistent: a grid of (at most) one program per SM walks the B*H*NQB list rows in ORDER
    (heaviest first), each program taking every programs-th row, with one K/V ring and one Q buffer for all its rows:
    the next row's loads overlap this row's epilogue, and no program waits to be scheduled behind a heavy row. Same
    layouts and epilogue as ``_attention_fwd``."""
    half: gl.constexpr = 64
    q_smem, k_bufs, v_bufs, q_ready, k_ready, v_ready, k_empty, v_empty = _ring(q_desc, k_desc, v_desc, BLOCK_N,
                                                                                HEAD_D, STAGES, 2)
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_empty, count=2)  # both consumers release the query tile
    fence_async_shared()
    gl.warp_specialize([
        (_persistent_consumer, (q_smem.slice(0, half), q_ready, q_empty, k_bufs, v_bufs, k_ready, v_ready, k_empty,
                                v_empty, IDX, CNT, ORDER, H, N_Q, N_KV, NQB, MAX_K, N_ROWS, qk_scale, Out, Lse, R, RS,
                                MS, 0, Q_BNHD, KV_BNHD, BLOCK_N, HEAD_D, STAGES, RESIDUAL, MASS, WRITE_LSE)),
        (_persistent_consumer, (q_smem.slice(half, half), q_ready, q_empty, k_bufs, v_bufs, k_ready, v_ready,
                                k_empty, v_empty, IDX, CNT, ORDER, H, N_Q, N_KV, NQB, MAX_K, N_ROWS, qk_scale, Out,
                                Lse, R, RS, MS, half, Q_BNHD, KV_BNHD, BLOCK_N, HEAD_D, STAGES, RESIDUAL, MASS,
                                WRITE_LSE)),
        (_persistent_loader, (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready,
                              k_empty, v_empty, IDX, CNT, ORDER, H, N_Q, N_KV, NQB, MAX_K, N_ROWS, Q_BNHD, KV_BNHD,
                              BLOCK_N, HEAD_D, STAGES)),
    ], [4, 1], [240, 24])


def _gl_dtype(dtype: torch.dtype):
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]


def residual_args(res, out: torch.Tensor):
    """(RESIDUAL mode, data, scale) for a kernel's epilogue from a checked residual pair or None: the data (B,H,N,D)
    and the fp32 (B,H,N,1) scale made contiguous (the epilogue indexes them as out's rows), ``out`` standing in for
    what is absent."""
    if res is None:
        return RES_NONE, out, out
    data, scale = res[0].contiguous(), res[1]
    return (RES_MODEL, data, out) if scale is None else (RES_FP8, data, scale.contiguous())


def as_rows(t: torch.Tensor):
    """(2-D row view, BNHD flag) of a (B, H, N, D) tensor for a TMA descriptor: a contiguous tensor as (B*H*N, D), a
    transposed (B, N, H, D)-contiguous one as (B*N, H*D); anything else copied contiguous first (the automatic choice
    leaves such calls to the TMA kernels: kernels/_hopper.py, ``gluon_problem``)."""
    b, h, n, d = t.shape
    layout = rows_layout(t)
    if layout == "bhnd":
        return t.view(b * h * n, d), False
    if layout == "bnhd":
        return t.transpose(1, 2).view(b * n, h * d), True
    return t.contiguous().view(b * h * n, d), False


def _descriptor(rows: torch.Tensor, block_rows: int, d: int):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    layout = gl.NVMMASharedLayout.get_default_for([block_rows, d], _gl_dtype(rows.dtype))
    return TensorDescriptor(rows, list(rows.shape), [rows.stride(0), 1], [block_rows, d], layout)


def descriptors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bn: int):
    """(q, k, v TMA descriptors, q's BNHD flag, k/v's BNHD flag) of (B,H,N,D) q and k/v for 128-row query tiles and
    ``bn``-row K/V tiles (``as_rows``; k and v in different layouts: the two copied contiguous, one flag for both)."""
    b, h, nk, d = k.shape
    q_rows, q_bnhd = as_rows(q)
    k_rows, k_bnhd = as_rows(k)
    v_rows, v_bnhd = as_rows(v)
    if k_bnhd != v_bnhd:
        k_rows, v_rows = k.contiguous().view(b * h * nk, d), v.contiguous().view(b * h * nk, d)
        k_bnhd = False
    return (_descriptor(q_rows, BLOCK_M, d), _descriptor(k_rows, bn, d), _descriptor(v_rows, bn, d), q_bnhd,
            k_bnhd)


def attention(q, k, v, out, *, scale, block_k=128, idx=None, cnt=None, order=None, lse=None, res=None, mass=None,
              tiles=None, split=True, persistent=False):
    """Launch the kernel. q: (B,H,Nq,D), k/v: (B,H,Nk,D) fp16/bf16, D 64 or 128 (kernels/_hopper.py checks);
    out: contiguous (B,H,Nq,D) in q's dtype, written. Dense when ``idx`` is None; else block-sparse over int32
    contiguous lists idx (B,H,ceil(Nq/128),max_k) / cnt (B,H,ceil(Nq/128)) of 128 x ``block_k`` blocks, rows in
    ``order`` (int32 (B*H*nqb,) or None). lse: contiguous fp32 (B,H,Nq), written, or None. res: a checked residual
    (data (B,H,Nq,D) in q's dtype with scale None, or float8_e4m3fn data with fp32 (B,H,Nq,1) scale) added in the
    epilogue; mass: fp32 (B,H,Nq,2), weights it (kernels/_residual.py). tiles: (BLOCK_N, STAGES) instead of
    TILES[block_k] (BLOCK_N = block_k for block lists), and split False for one 8-warp consumer: the other
    configurations bench/gluon_attention.py times. persistent (block-sparse only): ``_attention_persistent``, one
    program per SM walking the rows in ``order`` (index order when None). Returns out."""
    b, h, nq, d = q.shape
    nk = k.shape[2]
    dense = idx is None
    if persistent and (dense or not split):
        raise ValueError("the persistent kernel takes block-sparse lists on the split layout only")
    bn, stages = tiles or TILES[block_k]
    q_desc, k_desc, v_desc, q_bnhd, k_bnhd = descriptors(q, k, v, bn)
    residual, r_data, r_scale = residual_args(res, out)
    nqb = triton.cdiv(nq, BLOCK_M)
    # what both kernels take first: the descriptors and the epilogue's tensors (out where one is absent)
    head = (q_desc, k_desc, v_desc, out, lse if lse is not None else out, r_data, r_scale,
            mass if mass is not None else out)
    flags = dict(Q_BNHD=q_bnhd, KV_BNHD=k_bnhd, BLOCK_N=bn, HEAD_D=d, STAGES=stages, RESIDUAL=residual,
                 MASS=mass is not None and res is not None, WRITE_LSE=lse is not None)
    if persistent:
        n_rows = b * h * nqb
        if order is None:
            order = torch.arange(n_rows, dtype=torch.int32, device=q.device)
        _attention_persistent[(min(n_rows, num_sms(q.device)),)](
            *head, idx, cnt, order, h, nq, nk, nqb, idx.shape[-1], n_rows, scale * LOG2E, **flags, num_warps=4)
        return out
    if dense:
        grid = (nqb, b * h)
        idx = cnt = order = out
        max_k = 1
    else:
        grid = (b * h * nqb,)
        max_k = idx.shape[-1]
    _attention_fwd[grid](*head, idx, cnt, order if order is not None else out, h, nq, nk, nqb, max_k, scale * LOG2E,
                         DENSE=dense, ORDERED=order is not None and not dense, SPLIT=split, **flags,
                         num_warps=4 if split else 8)
    return out
