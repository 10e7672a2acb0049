"""Attention core of the PyTorch backend: the device's fused ``scaled_dot_product_attention`` (SDPA).

The sparse twins gather the kept K/V blocks or tokens (in the model's dtype) and attend them in batched
chunks; rows of one chunk share one key length, so no mask is needed except where short runs of
different lengths are merged into one chunk (then a boolean key-padding mask, never an all-masked row).
A chunk runs through SDPA, except fp32 on CPU, where cache-resident batched matmuls beat SDPA's CPU kernel
on rows this short (``attend``). Ops used here: scaled_dot_product_attention (4-D, optional boolean
mask), baddbmm, bmm, softmax (in place), masked_fill_, matmul, logsumexp, arange — all implemented on
CPU, CUDA and Apple MPS, none in float64.

Memory: a chunk gathers at most ``gather_budget(device)`` elements of K+V, and on devices whose SDPA may
materialise the scores (``FUSED_SDPA_DEVICES`` lists those that never do) the scores of a chunk stay
below ``CHUNK_ELEMS``. Nothing of size Nq x Nk is ever built.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# Upper bound on fp32 score elements held at once (64 Mi elements = 256 MiB): group mass chunks, and
# the scores an unfused SDPA (e.g. Apple MPS's) may materialise.
CHUNK_ELEMS = 1 << 26
# Device types whose SDPA runs a fused kernel (flash / memory-efficient / cuDNN on CUDA, the flash
# kernel on CPU) that never materialises the (Nq, Nk) scores: dense calls go in one piece there.
FUSED_SDPA_DEVICES = ("cpu", "cuda")
# Gathered K+V elements per chunk. CPU: 4 Mi (the fastest of 0.5-16 Mi measured on 2 cores), written
# into reused buffers (fresh multi-MiB allocations per chunk cost page faults that were measured to exceed
# the gather itself); GPU: large chunks (512 MiB of bf16) so one SDPA call has enough rows (query blocks x
# heads) to fill the GPU; bench/torch_backend.py --sweep-gather measures the choice.
GATHER_ELEMS = {"cpu": 1 << 22}
GATHER_ELEMS_DEFAULT = 1 << 28
# fp32 score elements per chunk of the group mass: cache-sized on CPU (its elementwise passes then run
# in cache), CHUNK_ELEMS elsewhere.
SCORE_ELEMS = {"cpu": 1 << 20}
# Chunk planning: a run of at least MIN_RUN_ROWS rows with one list length gets unmasked chunks of its
# own; shorter runs are merged with the next ones while their length is within MERGE_SLACK of the
# chunk's longest (so padding wastes at most that fraction) and masked.
MIN_RUN_ROWS = 8
MERGE_SLACK = 0.125
# fp32 on CPU: rows of 128 queries (a query block or group over its gathered keys) run as cache-resident
# batched matmuls + softmax instead of SDPA, whose CPU kernel splits such short query runs into
# 32-query tiles: measured 1.27x (D 64) to 1.3x (D 128) faster on 2 cores (docs/benchmarks.md); at 64
# queries per row both run at the same speed and SDPA is kept. bf16/fp16 keep SDPA (its reduced-precision
# CPU kernel is ~2x faster than fp32 matmuls there).
CPU_FP32_MATMUL = True
MATMUL_MIN_QUERIES = 128
MATMUL_SCORE_ELEMS = 1 << 21  # fp32 scores per sub-chunk of that path (8 MiB: as fast as 4 MiB, fewer ops)


def fused_sdpa(device: torch.device) -> bool:
    """True when SDPA on this device type never builds the full score matrix."""
    return device.type in FUSED_SDPA_DEVICES


def gather_budget(device: torch.device) -> int:
    """Gathered K+V elements one chunk may hold on this device (see ``GATHER_ELEMS``)."""
    return GATHER_ELEMS.get(device.type, GATHER_ELEMS_DEFAULT)


def score_budget(device: torch.device) -> int:
    """fp32 score elements one chunk of the group mass may hold on this device (at most CHUNK_ELEMS)."""
    return min(CHUNK_ELEMS, SCORE_ELEMS.get(device.type, CHUNK_ELEMS))


def chunk_rows(device: torch.device, q_rows: int, length: int, d: int) -> int:
    """How many independent rows (``q_rows`` queries over ``length`` gathered keys, head dim d) fit in one
    chunk: gathered K+V within ``gather_budget``, and on unfused devices scores within ``CHUNK_ELEMS``."""
    rows = gather_budget(device) // max(1, 2 * length * d)
    if not fused_sdpa(device):
        rows = min(rows, CHUNK_ELEMS // max(1, q_rows * length))
    return max(1, rows)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor | None,
         scale: float) -> torch.Tensor:
    """Attention of each batch row's queries over its keys, in the inputs' dtype (fp32 softmax inside).

    q: (R, 1, M, D); k, v: (R, 1, L, D); lengths: int64 (R,) real keys per row (all >= 1; keys past
    them are masked), or None when every row uses all L keys. Returns (R, 1, M, D) in q's dtype.
    """
    mask = None
    if lengths is not None:
        mask = (torch.arange(k.shape[2], device=k.device).view(1, -1) < lengths.view(-1, 1)).view(-1, 1, 1,
                                                                                                   k.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor | None,
           scale: float, scratch) -> torch.Tensor:
    """The sparse twins' attention over gathered rows: ``sdpa``, or on CPU in fp32 with rows of at least
    ``MATMUL_MIN_QUERIES`` queries the cache-resident matmul path (``CPU_FP32_MATMUL``), whose score and
    output buffers come from ``scratch`` (a ``_gather.Scratch``; the result is only valid until its next
    use). Otherwise as ``sdpa``."""
    cpu_fp32 = q.device.type == "cpu" and q.dtype == torch.float32
    if CPU_FP32_MATMUL and cpu_fp32 and q.shape[2] >= MATMUL_MIN_QUERIES:
        return _attend_matmul(q, k, v, lengths, scale, scratch)
    return sdpa(q, k, v, lengths, scale)


def _attend_matmul(q, k, v, lengths, scale, scratch):
    """fp32 softmax attention by baddbmm / in-place softmax / bmm over sub-chunks of at most
    ``MATMUL_SCORE_ELEMS`` scores. q: (R, 1, M, D); k, v: (R, 1, L, D) (strided views allowed);
    lengths as in ``sdpa`` (every row keeps >= 1 key, so no row is all -inf). Returns (R, 1, M, D)."""
    r, _, m, d = q.shape
    length = k.shape[2]
    q3, k3, v3 = q[:, 0], k[:, 0], v[:, 0]
    out = scratch.buffer("o", r * m * d).view(r, m, d)
    step = max(1, min(MATMUL_SCORE_ELEMS, CHUNK_ELEMS) // (m * length))
    buf = scratch.buffer("s", min(r, step) * m * length)
    for r0 in range(0, r, step):
        n = min(step, r - r0)
        s = buf[:n * m * length].view(n, m, length)
        torch.baddbmm(s, q3[r0:r0 + n], k3[r0:r0 + n].transpose(1, 2), beta=0.0, alpha=scale, out=s)
        if lengths is not None:
            pad = torch.arange(length, device=q.device).view(1, 1, -1) >= lengths[r0:r0 + n].view(-1, 1, 1)
            s.masked_fill_(pad, float("-inf"))
        # softmax in place (the CPU kernel reads each row before writing it; tests compare with float64)
        torch.ops.aten._softmax.out(s, -1, False, out=s)
        torch.bmm(s, v3[r0:r0 + n], out=out[r0:r0 + n])
    return out.view(r, 1, m, d)


def plan_chunks(lengths: list[int], max_rows: Callable[[int], int]) -> list[tuple[int, int, int, bool]]:
    """Cut rows sorted by list length (descending, all >= 1) into SDPA chunks.

    lengths: the sorted lengths; max_rows(L): most rows of length L one chunk may hold.
    Returns (start, stop, longest length, mixed) per chunk; ``mixed`` chunks hold rows of different
    lengths and need a key-padding mask. Runs of one length of at least ``MIN_RUN_ROWS`` rows are never
    mixed with others; shorter runs merge while within ``MERGE_SLACK`` of the chunk's longest length.
    """
    runs: list[tuple[int, int]] = []  # (length, rows)
    for length in lengths:
        if runs and runs[-1][0] == length:
            runs[-1] = (length, runs[-1][1] + 1)
        else:
            runs.append((length, 1))
    chunks: list[tuple[int, int, int, bool]] = []

    def emit(start: int, stop: int) -> None:
        longest = lengths[start]
        step = max(1, max_rows(longest))
        for s in range(start, stop, step):
            e = min(stop, s + step)
            chunks.append((s, e, lengths[s], lengths[s] != lengths[e - 1]))

    pos = 0
    pend: list[int] | None = None  # [start, stop] of a chunk of short runs being merged
    for length, n in runs:
        if n >= MIN_RUN_ROWS:
            if pend:
                emit(*pend)
                pend = None
            emit(pos, pos + n)
        elif (pend and length >= (1.0 - MERGE_SLACK) * lengths[pend[0]]
              and pend[1] - pend[0] + n <= max_rows(lengths[pend[0]])):
            pend[1] += n
        else:
            if pend:
                emit(*pend)
            pend = [pos, pos + n]
        pos += n
    if pend:
        emit(*pend)
    return chunks


def dense_lse_fallback(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Row LSE of dense attention from fp32 scores, chunked over query rows (at most ``CHUNK_ELEMS``).

    q: (B, H, Nq, D); k: (B, H, Nk, D). Returns fp32 (B, H, Nq), natural log. Ops: matmul, logsumexp.
    """
    b, h, nq, _ = q.shape
    nk = k.shape[2]
    kt = k.float().transpose(-1, -2)
    lse = torch.empty((b, h, nq), dtype=torch.float32, device=q.device)
    step = max(1, CHUNK_ELEMS // max(1, b * h * nk))
    for s0 in range(0, nq, step):
        s = torch.matmul(q[:, :, s0:s0 + step].float(), kt).mul_(scale)
        lse[:, :, s0:s0 + step] = torch.logsumexp(s, dim=-1)
    return lse


def dense_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """(out, lse) from the device's own SDPA op that returns the LSE, or None when there is none.

    CPU: the flash kernel (``_scaled_dot_product_flash_attention_for_cpu``); CUDA: the flash kernel for
    fp16/bf16, the memory-efficient kernel otherwise. q: (B, H, Nq, D); k, v: (B, H, Nk, D).
    """
    aten = torch.ops.aten
    nq = q.shape[2]
    try:
        if q.device.type == "cpu" and hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
            out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, scale=scale)[:2]
        elif q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0 \
                and q.shape[-1] <= 256 and hasattr(aten, "_scaled_dot_product_flash_attention"):
            out, lse = aten._scaled_dot_product_flash_attention(q, k, v, scale=scale)[:2]
        elif q.device.type == "cuda" and hasattr(aten, "_scaled_dot_product_efficient_attention"):
            out, lse = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, scale=scale)[:2]
        else:
            return None
    except (RuntimeError, TypeError, NotImplementedError):
        return None
    if tuple(lse.shape[:2]) != tuple(q.shape[:2]) or lse.shape[2] < nq:
        return None
    return out, lse[:, :, :nq].float()
