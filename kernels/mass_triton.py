"""Pass 2 of exact selection in Triton: per query group, the attention mass of every KV token.

mass[b,h,g,j] = sum_{i in group g} exp(scale * q_i . k_j - lse_i), with the row LSE from pass 1. One
program per (group, head) streams all KV tiles; scores never reach memory, only the (G, N) fp32 result.
Twin of ``selection_torch.group_kv_mass``.

The kernel is bound by the exponentials (one per score, as in attention, but with half its matmul work),
so it is written to spend as little as possible around them (docs/kernel_notes.md):

- transposed tiles: scores are computed as K . Q^T ([keys, queries]), so the per-key sum runs along a
  tile row (in-thread adds and two lane shuffles) instead of across warps through shared memory;
- part of the exponentials can run on the FMA pipe instead of the special-function unit: the group's
  queries are split into SPLIT column parts, and the last POLY of them use ``exp2_poly`` (Cody-Waite
  range reduction and a degree-4 polynomial, relative error 3e-6), so both units work at once;
- on Hopper, K tiles come through a TMA descriptor (the ragged last tile is zero-filled by the hardware).

Groups of 16 (mc_sparse's ``mass_queries``) run in ``_mass_packed_fwd``: 4 or 8 groups a program in one dot of 64 or
128 columns, each group's 16 columns summed after the exponentials, so one K tile read serves them all and the tensor
cores see a wide dot (pass 2 at Wan 14B 16.5-18.4 ms on an H100 against 29.0 for four 16-column dots a program;
docs/kernel_notes.md, "v22").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _hopper
from ._checks import triton_group_problem
from ._triton_common import LOG2E, head_dim_pad, last_dim_contiguous, load_rows, pick, seq_bucket, tune_options
from .selection_torch import check_mass_args


def _cfg(bn, w, s, split=1, poly=0):
    return triton.Config({"BLOCK_N": bn, "SPLIT": split, "POLY": poly}, num_warps=w, num_stages=s)


CONFIGS = [_cfg(64, 4, 3), _cfg(128, 8, 3), _cfg(64, 4, 3, 4, 1), _cfg(128, 8, 3, 4, 1), _cfg(64, 4, 3, 2, 1)]
INTERPRET_CONFIGS = [_cfg(32, 4, 1, 2, 1)]


def _packed_cfg(bn, w, pg, poly, s=3):
    return triton.Config({"BLOCK_N": bn, "PG": pg, "POLY": poly}, num_warps=w, num_stages=s)


MAX_PG = 8  # groups of 16 a program of _mass_packed_fwd may take: the group count is padded to a multiple of it
# the first measured fastest at Wan 14B on an H100 (16.5 ms; 17.5-21.6 for the other tl.exp2 ones, 24.2 for the
# polynomial half, kernel_notes "v22"); the polynomial half is kept for GPUs whose special-function unit is the
# narrower pipe
PACKED_CONFIGS = [_packed_cfg(64, 4, 8, 0), _packed_cfg(64, 4, 4, 0), _packed_cfg(128, 8, 8, 0),
                  _packed_cfg(128, 8, 4, 0), _packed_cfg(64, 4, 4, 1)]
INTERPRET_PACKED_CONFIGS = [_packed_cfg(32, 4, 4, 1)]
# the grid is G_PAD // PG with G_PAD a multiple of MAX_PG: a PG that does not divide it would drop groups
assert all(MAX_PG % c.kwargs["PG"] == 0 for c in PACKED_CONFIGS + INTERPRET_PACKED_CONFIGS)


def _prune(configs_, named_args, **kwargs):
    """Parts are at least 16 queries wide (the smallest dot tile)."""
    group = kwargs.get("GROUP", named_args.get("GROUP"))
    kept = [c for c in configs_ if group // c.kwargs["SPLIT"] >= 16]
    first = configs_[0]
    return kept or [triton.Config({**first.kwargs, "SPLIT": 1, "POLY": 0}, num_warps=first.num_warps,
                                  num_stages=first.num_stages)]


@triton.jit
def exp2_poly(x):
    """2**x for fp32 x <= 0 on the FMA pipe: x = j + f with j = round(x) taken from the mantissa of
    x + 1.5 * 2**23, 2**f by a degree-4 polynomial on [-0.5, 0.5], j added to the exponent bits. Below
    -125 the result is 0 (a true 2**x there is below 3e-38)."""
    xc = tl.maximum(x, -125.0)
    t = xc + 12582912.0
    f = xc - (t - 12582912.0)
    p = 0.009560510206479118 * f + 0.05591703917486793
    p = p * f + 0.24024981109537327
    p = p * f + 0.693121967696061
    p = p * f + 0.9999991908565828
    bits = p.to(tl.int32, bitcast=True) + (t.to(tl.int32, bitcast=True) << 23)
    return tl.where(x < -125.0, 0.0, bits.to(tl.float32, bitcast=True))


@triton.jit
def _load_part(QG, Q, LSE, row, pid_bh, b, h, sqb, sqh, sqn, N_Q, d, part: tl.constexpr,
               HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr, SPLIT: tl.constexpr):
    """Queries [GROUP // SPLIT, D_PAD] of column part ``part`` and their base-2 LSE (+inf for padded
    slots and empty rows, so they contribute nothing)."""
    GP: tl.constexpr = GROUP // SPLIT
    qi = tl.load(QG + row * GROUP + part * GP + tl.arange(0, GP))
    q_ok = qi >= 0
    qi = tl.where(q_ok, qi, 0)
    q = load_rows(Q + b * sqb + h * sqh, qi, sqn, q_ok, d, HEAD_DIM, D_PAD, True)
    lse2 = tl.load(LSE + pid_bh.to(tl.int64) * N_Q + qi, mask=q_ok, other=float("inf")) * 1.4426950408889634
    return q, tl.where(lse2 == float("-inf"), float("inf"), lse2)


@triton.jit
def _part_mass(k, q, lse2, qk_scale, POLY: tl.constexpr):
    """Per-key mass [BLOCK_N] of one query part: scores as K . Q^T so the sum runs along tile rows."""
    x = tl.dot(k, tl.trans(q)) * qk_scale - lse2[None, :]
    if POLY:
        p = exp2_poly(x)
    else:
        p = tl.exp2(x)
    return tl.sum(p, 1)


@triton.jit
def _tile_mass(k, q0, l0, q1, l1, q2, l2, q3, l3, qk_scale, SPLIT: tl.constexpr, POLY: tl.constexpr):
    """Mass of one K tile over all parts; part j uses the polynomial when j >= SPLIT - POLY."""
    m = _part_mass(k, q0, l0, qk_scale, SPLIT - POLY <= 0)
    if SPLIT >= 2:
        m += _part_mass(k, q1, l1, qk_scale, SPLIT - POLY <= 1)
    if SPLIT == 4:
        m += _part_mass(k, q2, l2, qk_scale, SPLIT - POLY <= 2)
        m += _part_mass(k, q3, l3, qk_scale, SPLIT - POLY <= 3)
    return m


@triton.jit
def _store(ptr, m, n_ok, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr, m, mask=n_ok)
    else:
        tl.store(ptr, m)


@triton.jit
def _emit(out_base, offs_n, n_ok, k, q0, l0, q1, l1, q2, l2, q3, l3, qk_scale,
          SPLIT: tl.constexpr, POLY: tl.constexpr, MASKED: tl.constexpr):
    """Store one K tile's mass, the parts summed into the group's row. MASKED: the ragged last tile (keys from
    ``n_ok``)."""
    _store(out_base + offs_n, _tile_mass(k, q0, l0, q1, l1, q2, l2, q3, l3, qk_scale, SPLIT, POLY), n_ok, MASKED)


@triton.autotune(configs=pick(CONFIGS, INTERPRET_CONFIGS), key=["N_BUCKET", "HEAD_DIM", "GROUP", "USE_TMA"],
                 prune_configs_by={"early_config_prune": _prune}, **tune_options())
@triton.heuristics({"EVEN_N": lambda a: a["N_KV"] % a["BLOCK_N"] == 0})
@triton.jit
def _mass_fwd(Q, K, LSE, QG, OUT,
              sqb, sqh, sqn, skb, skh, skn,
              H, N_Q, N_KV, G, qk_scale, N_BUCKET,
              HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr, USE_TMA: tl.constexpr,
              BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, POLY: tl.constexpr,
              EVEN_N: tl.constexpr):
    gid = tl.program_id(0)
    pid_bh = tl.program_id(1)
    row = pid_bh.to(tl.int64) * G + gid
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    d = tl.arange(0, D_PAD)
    q0, l0 = _load_part(QG, Q, LSE, row, pid_bh, b, h, sqb, sqh, sqn, N_Q, d, 0, HEAD_DIM, D_PAD, GROUP, SPLIT)
    q1, l1 = q0, l0
    q2, l2 = q0, l0
    q3, l3 = q0, l0
    if SPLIT >= 2:
        q1, l1 = _load_part(QG, Q, LSE, row, pid_bh, b, h, sqb, sqh, sqn, N_Q, d, 1, HEAD_DIM, D_PAD, GROUP, SPLIT)
    if SPLIT == 4:
        q2, l2 = _load_part(QG, Q, LSE, row, pid_bh, b, h, sqb, sqh, sqn, N_Q, d, 2, HEAD_DIM, D_PAD, GROUP, SPLIT)
        q3, l3 = _load_part(QG, Q, LSE, row, pid_bh, b, h, sqb, sqh, sqn, N_Q, d, 3, HEAD_DIM, D_PAD, GROUP, SPLIT)
    k_base = K + b * skb + h * skh
    out_base = OUT + row * N_KV
    n_full = (N_KV // BLOCK_N) * BLOCK_N
    if USE_TMA:
        k_desc = tl.make_tensor_descriptor(k_base, shape=[N_KV, HEAD_DIM], strides=[skn, 1],
                                           block_shape=[BLOCK_N, D_PAD])
        for start in tl.range(0, n_full, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            _emit(out_base, offs_n, offs_n < N_KV, k_desc.load([start, 0]), q0, l0, q1, l1, q2, l2, q3, l3, qk_scale,
                  SPLIT, POLY, False)
        if not EVEN_N:  # zero-filled rows past N_KV are computed, not stored
            offs_n = n_full + tl.arange(0, BLOCK_N)
            _emit(out_base, offs_n, offs_n < N_KV, k_desc.load([n_full, 0]), q0, l0, q1, l1, q2, l2, q3, l3, qk_scale,
                  SPLIT, POLY, True)
    else:
        for start in tl.range(0, n_full, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            k = load_rows(k_base, offs_n, skn, offs_n < N_KV, d, HEAD_DIM, D_PAD, False)
            _emit(out_base, offs_n, offs_n < N_KV, k, q0, l0, q1, l1, q2, l2, q3, l3, qk_scale, SPLIT, POLY, False)
        if not EVEN_N:
            offs_n = n_full + tl.arange(0, BLOCK_N)
            n_ok = offs_n < N_KV
            k = load_rows(k_base, offs_n, skn, n_ok, d, HEAD_DIM, D_PAD, True)
            _emit(out_base, offs_n, n_ok, k, q0, l0, q1, l1, q2, l2, q3, l3, qk_scale, SPLIT, POLY, True)


@triton.jit
def _group_masses(k, q, lse2, qk_scale, BLOCK_N: tl.constexpr, NG: tl.constexpr, POLY: tl.constexpr):
    """Per-key mass of NG groups of 16 queries, q [NG * 16, D_PAD]: one dot for all of them (the tensor cores take
    N = NG * 16 at once, where a dot per group of 16 re-reads the K tile for every 16 columns), then the exponentials
    and each group's 16 columns summed -> [BLOCK_N, NG]."""
    x = tl.dot(k, tl.trans(q)) * qk_scale - lse2[None, :]
    if POLY:
        p = exp2_poly(x)
    else:
        p = tl.exp2(x)
    return tl.sum(tl.reshape(p, (BLOCK_N, NG, 16)), 2)


@triton.jit
def _emit_groups(out_rows, offs_n, n_ok, N_KV, k, qa, la, qb, lb, qk_scale, BLOCK_N: tl.constexpr,
                 NG: tl.constexpr, POLY: tl.constexpr, MASKED: tl.constexpr):
    """Store one K tile's mass of the program's groups, a row each (rows N_KV apart from ``out_rows``): the first NG
    groups by tl.exp2, the next NG (POLY) by exp2_poly, so the special-function and FMA pipes work at once."""
    j = tl.arange(0, NG)
    ptrs = out_rows + j[None, :] * N_KV + offs_n[:, None]
    _store(ptrs, _group_masses(k, qa, la, qk_scale, BLOCK_N, NG, False), n_ok[:, None], MASKED)
    if POLY:
        _store(ptrs + NG * N_KV, _group_masses(k, qb, lb, qk_scale, BLOCK_N, NG, True), n_ok[:, None], MASKED)


@triton.autotune(configs=pick(PACKED_CONFIGS, INTERPRET_PACKED_CONFIGS), key=["N_BUCKET", "HEAD_DIM", "USE_TMA"],
                 **tune_options())
@triton.heuristics({"EVEN_N": lambda a: a["N_KV"] % a["BLOCK_N"] == 0})
@triton.jit
def _mass_packed_fwd(Q, K, LSE, QG, OUT,
                     sqb, sqh, sqn, skb, skh, skn,
                     H, N_Q, N_KV, G_PAD, qk_scale, N_BUCKET,
                     HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, USE_TMA: tl.constexpr,
                     BLOCK_N: tl.constexpr, PG: tl.constexpr, POLY: tl.constexpr, EVEN_N: tl.constexpr):
    """Groups of 16 queries, PG of them a program (QG int32 (B*H, G_PAD * 16), G_PAD a multiple of MAX_PG; OUT fp32
    (B*H, G_PAD, N_KV)): one K tile read serves PG * 16 queries (docs/kernel_notes.md, "v22")."""
    pid = tl.program_id(0)
    pid_bh = tl.program_id(1)
    row = pid_bh.to(tl.int64) * (G_PAD // PG) + pid  # the program's PG * 16 query slots in QG
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    d = tl.arange(0, D_PAD)
    HALVES: tl.constexpr = 2 if POLY else 1
    NG: tl.constexpr = PG // HALVES
    qa, la = _load_part(QG, Q, LSE, row, pid_bh, b, h, sqb, sqh, sqn, N_Q, d, 0, HEAD_DIM, D_PAD, PG * 16, HALVES)
    qb, lb = qa, la
    if POLY:
        qb, lb = _load_part(QG, Q, LSE, row, pid_bh, b, h, sqb, sqh, sqn, N_Q, d, 1, HEAD_DIM, D_PAD, PG * 16, HALVES)
    k_base = K + b * skb + h * skh
    out_rows = OUT + (pid_bh.to(tl.int64) * G_PAD + pid * PG) * N_KV
    n_full = (N_KV // BLOCK_N) * BLOCK_N
    if USE_TMA:
        k_desc = tl.make_tensor_descriptor(k_base, shape=[N_KV, HEAD_DIM], strides=[skn, 1],
                                           block_shape=[BLOCK_N, D_PAD])
        for start in tl.range(0, n_full, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            _emit_groups(out_rows, offs_n, offs_n < N_KV, N_KV, k_desc.load([start, 0]), qa, la, qb, lb, qk_scale,
                         BLOCK_N, NG, POLY, False)
        if not EVEN_N:  # zero-filled rows past N_KV are computed, not stored
            offs_n = n_full + tl.arange(0, BLOCK_N)
            _emit_groups(out_rows, offs_n, offs_n < N_KV, N_KV, k_desc.load([n_full, 0]), qa, la, qb, lb, qk_scale,
                         BLOCK_N, NG, POLY, True)
    else:
        for start in tl.range(0, n_full, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            k = load_rows(k_base, offs_n, skn, offs_n < N_KV, d, HEAD_DIM, D_PAD, False)
            _emit_groups(out_rows, offs_n, offs_n < N_KV, N_KV, k, qa, la, qb, lb, qk_scale, BLOCK_N, NG, POLY, False)
        if not EVEN_N:
            offs_n = n_full + tl.arange(0, BLOCK_N)
            n_ok = offs_n < N_KV
            k = load_rows(k_base, offs_n, skn, n_ok, d, HEAD_DIM, D_PAD, True)
            _emit_groups(out_rows, offs_n, n_ok, N_KV, k, qa, la, qb, lb, qk_scale, BLOCK_N, NG, POLY, True)


PATHS = ("auto", "pointer", "tma")


def group_kv_mass(q, k, lse, q_groups, *, scale=None, validate=True, path="auto"):
    """Exact group KV mass on the Triton kernel; arguments as in the PyTorch twin.

    q: (B,H,Nq,D); k: (B,H,Nk,D); lse fp32 (B,H,Nq); q_groups int32 (B,H,G,C). Returns fp32 (B,H,G,Nk) (for groups
    of 16, C = 16, a view of the first G rows of a buffer padded to a multiple of MAX_PG groups).
    path: "auto" (K through TMA on Hopper when kernels/_hopper.py allows), "pointer" or "tma".
    """
    b, h, nq, nk, d, scale, g, c = check_mass_args(q, k, lse, q_groups, scale, validate)
    why = triton_group_problem(c)
    if why:
        raise ValueError(f"q_groups: {why}")
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    q, k = last_dim_contiguous(q, k)
    if g == 0:
        return torch.empty((b, h, 0, nk), dtype=torch.float32, device=q.device)
    auto = path == "auto"
    use_tma = _hopper.use_tma("mass", k) if auto else path == "tma"
    groups = q_groups.to(torch.int32).contiguous()
    pack = c == 16  # groups of 16 (mc_sparse's mass_queries): PG of them a program, one dot for all
    g_pad = -(-g // MAX_PG) * MAX_PG if pack else g
    if pack:  # the padding groups (-1) write rows past g, cut off below (docs/kernel_notes.md, "v22")
        groups = torch.nn.functional.pad(groups, (0, 0, 0, g_pad - g), value=-1)
    out = torch.empty((b, h, g_pad, nk), dtype=torch.float32, device=q.device)
    result = out[:, :, :g] if pack else out
    args = (q, k, lse.float().contiguous(), groups, out,
            *q.stride()[:3], *k.stride()[:3], h, nq, nk, g_pad, scale * LOG2E, seq_bucket(nk))
    if pack:
        kernel, meta = _mass_packed_fwd, dict(HEAD_DIM=d, D_PAD=head_dim_pad(d))

        def grid(m):
            return (g_pad // m["PG"], b * h)
    else:
        kernel, meta = _mass_fwd, dict(HEAD_DIM=d, D_PAD=head_dim_pad(d), GROUP=c)
        grid = (g, b * h)
    if use_tma:
        def launch():
            _hopper.set_allocator(q.device)
            kernel[grid](*args, USE_TMA=True, **meta)
            return result
        if _hopper.attempt("mass", auto, launch) is not None:
            return result
    kernel[grid](*args, USE_TMA=False, **meta)
    return result
