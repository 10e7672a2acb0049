"""Triton building blocks shared by the attention kernels: one online-softmax step and the epilogue.

Imported only when a Triton kernel is about to run (never at package import). Scores are kept in
base-2 units: ``s2 = (q . k) * scale * log2(e)``; LSE is returned in natural log.
"""

from __future__ import annotations

import inspect
import math
import os

import torch
import triton
import triton.language as tl

from ._residual import MASS_EPS
from .backend import cuda_capability, interpreting

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


# Lazy rescaling (docs/kernel_notes.md, "v5"): the running max is raised only when some row of the
# tile exceeds it by more than RESCALE_SLACK base-2 units, so most tiles skip the accumulator rescale (a multiply
# over the whole [M, D] accumulator) and the exp2 of the correction. The softmax is the same for any finite
# running max m (LSE = m + log2 l, out = acc / l); the slack only bounds the unraised p <= 2**RESCALE_SLACK = 256,
# so nothing overflows in the fp32 sums and bf16 / fp16 p keep their relative precision. Measured slower or equal
# on the H200, so eager is the default (docs/kernel_notes.md, "v5").
RESCALE_SLACK = tl.constexpr(8.0)
RESCALE_MODES = ("lazy", "eager")
DEFAULT_RESCALE = "eager"


# Scores one tile ahead (docs/kernel_notes.md, "v8"): the KV loops compute the next tile's scores q·kᵀ before folding
# the current tile into the softmax state, so the next tile's matmul is in flight while the current tile's
# exponentials run (on Hopper a dot whose result only feeds the next iteration is issued asynchronously). Same tiles
# in the same order: the same arithmetic as the plain loop. SPARSE_ATTN_LOOP chooses it at each launch.
LOOP_MODES = ("plain", "ahead")
DEFAULT_LOOP = "plain"


def loop_ahead() -> bool:
    """AHEAD constexpr of the TMA and token kernels: SPARSE_ATTN_LOOP=ahead|plain, else DEFAULT_LOOP (read at every
    launch, so a benchmark can time both in one process)."""
    mode = os.environ.get("SPARSE_ATTN_LOOP", "") or DEFAULT_LOOP
    if mode not in LOOP_MODES:
        raise ValueError(f"SPARSE_ATTN_LOOP must be one of {LOOP_MODES}, got {mode!r}")
    return mode == "ahead"


def lazy_rescale() -> bool:
    """LAZY constexpr of the kernels: SPARSE_ATTN_RESCALE=lazy|eager, else DEFAULT_RESCALE (read at every launch,
    so a benchmark can time both in one process)."""
    mode = os.environ.get("SPARSE_ATTN_RESCALE", "") or DEFAULT_RESCALE
    if mode not in RESCALE_MODES:
        raise ValueError(f"SPARSE_ATTN_RESCALE must be one of {RESCALE_MODES}, got {mode!r}")
    return mode == "lazy"


@triton.jit
def online_softmax_step(acc, m_i, l_i, qk, qk_scale, v, LAZY: tl.constexpr):
    """Fold one tile of raw scores ``qk`` [M, N] (-inf = skipped) and values ``v`` [N, D] into the state.

    Scores become base-2 logits ``qk * qk_scale`` (qk_scale = scale * log2 e > 0) inside one FMA with the
    max subtraction. acc: [M, D] fp32; m_i, l_i: [M] fp32 running max (base 2) and sum. Rows whose
    scores are all -inf so far keep m = -inf and l = 0 (no NaN: the max used for exp2 is guarded).
    LAZY: keep the running max while no row of the tile exceeds it by more than RESCALE_SLACK (one decision
    for the whole tile, a uniform branch), so the accumulator is rescaled only when the max really moves.
    """
    m_tile = tl.max(qk, 1) * qk_scale
    if LAZY:
        m_new = tl.maximum(m_i, m_tile)
        grow = tl.where(m_new > m_i, m_new - m_i, 0.0)  # inf where a row sees its first finite score
        if tl.max(grow, 0) > RESCALE_SLACK:
            m_up = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_up)
            l_i = l_i * alpha
            acc = acc * alpha[:, None]
            m_i = m_new
        m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
        p = tl.exp2(qk * qk_scale - m_use[:, None])
        l_i = l_i + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc)
    else:
        m_new = tl.maximum(m_i, m_tile)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(qk * qk_scale - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def finish(acc, m_i, l_i):
    """Epilogue: (out [M, D] fp32, lse [M] natural log). Empty rows give out 0 and lse -inf."""
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    return out, lse


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1), in plain Python: ``triton.next_power_of_2`` is a Triton function
    whose host call costs microseconds, and it runs at every launch of a host-bound reuse call."""
    return 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, in plain Python (``triton.cdiv``'s host call costs microseconds: ``next_pow2``)."""
    return -(-a // b)


def head_dim_pad(d: int) -> int:
    """Head dims are padded inside the kernel (not in memory) to the next power of two (80, 96 -> 128)."""
    return max(16, next_pow2(d))


def seq_bucket(n: int) -> int:
    """Autotune key bucket for a sequence length: next power of two, capped at 32768 (never one tuning
    per length; from 32k tokens on the best tiling no longer changes, so one tuning serves all long
    shapes and saves compile time)."""
    return min(next_pow2(max(1, n)), 32768)


LIST_BUCKET_CAP = 4096  # token lists of 4096 entries and more share one tuning (list_bucket)


def list_bucket(max_k: int) -> int:
    """Autotune key bucket for a token-list width: next power of two, capped at LIST_BUCKET_CAP. The width is the
    longest list of an anchor's selection, so it follows the data (the threshold of a long row is estimated from
    a sample: the longest row keeps well above its budget); uncapped, a later anchor whose longest list crossed a
    power of two re-tuned the kernel in the middle of a run — 9 s at Wan 14B (docs/benchmarks.md, "Stalls in the first
    reuse step"). Long lists run the same tile loop, and the tunings measured at 16k and 32k chose the same
    config."""
    return min(seq_bucket(max_k), LIST_BUCKET_CAP)


def tune_first() -> bool:
    """SPARSE_ATTN_TUNE=first: every autotuned kernel uses its first (default) config only; for test runs,
    which would otherwise compile every config of every specialisation they touch."""
    return os.environ.get("SPARSE_ATTN_TUNE", "") == "first"


def pick(candidates: list, interpret: list) -> list:
    """The autotune candidates to use: ``interpret`` under the interpreter, the first one under
    SPARSE_ATTN_TUNE=first, else all."""
    if interpreting():
        return interpret
    return candidates[:1] if tune_first() else candidates


def tune_bench(kernel_call, quantiles=None):
    """Autotuner timing for long kernels: one warm-up call (compiles), then timed calls until ~40 ms or
    25 calls, median. Triton's default spends ~8 calls per config even on a 200 ms kernel. Returns
    [median, min, max] as the autotuner expects."""
    kernel_call()
    torch.cuda.synchronize()
    times = []
    while len(times) < 25 and (len(times) < 2 or sum(times) < 40.0):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        kernel_call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return [times[len(times) // 2], times[0], times[-1]]


def configs(options: list[dict], interpret_pick: dict) -> list[triton.Config]:
    """Autotune configs; under the CPU interpreter a single one (it would run every config serially)."""
    options = pick(options, [interpret_pick])
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
def row_scores(q, k_base, rows, rows_ok, skn, d, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, MASKED: tl.constexpr):
    """Raw scores q·kᵀ [M, N] of the KV rows ``rows`` [N] (contiguous or gathered); with MASKED, rows outside
    ``rows_ok`` score -inf and their loads are masked."""
    k = load_rows(k_base, rows, skn, rows_ok, d, HEAD_DIM, D_PAD, MASKED)
    qk = tl.dot(q, tl.trans(k))
    if MASKED:
        qk = tl.where(rows_ok[None, :], qk, float("-inf"))
    return qk


@triton.jit
def row_fold(acc, m_i, l_i, qk, v_base, rows, rows_ok, svn, qk_scale, d, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
             MASKED: tl.constexpr, LAZY: tl.constexpr):
    """Fold the scores ``qk`` of the KV rows ``rows`` into the softmax state, loading their values."""
    v = load_rows(v_base, rows, svn, rows_ok, d, HEAD_DIM, D_PAD, MASKED)
    return online_softmax_step(acc, m_i, l_i, qk, qk_scale, v, LAZY)


@triton.jit
def kv_tile(acc, m_i, l_i, q, k_base, v_base, rows, rows_ok, skn, svn, qk_scale, d,
            HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, MASKED: tl.constexpr, LAZY: tl.constexpr):
    """Attend one tile of KV rows ``rows`` [N] (contiguous or gathered). With MASKED, rows outside
    ``rows_ok`` are skipped (-inf); without it every row is valid and loads carry no row mask. LAZY: see
    online_softmax_step."""
    qk = row_scores(q, k_base, rows, rows_ok, skn, d, HEAD_DIM, D_PAD, MASKED)
    return row_fold(acc, m_i, l_i, qk, v_base, rows, rows_ok, svn, qk_scale, d, HEAD_DIM, D_PAD, MASKED, LAZY)


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


# Residual modes of the fused epilogue (constexpr RESIDUAL): none, data in the model's dtype, fp8 data with
# an fp32 per-row scale (kernels/_residual.py states the semantics), and the same fp8 data read as its bytes and
# decoded in software, for GPUs where Triton has no e4m3 type (``fp8_typed``).
RES_NONE, RES_MODEL, RES_FP8, RES_FP8_BYTES = 0, 1, 2, 3


def fp8_typed_on(capability: tuple[int, int] | None, hip: bool = False) -> bool:
    """Whether Triton types float8_e4m3fn data ('fp8e4nv') on a GPU of this compute capability: NVIDIA 8.9 and
    later (Ada, Hopper, Blackwell). On Ampere and Turing it refuses to compile a kernel taking such a pointer
    (docs/kernel_notes.md, "v14"); ROCm names its fp8 types otherwise. None: not a GPU (the interpreter)."""
    if capability is None:
        return True
    return not hip and tuple(capability) >= (8, 9)


def fp8_typed(t: torch.Tensor) -> bool:
    """``fp8_typed_on`` for the device of ``t`` (a CPU tensor: the interpreter, which types fp8)."""
    return fp8_typed_on(cuda_capability(t), torch.version.hip is not None)


def residual_mode(res) -> int:
    """RESIDUAL constexpr for a checked residual pair (or None)."""
    if res is None:
        return RES_NONE
    if res[1] is None:
        return RES_MODEL
    return RES_FP8 if fp8_typed(res[0]) else RES_FP8_BYTES


def residual_launch_args(res, out: torch.Tensor) -> tuple:
    """(data, scale, 3 data strides, 3 scale strides) for the kernels; ``out`` stands in when absent. fp8 data goes
    as its bytes (a uint8 view) where Triton cannot type it (``residual_mode`` then says RES_FP8_BYTES)."""
    if res is None:
        return (out, out, 0, 0, 0, 0, 0, 0)
    data, scale = res
    sc = scale if scale is not None else out
    if residual_mode(res) == RES_FP8_BYTES:
        data = data.view(torch.uint8)
    return (data, sc, *data.stride()[:3], *(sc.stride()[:3] if scale is not None else (0, 0, 0)))


@triton.jit
def e4m3_from_bytes(x):
    """float8_e4m3fn values from their bytes x (uint8), as fp32: sign, 4 exponent bits (bias 7), 3 mantissa bits;
    exponent 0 is subnormal (m x 2**-9), 0x7F / 0xFF are NaN (e4m3fn has no infinity)."""
    b = x.to(tl.int32)
    mag = b & 0x7F
    # a normal value's bits moved into fp32's fields: exponent e + 120 (= e - 7 + 127), mantissa m << 20
    normal = ((mag + 960) << 20).to(tl.float32, bitcast=True)
    val = tl.where(mag < 8, mag.to(tl.float32) * 0.001953125, normal)
    val = tl.where(mag == 0x7F, float("nan"), val)
    return tl.where(b >= 128, -val, val)


@triton.jit
def add_residual(out, R, RS, b, h, rows, row_ok, srb, srh, srn, ssb, ssh, ssn, d,
                 HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, RESIDUAL: tl.constexpr, w=1.0,
                 MASS: tl.constexpr = False):
    """out [M, D_PAD] fp32 plus the residual rows ``rows`` of head (b, h): data (RESIDUAL 1), or fp8 data
    times its per-row scale (RESIDUAL 2; 3 reads its bytes and decodes them in software), decoded in registers;
    with MASS, each row's residual times w [M] (from ``mass_weight``). Rows outside ``row_ok`` add 0."""
    if RESIDUAL != 0:
        r = load_rows(R + b * srb + h * srh, rows, srn, row_ok, d, HEAD_DIM, D_PAD, True)
        r = e4m3_from_bytes(r) if RESIDUAL == 3 else r.to(tl.float32)
        if RESIDUAL >= 2:
            s = tl.load(RS + b * ssb + h * ssh + rows * ssn, mask=row_ok, other=0.0)
            r = r * s[:, None]
        if MASS:
            r = r * w[:, None]
        out = out + r
    return out


LOG_MASS_EPS = tl.constexpr(math.log(MASS_EPS))


@triton.jit
def mass_weight(lse, MS, b, h, rows, row_ok, msb, msh, msn):
    """w [M] of a mass-weighted residual (kernels/_residual.py, ``mass_weight``): the complement's share of the
    mass now (from this call's sparse row LSE ``lse`` [M], natural log) over its share at the anchor, read from
    the mass rows (log Z_C, log beta) of head (b, h); 1 where the anchor left out less than MASS_EPS."""
    base = MS + b * msb + h * msh + rows * msn
    log_c = tl.load(base, mask=row_ok, other=0.0)
    log_beta = tl.load(base + 1, mask=row_ok, other=0.0)
    x = log_c - lse  # +inf where this call kept nothing
    share = tl.minimum(x, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(x)))  # log sigmoid(x), stable
    return tl.where(log_beta > LOG_MASS_EPS, tl.exp(share - log_beta), 1.0)


@triton.jit
def store_mass(MS, b, h, rows, row_ok, msb, msh, msn, lse_sparse, lse_dense):
    """Write an anchor's mass rows (log Z_C, log beta) from its sparse and dense row LSE [M] (natural log)."""
    beta = tl.minimum(tl.maximum(1.0 - tl.exp(lse_sparse - lse_dense), 0.0), 1.0)
    log_beta = tl.log(beta)
    base = MS + b * msb + h * msh + rows * msn
    tl.store(base, lse_dense + log_beta, mask=row_ok)
    tl.store(base + 1, log_beta, mask=row_ok)


def mass_launch_args(mass, out: torch.Tensor) -> tuple:
    """(tensor, 3 strides) of a contiguous (B, H, N, 2) mass for the kernels; ``out`` stands in when absent."""
    if mass is None:
        return (out, 0, 0, 0)
    return (mass, *mass.stride()[:3])


# Round to the fp8 grid before the cast only under the interpreter: on the GPU the cast itself rounds to nearest even
# with the same result, and the rounding's integer work took registers the residual epilogues spilled for under the
# 128-register cap (docs/kernel_notes.md, "v16").
ROUND_FP8_FIRST = tl.constexpr(interpreting())


@triton.jit
def fp8_grid(x):
    """fp32 x (|x| <= 448) rounded to the nearest float8_e4m3fn value, ties to even, still in fp32: the
    cast that follows is then exact on the GPU and under the interpreter (whose own fp32 -> fp8 cast
    misrounds where rounding carries into the next binade)."""
    bits = x.to(tl.int32, bitcast=True)
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) & -1048576).to(tl.float32, bitcast=True)  # keep 3 mantissa bits
    sub = (x + 24576.0) - 24576.0  # below 2**-6 the grid is 2**-9: 1.5 * 2**14 has that ulp
    return tl.where(tl.abs(x) < 0.015625, sub, normal)


@triton.jit
def store_residual_out(RO, ROS, b, h, pid_bh, rows, row_ok, srb, srh, srn, N_Q, r, d,
                       HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, FP8_OUT: tl.constexpr):
    """Store a residual tile r [M, D_PAD] fp32: as RO's dtype, or (FP8_OUT) as float8_e4m3fn with an fp32
    per-row scale amax / 448 over the row's finite values (1 for all-zero rows) into ROS, contiguous (B*H, N_Q):
    a non-finite element (an inf in the model's v) stays NaN in its own element, never spreads to its row."""
    if FP8_OUT:
        finite = tl.abs(r) < float("inf")
        s = tl.max(tl.where(finite, tl.abs(r), 0.0), 1) / 448.0
        s = tl.where(s > 0, s, 1.0)
        # stored as an [M, 1] tile: from a 1-D store the compiler redid the row max on a copy of the whole tile
        # converted to the store's layout (226 registers instead of 177; 524 spill bytes instead of 96 under the
        # 128-register cap the tuner picks; docs/kernel_notes.md, "v11")
        tl.store((ROS + pid_bh.to(tl.int64) * N_Q + rows)[:, None], s[:, None], mask=row_ok[:, None])
        if ROUND_FP8_FIRST:  # the interpreter's cast misrounds (fp8_grid); the GPU's cast rounds to nearest even
            r = tl.where(finite, fp8_grid(tl.where(finite, r, 0.0) / s[:, None]), float("nan"))
        else:  # NaN where not finite: the GPU's cast saturates an inf to the largest finite value
            r = tl.where(finite, r / s[:, None], float("nan"))
    store_rows(RO + b * srb + h * srh, rows, srn, row_ok, d, r.to(RO.dtype.element_ty), HEAD_DIM, D_PAD)


def tune_options() -> dict:
    """Options every autotuned kernel of the pack shares: the timing above, and its tunings kept on disk (Triton's
    cache, keyed by the GPU's architecture, the kernel's source and the tuning key) where this Triton can, so a new
    ComfyUI process does not time every configuration again at its first anchor and first reuse step (tens of
    seconds at Wan 14B sizes: docs/benchmarks.md, "Stalls in the first reuse step"). SPARSE_ATTN_TUNE=fresh keeps
    tunings in memory only."""
    opts = dict(do_bench=tune_bench)
    if "cache_results" in inspect.signature(triton.autotune).parameters and \
            os.environ.get("SPARSE_ATTN_TUNE", "") != "fresh":
        opts["cache_results"] = True
    return opts
