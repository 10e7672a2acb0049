"""The block anchor in one pass of the Gluon kernel (kernels/attention_gluon.py): dense output, its LSE, and the
residual R = dense - block-sparse with the mass, for Hopper; twin ``anchor_torch.block_anchor_attention``.

Why: an anchor of a block selection needs the dense output (returned to the model) and R over the selected blocks.
Composed (one dense call, then the block-sparse walk forming R in its epilogue) it costs a dense call plus a sparse
call, 1.08x a cuDNN dense call at density 0.08 and 1.14x at 0.15 (docs/benchmarks.md, "A Hopper kernel in Gluon");
the TMA kernels' fused pass runs at their dense rate, 0.91 of cuDNN's (docs/kernel_notes.md, "v16"). Here each query
block walks its selected KV blocks first, the sparse output is then stored (rounded to the model's dtype) in the
program's own rows of Out and its LSE kept in registers, and the same online-softmax state walks on over the
complement blocks: the dense output at the Gluon kernel's dense rate plus one store and one load of the rows
(docs/kernel_notes.md, "v29"). One accumulator stays live, as in the dense kernel, so the register budget is the
dense kernel's.

The loader walks the row's selected list, then its complement list (``attention_hopper.complement_lists``) into one
ring; both consumers (64 query rows each) finish their rows themselves: the stash is read back by the threads that
wrote it (the same layout and offsets), so no barrier is needed between the store and the load. R is formed from both
outputs rounded to Out's dtype, as the twin forms it; fp8 with a per-row scale amax / 448 over the row's finite values
(1 for all-zero rows), a non-finite element NaN in its own element; the mass (log Z_C, log beta) from the two LSEs
(kernels/_residual.py, ``mass_of``).

Called through ``anchor_triton.block_anchor_attention(path="gluon")``, which checks the arguments, builds the lists and
the output buffers the TMA anchor takes too, and launches ``anchor`` here; imported only where kernels/_hopper.py
(``gluon_problem``, kind "gluon_anchor") finds nothing against it.
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from ._residual import FP8, FP8_MAX
from ._triton_common import LOG2E
from .attention_gluon import BLOCK_M, TILES, _attend, _attend_more, _finish, _list_row, _loader, _origins, _ring, \
    descriptors

FP8_LIMIT = gl.constexpr(FP8_MAX)


@gluon.jit
def _anchor_loader(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, sel_row, n_sel, cmp_row, n_cmp,
                   kv_row0, kv_col, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """One warp: the row's selected tiles, then its complement's, into one ring (the complement's tile i is the
    ring's tile n_sel + i)."""
    _loader(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, sel_row, n_sel, kv_row0, kv_col,
            False, BLOCK_N, STAGES)
    _loader(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, cmp_row, n_cmp, kv_row0, kv_col,
            False, BLOCK_N, STAGES, n_sel)


@gluon.jit
def _anchor_consumer(q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, sel_row, n_sel, cmp_row, n_cmp,
                     n_q, n_kv, qk_scale, Out, Lse, R, RS, MS, bh, q_first,
                     ROWS: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
                     FP8_OUT: gl.constexpr, MASS: gl.constexpr, WRITE_LSE: gl.constexpr):
    """One warpgroup, ROWS query rows (rows q_first ... of head bh): the selected walk, the sparse output stashed in
    Out, the complement walk on from the same state, then the dense output, LSE, R (and its scale) and the mass.
    Out/R contiguous (B*H*N_Q, D); Lse/RS (B*H*N_Q); MS (B*H*N_Q, 2)."""
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    acc, m_i, l_i = _attend(q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, sel_row, n_sel, n_kv,
                            qk_scale, 0, False, ROWS, BLOCK_N, HEAD_D, STAGES, 4, False)
    sparse, lse_s, flat, offs, ok, ok2 = _finish(acc, m_i, l_i, bh, q_first, n_q, q_first, o_layout, ROWS, HEAD_D,
                                                 False)
    gl.store(Out + offs, sparse.to(Out.dtype.element_ty), mask=ok2)
    acc, m_i, l_i = _attend_more(q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, cmp_row, n_cmp, n_kv,
                                 qk_scale, n_sel, acc, m_i, l_i, False, ROWS, BLOCK_N, HEAD_D, STAGES, 4, False, True)
    dense, lse, flat, offs, ok, ok2 = _finish(acc, m_i, l_i, bh, q_first, n_q, q_first, o_layout, ROWS, HEAD_D,
                                              False)
    dense = dense.to(Out.dtype.element_ty)
    # this thread's own stores above, read back in program order: R from both outputs rounded to Out's dtype
    r = dense.to(gl.float32) - gl.load(Out + offs, mask=ok2, other=0.0).to(gl.float32)
    gl.store(Out + offs, dense, mask=ok2)
    if WRITE_LSE:
        gl.store(Lse + flat, lse, mask=ok)
    if FP8_OUT:
        finite = gl.abs(r) < float("inf")
        s = gl.max(gl.where(finite, gl.abs(r), 0.0), 1) / FP8_LIMIT
        s = gl.where(s > 0, s, 1.0)
        gl.store(RS + flat, s, mask=ok)
        # NaN where not finite: the GPU's cast saturates an inf to the largest finite value
        r = gl.where(finite, r / gl.expand_dims(s, 1), float("nan"))
    gl.store(R + offs, r.to(R.dtype.element_ty), mask=ok2)
    if MASS:  # kernels/_residual.py, mass_of
        beta = gl.minimum(gl.maximum(1.0 - gl.exp(lse_s - lse), 0.0), 1.0)
        log_beta = gl.log(beta)
        gl.store(MS + flat * 2, lse + log_beta, mask=ok)
        gl.store(MS + flat * 2 + 1, log_beta, mask=ok)


@gluon.jit
def _anchor_fwd(q_desc, k_desc, v_desc, Out, Lse, R, RS, MS, IDX, CNT, CIDX, CCNT, H, N_Q, N_KV, NQB, MAX_K, MAX_C,
                qk_scale, Q_BNHD: gl.constexpr, KV_BNHD: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                STAGES: gl.constexpr, FP8_OUT: gl.constexpr, MASS: gl.constexpr, WRITE_LSE: gl.constexpr):
    """A 1-D grid over the B*H*NQB list rows in natural order (every row walks all its blocks, and neighbours share K/V
    in L2): the query tile, then two consumers of 64 rows and the loader (``_attention_fwd``'s split layout)."""
    row = gl.program_id(0)
    bh, qb, n_sel, sel_row = _list_row(row, IDX, CNT, NQB, MAX_K)
    n_cmp = gl.load(CCNT + row)
    cmp_row = CIDX + row.to(gl.int64) * MAX_C
    q_row0, q_col, kv_row0, kv_col = _origins(bh, H, N_Q, N_KV, Q_BNHD, KV_BNHD, HEAD_D)
    half: gl.constexpr = 64
    q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, k_empty, v_empty = _ring(q_desc, k_desc, v_desc, BLOCK_N,
                                                                              HEAD_D, STAGES, 2)
    fence_async_shared()
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row0 + qb * (2 * half), q_col], q_bar, q_smem)
    mbarrier.wait(q_bar, 0)
    gl.warp_specialize([
        (_anchor_consumer, (q_smem.slice(0, half), k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, sel_row, n_sel,
                            cmp_row, n_cmp, N_Q, N_KV, qk_scale, Out, Lse, R, RS, MS, bh, qb * (2 * half), half,
                            BLOCK_N, HEAD_D, STAGES, FP8_OUT, MASS, WRITE_LSE)),
        (_anchor_consumer, (q_smem.slice(half, half), k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, sel_row,
                            n_sel, cmp_row, n_cmp, N_Q, N_KV, qk_scale, Out, Lse, R, RS, MS, bh,
                            qb * (2 * half) + half, half, BLOCK_N, HEAD_D, STAGES, FP8_OUT, MASS, WRITE_LSE)),
        (_anchor_loader, (k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, sel_row, n_sel, cmp_row,
                          n_cmp, kv_row0, kv_col, BLOCK_N, STAGES)),
    ], [4, 1], [240, 24])


def anchor(q, k, v, idx, cnt, cmp_idx, cmp_cnt, out, r_data, *, scale, block_k=128, lse=None, r_scale=None,
           mass=None):
    """Launch the fused anchor. q: (B,H,Nq,D), k/v: (B,H,Nk,D) fp16/bf16, D 64 or 128 (kernels/_hopper.py checks);
    idx / cnt: int32 contiguous selected lists (B,H,ceil(Nq/128),max_k) / counts (B,H,ceil(Nq/128)) of 128 x
    ``block_k`` blocks; cmp_idx / cmp_cnt: their complements, int32 contiguous (B,H,ceil(Nq/128),max_c) / (B,H,
    ceil(Nq/128)). Written: out, contiguous (B,H,Nq,D) in q's dtype (the dense output); r_data, contiguous (B,H,Nq,D)
    in q's dtype or float8_e4m3fn (R = dense - sparse); r_scale, fp32 contiguous (B,H,Nq,1), with fp8 r_data only;
    lse, fp32 contiguous (B,H,Nq) (natural log) or None; mass, fp32 contiguous (B,H,Nq,2) or None. Returns out."""
    b, h, nq, d = q.shape
    bn, stages = TILES[block_k]
    q_desc, k_desc, v_desc, q_bnhd, k_bnhd = descriptors(q, k, v, bn)
    fp8 = FP8 is not None and r_data.dtype == FP8
    if fp8 != (r_scale is not None):
        raise ValueError("r_scale goes with float8_e4m3fn r_data, and only with it")
    nqb = triton.cdiv(nq, BLOCK_M)
    _anchor_fwd[(b * h * nqb,)](
        q_desc, k_desc, v_desc, out, lse if lse is not None else out, r_data, r_scale if fp8 else out,
        mass if mass is not None else out,
        idx, cnt, cmp_idx, cmp_cnt, h, nq, k.shape[2], nqb, idx.shape[-1], cmp_idx.shape[-1], scale * LOG2E,
        Q_BNHD=q_bnhd, KV_BNHD=k_bnhd, BLOCK_N=bn, HEAD_D=d, STAGES=stages, FP8_OUT=fp8, MASS=mass is not None,
        WRITE_LSE=lse is not None, num_warps=4)
    return out
