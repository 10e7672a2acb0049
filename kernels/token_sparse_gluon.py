"""Token-sparse (gathered-KV) attention for Hopper in Gluon, scheduled like kernels/attention_gluon.py; twin
``token_sparse_torch.token_sparse_attention`` (and ``_compact``).

Why: the Triton token kernel (kernels/token_sparse_triton.py) loads its gathered K/V rows by pointer inside the
softmax loop and ran at 0.71-0.83/d of cuDNN's dense rate at D 128 in this kernel's runs (docs/benchmarks.md);
Hopper's TMA cannot gather rows, so the block-sparse kernels' lever (TMA plus a warp-specialised schedule,
docs/kernel_notes.md "v17") needs another loader. Here a loader partition of four warps gathers each tile's K and V
rows with cp.async (16-byte copies) into the same ring of swizzled buffers the block kernel's TMA fills, and signals
each slot with a per-thread cp.async arrival on its "ready" barrier; the two consumer warpgroups are the block
kernel's (``attention_gluon._consumer`` with GATHER: a proxy fence after each wait, because cp.async writes through
the generic proxy and the tensor cores read through the async one). On the H100 at D 128 and d 0.15 it ran at
0.78-0.88/d, 6-17 % faster than the pointer kernel in 7 of 8 timings (equal in the eighth), and the engine's reuse
call (compact lists, fp8 residual) 8-18 % faster (docs/benchmarks.md, "Token-sparse in Gluon"); at D 64 the pointer
kernel stays the faster one and keeps the automatic choice.

A program is one query group of 128 (the engine's default ``group_size``; 64 stays on the Triton kernel): its rows
are gathered by pointer into shared memory first, and stored back at their own positions with the residual (model
dtype or fp8 with its row scale) added in the epilogue. The list's ragged tail reads row 0 of the head in its unused
slots (their scores are masked to -inf, so they weigh exactly 0). Lists are int32 token ids (B,H,G,max_k) or the
engine's compact int16 lists with their segment ends (kernels/compact_torch.py), decoded by the loader.

kernels/_hopper.py (``gluon_problem`` with kind "gluon_token") says when this kernel may run; it is imported only from
token_sparse_triton.py's launch, so a Triton without Gluon costs nothing. No interpreter runs Gluon:
tests/test_gluon_kernels.py compiles its variants for sm_90a on the CPU and tests/test_gpu_kernels.py checks it
against the twin.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from ._triton_common import LOG2E
from ._hopper import num_sms
from .attention_gluon import _attend, _consumer, _epilogue, residual_args

GROUP = gl.constexpr(128)  # queries of a program: two consumer warpgroups of 64
# The register file (Triton's warp-group allocation): the loader's partition is padded to a warpgroup, and the first
# consumer (the default partition) gets what the second one and the loader's warpgroup leave of 3 x 168 registers a
# thread. (loader warps, loader registers, second consumer's registers): four loader warps at 72 registers, the
# consumers at 224 / 208. The loader holds the next tile's ids across its waits; Triton 3.6 (the device's) spills
# nothing with int32 lists and 40 bytes with compact ones at 128-wide tiles, Triton 3.8 24-184 bytes; fewer loader
# registers spill the copy addresses, consumers at 200 spill in the epilogue (docs/kernel_notes.md "v18"). Eight
# loader warps at 40 registers measured up to 6 % slower (once 0.3 % faster).
LOADER = (4, 72, 208)
# The persistent kernel's loader carries its row's state (head, ring position, counts) across the rows as well: at 72
# registers it spilled 384 bytes with compact lists on Triton 3.8's compile, at 104 (consumers at 200 / 200) 0-32
# bytes, the least of the splits tried (tests/test_gluon_kernels.py keeps the bound).
PERSISTENT_LOADER = (4, 104, 200)
# (BLOCK_N, STAGES) by head dim. D 128: 128-wide tiles three deep (Q 32 KB + 3 x 2 x 32 KB), timed fastest on the
# H100 against 64-wide tiles six or four deep (docs/benchmarks.md, "Token-sparse in Gluon"); D 64 (explicit calls
# only): 128-wide tiles six deep (Q 16 KB + 6 x 2 x 16 KB), faster there than 64-wide ones.
TILES = {128: (128, 3), 64: (128, 6)}
# by the kind of list ("int32" ids or "compact" int16 offsets): the loader's row offsets in 32 bits where they fit.
# Measured 5-16 % faster with int32 lists and 7-16 % slower with compact ones (the compiler then issues the list loads
# one after another); docs/kernel_notes.md "v24"
OFF32 = {"int32": True, "compact": False}


@gluon.jit
def _token_ids(tok_row, seg_row, slot, count, N_SEG: gl.constexpr, SEGMENT: gl.constexpr):
    """Token ids of list slots ``slot`` (kernels/token_sparse_triton.py, ``_token_ids``): int32 ids as they are
    (N_SEG 0) or compact int16 offsets decoded (offset + 32768 + SEGMENT x the row's segment ends at or below the
    slot); slots at or past ``count`` read token 0, a valid row whose scores the consumers mask."""
    ok = slot < count
    raw = gl.load(tok_row + slot, mask=ok, other=0)
    if N_SEG == 0:
        tok = raw
    else:
        tok = raw.to(gl.int32) + 32768
        for s in gl.static_range(N_SEG):
            end = gl.load(seg_row + s)
            tok += (slot >= end).to(gl.int32) * SEGMENT
    return gl.where(ok, tok, 0)


@gluon.jit
def _gather_loader(k_base, v_base, skn, svn, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, tok_row, seg_row,
                   count, N_SEG: gl.constexpr, SEGMENT: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                   STAGES: gl.constexpr, WARPS: gl.constexpr, OFF32: gl.constexpr):
    """WARPS warps: every tile of one list row into the ring (``_gather_tiles`` from tile 0)."""
    _gather_tiles(k_base, v_base, skn, svn, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, tok_row, seg_row,
                  count, 0, gl.cdiv(count, BLOCK_N), 0, N_SEG, SEGMENT, BLOCK_N, HEAD_D, STAGES, WARPS, OFF32)


@gluon.jit
def _gather_tiles(k_base, v_base, skn, svn, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, tok_row, seg_row,
                  count, first, stop, base, N_SEG: gl.constexpr, SEGMENT: gl.constexpr, BLOCK_N: gl.constexpr,
                  HEAD_D: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr, OFF32: gl.constexpr):
    """WARPS warps: tiles first ... stop - 1 of a list row of ``count`` tokens, K then V rows into the ring (tile i
    in slot (base + i) % STAGES; ``base``: the tiles the ring carried before this row, the persistent kernel's rows
    sharing one ring), one cp.async call per tile and tensor (16-byte copies, BLOCK_N x HEAD_D / (8 x 32 x WARPS) a
    thread); every thread's cp.async arrival (no increment) on the slot's ready barrier (initialised to the loader's
    thread count) completes it once all its copies landed. The next tile's token ids are loaded before this tile
    waits for its slots, so the list's latency is hidden behind them (loading them where they are used left the
    loader, not the tensor cores, setting the pace: docs/kernel_notes.md "v18"). OFF32: the rows' offsets from the
    head's base in 32 bits (the launch checks that they fit), which the loader's registers hold more cheaply
    (docs/kernel_notes.md "v24")."""
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (HEAD_D // 8), HEAD_D // 8], [WARPS, 1], [1, 0])
    rows: gl.constexpr = gl.SliceLayout(1, ld)
    cols = gl.expand_dims(gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, ld)), 0)
    slots = gl.arange(0, BLOCK_N, layout=rows)
    tok = _token_ids(tok_row, seg_row, first * BLOCK_N + slots, count, N_SEG, SEGMENT)
    for i in range(first, stop):
        s = (base + i) % STAGES
        ph = ((base + i) // STAGES) & 1
        nxt = _token_ids(tok_row, seg_row, (i + 1) * BLOCK_N + slots, count, N_SEG, SEGMENT)
        if OFF32:  # the products below in 32 bits
            row_off = gl.expand_dims(tok, 1)
        else:
            row_off = gl.expand_dims(tok.to(gl.int64), 1)
        mbarrier.wait(k_empty.index(s), ph ^ 1)
        async_copy.async_copy_global_to_shared(k_bufs.index(s), k_base + (row_off * skn + cols))
        async_copy.mbarrier_arrive(k_ready.index(s), increment_count=False)
        mbarrier.wait(v_empty.index(s), ph ^ 1)
        async_copy.async_copy_global_to_shared(v_bufs.index(s), v_base + (row_off * svn + cols))
        async_copy.mbarrier_arrive(v_ready.index(s), increment_count=False)
        tok = nxt


@gluon.jit
def _token_ring(Q, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr, LOADER_WARPS: gl.constexpr):
    """Shared memory of both token kernels: the group's query buffer [GROUP, HEAD_D], the K and V rings [STAGES,
    BLOCK_N, HEAD_D] (swizzled for wgmma) and the rings' barriers, initialised: "ready" completes with one cp.async
    arrival per loader thread, "empty" once both consumers released the slot."""
    dtype: gl.constexpr = Q.dtype.element_ty
    smem_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_D], dtype)
    q_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([GROUP, HEAD_D], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [GROUP, HEAD_D], q_l)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], smem_l)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], smem_l)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=LOADER_WARPS * 32)
        mbarrier.init(v_ready.index(s), count=LOADER_WARPS * 32)
        mbarrier.init(k_empty.index(s), count=2)
        mbarrier.init(v_empty.index(s), count=2)
    return q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty


@gluon.jit
def _token_fwd(Q, K, V, Out, R, RS, QG, TOK, CNT, SEG,
               sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, H, N_Q, G, MAX_K, qk_scale,
               HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, RESIDUAL: gl.constexpr,
               N_SEG: gl.constexpr, SEGMENT: gl.constexpr, LOADER_WARPS: gl.constexpr, LOADER_REGS: gl.constexpr,
               CONSUMER_REGS: gl.constexpr, OFF32: gl.constexpr):
    """Grid (G, B*H): group g of head bh. Q, K, V: (B,H,N,D) with these strides (D contiguous); Out and the residual
    R (RS its fp32 row scale) contiguous (B,H,N_Q,D); QG int32 (B*H*G, 128); TOK (B*H*G, MAX_K) int32 ids, or int16
    compact offsets with SEG int32 (B*H*G, N_SEG) segment ends; CNT int32 (B*H*G)."""
    gid = gl.program_id(0)
    bh = gl.program_id(1)
    row = bh.to(gl.int64) * G + gid
    b = (bh // H).to(gl.int64)
    h = (bh % H).to(gl.int64)
    count = gl.load(CNT + row)
    q_rows = QG + row * GROUP
    tok_row = TOK + row * MAX_K
    seg_row = SEG + row * N_SEG

    half: gl.constexpr = GROUP // 2
    q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty = _token_ring(Q, BLOCK_N, HEAD_D, STAGES, LOADER_WARPS)

    # the group's query rows (padding -1 reads zeros) into shared memory, by pointer: read once per program
    q_ld: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (HEAD_D // 8), HEAD_D // 8], [4, 1], [1, 0])
    qi = gl.load(q_rows + gl.arange(0, GROUP, layout=gl.SliceLayout(1, q_ld)))
    cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, q_ld))
    q_ptrs = Q + b * sqb + h * sqh + gl.expand_dims(gl.where(qi >= 0, qi, 0).to(gl.int64) * sqn, 1) \
        + gl.expand_dims(cols, 0)
    q_smem.store(gl.load(q_ptrs, mask=gl.expand_dims(qi >= 0, 1), other=0.0))
    fence_async_shared()

    n_tiles = gl.cdiv(count, BLOCK_N)
    gl.warp_specialize([
        (_consumer, (q_smem.slice(0, half), k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, tok_row, n_tiles,
                     N_Q, count, qk_scale, Out, Out, R, RS, RS, bh, 0, q_rows, True, half, BLOCK_N, HEAD_D,
                     STAGES, RESIDUAL, False, False, 4, True)),
        (_consumer, (q_smem.slice(half, half), k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, tok_row, n_tiles,
                     N_Q, count, qk_scale, Out, Out, R, RS, RS, bh, half, q_rows, True, half, BLOCK_N, HEAD_D,
                     STAGES, RESIDUAL, False, False, 4, True)),
        (_gather_loader, (K + b * skb + h * skh, V + b * svb + h * svh, skn, svn, k_bufs, v_bufs, k_ready, v_ready,
                          k_empty, v_empty, tok_row, seg_row, count, N_SEG, SEGMENT, BLOCK_N, HEAD_D, STAGES,
                          LOADER_WARPS, OFF32)),
    ], [4, LOADER_WARPS], [CONSUMER_REGS, LOADER_REGS])


@gluon.jit
def _gather_q(q_base, sqn, q_rows, q_smem, q_ready, HEAD_D: gl.constexpr, WARPS: gl.constexpr):
    """WARPS warps: a group's 128 query rows (q_rows, -1 for none: row 0 stands in, its output is never stored) into
    q_smem by cp.async, each thread's arrival (no increment) on q_ready once its copies landed."""
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (HEAD_D // 8), HEAD_D // 8], [WARPS, 1], [1, 0])
    qi = gl.load(q_rows + gl.arange(0, GROUP, layout=gl.SliceLayout(1, ld)))
    cols = gl.expand_dims(gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, ld)), 0)
    ptrs = q_base + (gl.expand_dims(gl.where(qi >= 0, qi, 0).to(gl.int64) * sqn, 1) + cols)
    async_copy.async_copy_global_to_shared(q_smem, ptrs)
    async_copy.mbarrier_arrive(q_ready, increment_count=False)


@gluon.jit
def _persistent_gather_loader(Q, K, V, sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, QG, TOK, CNT, SEG, H, G, MAX_K,
                              N_ROWS, q_smem, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
                              N_SEG: gl.constexpr, SEGMENT: gl.constexpr, BLOCK_N: gl.constexpr,
                              HEAD_D: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr,
                              OFF32: gl.constexpr):
    """WARPS warps, for every list row this program takes (pid, pid + programs, ...): the row's first tiles (as many
    as the ring holds: the slots free up while the consumers finish the previous row), then its query rows once both
    consumers released the last ones (they do before their epilogue), then the rest of its tiles. The ring carries
    on across rows, as in kernels/attention_gluon.py's persistent block kernel."""
    it = 0
    n = 0
    for row in range(gl.program_id(0), N_ROWS, gl.num_programs(0)):
        r = row.to(gl.int64)
        bh = row // G
        b = (bh // H).to(gl.int64)
        h = (bh % H).to(gl.int64)
        count = gl.load(CNT + r)
        tok_row = TOK + r * MAX_K
        seg_row = SEG + r * N_SEG
        k_base = K + b * skb + h * skh
        v_base = V + b * svb + h * svh
        n_tiles = gl.cdiv(count, BLOCK_N)
        head = gl.minimum(n_tiles, STAGES)
        _gather_tiles(k_base, v_base, skn, svn, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, tok_row,
                      seg_row, count, 0, head, it, N_SEG, SEGMENT, BLOCK_N, HEAD_D, STAGES, WARPS, OFF32)
        mbarrier.wait(q_empty, (n & 1) ^ 1)
        _gather_q(Q + b * sqb + h * sqh, sqn, QG + r * GROUP, q_smem, q_ready, HEAD_D, WARPS)
        _gather_tiles(k_base, v_base, skn, svn, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, tok_row,
                      seg_row, count, head, n_tiles, it, N_SEG, SEGMENT, BLOCK_N, HEAD_D, STAGES, WARPS, OFF32)
        it += n_tiles
        n += 1


@gluon.jit
def _persistent_token_consumer(q_smem, q_ready, q_empty, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, Out, R,
                               RS, QG, TOK, CNT, G, MAX_K, N_Q, N_ROWS, qk_scale, half, BLOCK_N: gl.constexpr,
                               HEAD_D: gl.constexpr, STAGES: gl.constexpr, RESIDUAL: gl.constexpr):
    """One warpgroup, 64 query rows (``half``: 0 or 64 into the group) of every row the loader takes, in its order:
    waits for the row's queries (a proxy fence after the wait: cp.async wrote them), attends its tiles, releases
    the queries, then stores at the rows' own positions with the residual."""
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    it = 0
    n = 0
    for row in range(gl.program_id(0), N_ROWS, gl.num_programs(0)):
        r = row.to(gl.int64)
        count = gl.load(CNT + r)
        n_tiles = gl.cdiv(count, BLOCK_N)
        mbarrier.wait(q_ready, n & 1)
        fence_async_shared()
        acc, m_i, l_i = _attend(q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, TOK + r * MAX_K, n_tiles,
                                count, qk_scale, it, True, 64, BLOCK_N, HEAD_D, STAGES, 4, True)
        mbarrier.arrive(q_empty, count=1)
        _epilogue(acc, m_i, l_i, Out, Out, R, RS, RS, row // G, half, N_Q, QG + r * GROUP, o_layout, 64, HEAD_D,
                  RESIDUAL, False, False, True)
        it += n_tiles
        n += 1


@gluon.jit
def _token_persistent(Q, K, V, Out, R, RS, QG, TOK, CNT, SEG,
                      sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, H, N_Q, G, MAX_K, N_ROWS, qk_scale,
                      HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, RESIDUAL: gl.constexpr,
                      N_SEG: gl.constexpr, SEGMENT: gl.constexpr, LOADER_WARPS: gl.constexpr,
                      LOADER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr, OFF32: gl.constexpr):
    """``_token_fwd`` with a grid of (at most) one program per SM walking the B*H*G list rows (row = bh * G + g),
    each program taking every programs-th row with one K/V ring and one query buffer for all its rows: the next
    row's gathers overlap this row's last tiles and epilogue, where ``_token_fwd`` pays a program's start (the query
    gather, the ring's first tiles) and its epilogue with the tensor cores idle once a row. Same arguments plus
    N_ROWS = B*H*G."""
    half: gl.constexpr = GROUP // 2
    q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty = _token_ring(Q, BLOCK_N, HEAD_D, STAGES, LOADER_WARPS)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_ready = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    q_empty = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    mbarrier.init(q_ready, count=LOADER_WARPS * 32)
    mbarrier.init(q_empty, count=2)
    fence_async_shared()
    gl.warp_specialize([
        (_persistent_token_consumer, (q_smem.slice(0, half), q_ready, q_empty, k_bufs, v_bufs, k_ready, v_ready,
                                      k_empty, v_empty, Out, R, RS, QG, TOK, CNT, G, MAX_K, N_Q, N_ROWS, qk_scale, 0,
                                      BLOCK_N, HEAD_D, STAGES, RESIDUAL)),
        (_persistent_token_consumer, (q_smem.slice(half, half), q_ready, q_empty, k_bufs, v_bufs, k_ready, v_ready,
                                      k_empty, v_empty, Out, R, RS, QG, TOK, CNT, G, MAX_K, N_Q, N_ROWS, qk_scale,
                                      half, BLOCK_N, HEAD_D, STAGES, RESIDUAL)),
        (_persistent_gather_loader, (Q, K, V, sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, QG, TOK, CNT, SEG, H, G,
                                     MAX_K, N_ROWS, q_smem, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready,
                                     k_empty, v_empty, N_SEG, SEGMENT, BLOCK_N, HEAD_D, STAGES, LOADER_WARPS,
                                     OFF32)),
    ], [4, LOADER_WARPS], [CONSUMER_REGS, LOADER_REGS])


def offsets_fit_32(k, v) -> bool:
    """Whether every K and V row's offset from its head's start, plus a row, fits 32 bits signed (k, v: (B,H,N,D)
    views; their strides in elements, as the kernel indexes)."""
    return all((t.shape[2] - 1) * t.stride(2) + t.shape[3] <= 2**31 - 1 for t in (k, v))


def attention(q, k, v, out, q_groups, lists, seg_ends, kv_counts, *, scale, segment, residual=None, tiles=None,
              off32=None, persistent=False):
    """Launch the kernel. q: (B,H,Nq,D), k/v: (B,H,Nk,D) fp16/bf16, D 64 or 128, the last dim contiguous; out:
    contiguous (B,H,Nq,D) in q's dtype, its grouped rows written. q_groups: int32 contiguous (B,H,G,128); lists:
    int32 (B,H,G,max_k) sorted token ids with seg_ends None, or the compact int16 (B,H,G,W) with int32 seg_ends
    (B,H,G,S) of ``segment``-token segments; kv_counts int32 (B,H,G); all contiguous. residual: None or a checked
    (data, scale) pair (made contiguous here, as the epilogue indexes it) ((B,H,Nq,D) in q's dtype with scale
    None, or float8_e4m3fn data with fp32 (B,H,Nq,1) scale), added in the epilogue. tiles: (BLOCK_N, STAGES)
    instead of TILES[D] (what the benchmark compares). off32: the loader's row offsets in 32 bits (None: as OFF32
    says for the kind of list, where they fit, ``offsets_fit_32``; True where they do not raises ValueError).
    persistent: ``_token_persistent``, one program per SM walking the list rows. Returns out."""
    fits = offsets_fit_32(k, v)
    if off32 and not fits:
        raise ValueError("token_sparse_gluon.attention: off32 with K/V rows beyond 32-bit offsets")
    off32 = OFF32["int32" if seg_ends is None else "compact"] and fits if off32 is None else bool(off32)
    b, h, nq, d = q.shape
    g = q_groups.shape[2]
    bn, stages = tiles or TILES[d]
    warps, regs, consumer_regs = PERSISTENT_LOADER if persistent else LOADER
    mode, r_data, r_scale = residual_args(residual, out)
    seg = kv_counts if seg_ends is None else seg_ends
    n_seg = 0 if seg_ends is None else seg_ends.shape[-1]
    args = (q, k, v, out, r_data, r_scale, q_groups, lists, kv_counts, seg, *q.stride()[:3], *k.stride()[:3],
            *v.stride()[:3], h, nq, g, max(1, lists.shape[-1]))
    flags = dict(HEAD_D=d, BLOCK_N=bn, STAGES=stages, RESIDUAL=mode, N_SEG=n_seg, SEGMENT=segment,
                 LOADER_WARPS=warps, LOADER_REGS=regs, CONSUMER_REGS=consumer_regs, OFF32=off32, num_warps=4)
    if persistent:
        n_rows = b * h * g
        _token_persistent[(min(n_rows, num_sms(q.device)),)](*args, n_rows, scale * LOG2E, **flags)
    else:
        _token_fwd[(g, b * h)](*args, scale * LOG2E, **flags)
    return out

