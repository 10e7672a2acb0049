"""Token-sparse (gathered-KV) attention forward in Triton.

One program holds a tile of C grouped queries (gathered by index) and walks its own sorted KV token list in chunks of
BLOCK_N, gathering K/V rows by index inside the loop: gathered K/V never exist in memory. Outputs are written back at
the queries' original positions, plus the residual when one is given (kernels/_residual.py). Gathered rows cannot use
TMA on Hopper (its TMA has no row gather), so this kernel stays on pointer loads; its configs are tuned for Hopper
(docs/kernel_notes.md). On Hopper, groups of 128 at head dim 128 from GLUON_MIN_TOKENS query tokens on go to
kernels/token_sparse_gluon.py instead (cp.async gathers feeding a warp-specialised schedule; kernels/_hopper.py,
``gluon_problem``). Twin of ``token_sparse_torch.token_sparse_attention``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _hopper, fast_launch
from ._checks import check_qkv, check_scale, triton_group_problem
from ._residual import check_residual, contiguous_residual, decode_into, refuse_mass
from ._triton_common import (LOG2E, add_residual, configs, finish, head_dim_pad, kv_tile, last_dim_contiguous,
                             lazy_rescale, list_bucket, load_group, loop_ahead, residual_launch_args, residual_mode,
                             row_fold, row_scores, store_rows, tune_options)
from .compact_torch import SEGMENT
from .token_sparse_torch import check_compact_lists, check_token_lists

# Gathered (index-dependent) loads are pipelined only with >= 3 stages (5 for a second buffer ahead). The
# sm_90 compiler report (docs/kernel_notes.md): with 128 queries and D = 128, 4 warps spill ~200 bytes
# (BLOCK_N 64) while 8 warps fit in 176-248 registers; 4 warps measured best before, so both are tried.
_CONFIGS = configs(
    [dict(BLOCK_N=64, num_warps=4, num_stages=3),
     dict(BLOCK_N=64, num_warps=8, num_stages=3),
     dict(BLOCK_N=64, num_warps=8, num_stages=5),
     dict(BLOCK_N=128, num_warps=8, num_stages=3),
     dict(BLOCK_N=32, num_warps=4, num_stages=4)],
    interpret_pick=dict(BLOCK_N=32))


def _prune(configs_, named_args, **kwargs):
    group = kwargs.get("GROUP", named_args.get("GROUP"))
    kept = [c for c in configs_ if not (group <= 64 and c.num_warps == 8)]
    return kept or [configs_[0]]


@triton.jit
def _token_ids(raw, slot, SEG, row, N_SEG: tl.constexpr, SEGMENT: tl.constexpr):
    """Token ids of list slots ``slot`` from what was loaded there: int32 ids as they are (N_SEG 0), or compact
    int16 offsets decoded in registers (kernels/compact_torch.py): offset + 32768 + SEGMENT x the number of the
    row's segment ends at or below the slot."""
    if N_SEG == 0:
        return raw
    tok = raw.to(tl.int32) + 32768
    for s in tl.static_range(N_SEG):
        end = tl.load(SEG + row * N_SEG + s)
        tok += (slot >= end).to(tl.int32) * SEGMENT
    return tok


@triton.autotune(configs=_CONFIGS, key=["K_BUCKET", "HEAD_DIM", "GROUP", "LAZY", "N_SEG", "AHEAD"],
                 prune_configs_by={"early_config_prune": _prune}, **tune_options())
@triton.jit
def _token_fwd(Q, K, V, Out, R, RS, QG, TOK, CNT, SEG,
               sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, srb, srh, srn, ssb, ssh, ssn,
               H, N_Q, N_KV, G, MAX_K, qk_scale, K_BUCKET,
               HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, RESIDUAL: tl.constexpr,
               GROUP: tl.constexpr, BLOCK_N: tl.constexpr, LAZY: tl.constexpr, N_SEG: tl.constexpr,
               SEGMENT: tl.constexpr, AHEAD: tl.constexpr):
    d = tl.arange(0, D_PAD)
    q, qi, q_ok, row, b, h, pid_bh = load_group(QG, Q, G, H, sqb, sqh, sqn, d, HEAD_DIM, D_PAD, GROUP)
    k_base = K + b * skb + h * skh
    v_base = V + b * svb + h * svh
    tok_base = TOK + row * MAX_K
    count = tl.load(CNT + row)
    m_i = tl.full([GROUP], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP], tl.float32)
    acc = tl.zeros([GROUP, D_PAD], tl.float32)
    n_full = (count // BLOCK_N) * BLOCK_N
    if AHEAD:  # the next chunk's scores before this chunk's softmax (kernels/_triton_common.py, loop_ahead)
        if n_full > 0:
            slot = tl.arange(0, BLOCK_N)
            tok = _token_ids(tl.load(tok_base + slot), slot, SEG, row, N_SEG, SEGMENT)
            qk = row_scores(q, k_base, tok, slot < count, skn, d, HEAD_DIM, D_PAD, False)
            for start in range(BLOCK_N, n_full, BLOCK_N):
                slot_n = start + tl.arange(0, BLOCK_N)
                tok_n = _token_ids(tl.load(tok_base + slot_n), slot_n, SEG, row, N_SEG, SEGMENT)
                qk_n = row_scores(q, k_base, tok_n, slot_n < count, skn, d, HEAD_DIM, D_PAD, False)
                acc, m_i, l_i = row_fold(acc, m_i, l_i, qk, v_base, tok, tok >= 0, svn, qk_scale, d, HEAD_DIM, D_PAD,
                                         False, LAZY)  # unmasked: the row mask is not read
                qk = qk_n
                tok = tok_n
            acc, m_i, l_i = row_fold(acc, m_i, l_i, qk, v_base, tok, tok >= 0, svn, qk_scale, d, HEAD_DIM, D_PAD,
                                     False, LAZY)
    else:
        for start in range(0, n_full, BLOCK_N):  # full chunks of the list: no masks
            slot = start + tl.arange(0, BLOCK_N)
            tok = _token_ids(tl.load(tok_base + slot), slot, SEG, row, N_SEG, SEGMENT)
            acc, m_i, l_i = kv_tile(acc, m_i, l_i, q, k_base, v_base, tok, slot < count, skn, svn,
                                    qk_scale, d, HEAD_DIM, D_PAD, False, LAZY)
    if n_full < count:  # the list's tail
        slot = n_full + tl.arange(0, BLOCK_N)
        t_ok = slot < count
        tok = _token_ids(tl.load(tok_base + slot, mask=t_ok, other=0), slot, SEG, row, N_SEG, SEGMENT)
        acc, m_i, l_i = kv_tile(acc, m_i, l_i, q, k_base, v_base, tok, t_ok, skn, svn,
                                qk_scale, d, HEAD_DIM, D_PAD, True, LAZY)
    out, _ = finish(acc, m_i, l_i)
    out = add_residual(out, R, RS, b, h, qi, q_ok, srb, srh, srn, ssb, ssh, ssn, d, HEAD_DIM, D_PAD, RESIDUAL)
    store_rows(Out + b * sob + h * soh, qi, son, q_ok, d, out.to(Out.dtype.element_ty), HEAD_DIM, D_PAD)


PATHS = ("auto", "pointer", "gluon", "gluon_persistent")


def token_sparse_attention(q, k, v, q_groups, kv_tokens, kv_counts, *, scale=None, validate=True, residual=None,
                           path="auto"):
    """Token-sparse attention on the Triton kernel; arguments as in the PyTorch twin.

    q: (B,H,Nq,D); k, v: (B,H,Nk,D); q_groups int32 (B,H,G,C) (-1 pads); kv_tokens int32
    (B,H,G,max_k) sorted; kv_counts int32 (B,H,G); residual None or a (data, scale) pair. Returns out
    (B,H,Nq,D); queries in no group get 0, or exactly the residual when one is given.
    ``validate=False`` skips the index checks for trusted lists. ``path``: "auto" (the Gluon kernel where
    ``_hopper.gluon_problem`` allows it, else the pointer kernel), "pointer", "gluon" (ValueError where it cannot) or
    "gluon_persistent" (the Gluon kernel on its one-program-per-SM grid).
    """
    b, h, nq, nk, d = check_qkv(q, k, v)
    scale = check_scale(scale, d)
    g, c, max_k = check_token_lists(q, k, q_groups, kv_tokens, kv_counts, validate)
    return _launch(q, k, v, q_groups, kv_tokens.to(torch.int32), None, kv_counts, g, c, max_k, scale, residual,
                   path=path)


def token_sparse_attention_compact(q, k, v, q_groups, kv_low, seg_ends, kv_counts, *, scale=None, validate=True,
                                   residual=None, fill_ungrouped=True, path="auto"):
    """Token-sparse attention over compact lists on the Triton kernel, which decodes them in registers (no int32
    copy of the lists per call); arguments as in the PyTorch twin ``token_sparse_attention_compact``: kv_low int16
    (B,H,G,W), seg_ends int32 (B,H,G,S), kv_counts int32 (B,H,G). fill_ungrouped=False: rows in no group are
    left unwritten (no residual decode pass, no zero fill). ``path`` as in ``token_sparse_attention``."""
    b, h, nq, nk, d = check_qkv(q, k, v)
    scale = check_scale(scale, d)
    g, c, width, _ = check_compact_lists(q, k, q_groups, kv_low, seg_ends, kv_counts, validate)
    return _launch(q, k, v, q_groups, kv_low, seg_ends, kv_counts, g, c, width, scale, residual, fill_ungrouped,
                   path)


def _launch(q, k, v, q_groups, lists, seg_ends, kv_counts, g, c, max_k, scale, residual, fill=True, path="auto"):
    """The kernel over int32 token lists (seg_ends None) or compact int16 lists with their segment ends; ``fill``:
    rows in no group get the residual (or 0), else they are left unwritten. ``path``: "auto", "pointer", "gluon"
    (kernels/token_sparse_gluon.py) or "gluon_persistent" (its one-program-per-SM grid; explicit only until timed)."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    b, h, nq, d = q.shape
    nk = k.shape[2]
    why = triton_group_problem(c)
    if why:
        raise ValueError(f"q_groups: {why}")
    refuse_mass(residual, q)
    res = contiguous_residual(check_residual(residual, q))
    q, k, v = last_dim_contiguous(q, k, v)
    qg = q_groups.to(torch.int32).contiguous()
    tok = lists.contiguous()
    cnt = kv_counts.to(torch.int32).contiguous()
    seg = cnt if seg_ends is None else seg_ends.to(torch.int32).contiguous()
    n_seg = 0 if seg_ends is None else seg.shape[-1]
    # queries in no group keep this: 0, or the residual (a decode pass, as cheap as the zero fill it replaces)
    out = torch.empty((b, h, nq, d), dtype=q.dtype, device=q.device)
    if fill and res is None:
        out.zero_()
    elif fill:
        decode_into(out, res)
    persistent = path == "gluon_persistent"
    if g > 0 and _hopper.use_gluon("gluon_token", q, k, v, block_q=c, path="gluon" if persistent else path):
        from . import token_sparse_gluon
        done = _hopper.attempt("gluon_token", path == "auto", lambda: token_sparse_gluon.attention(
            q, k, v, out, qg, tok, None if seg_ends is None else seg, cnt, scale=scale, segment=SEGMENT,
            residual=res, persistent=persistent))
        if done is not None:
            return out
    if g > 0:
        res_args = residual_launch_args(res, out)
        fast_launch.launch(_token_fwd, (g, b * h), (
            q, k, v, out, *res_args[:2], qg, tok, cnt, seg, *q.stride()[:3], *k.stride()[:3],
            *v.stride()[:3], *out.stride()[:3], *res_args[2:], h, nq, nk, g, max(1, max_k),
            scale * LOG2E, list_bucket(max(1, max_k))), dict(
            HEAD_DIM=d, D_PAD=head_dim_pad(d), RESIDUAL=residual_mode(res), GROUP=c, LAZY=lazy_rescale(),
            N_SEG=n_seg, SEGMENT=SEGMENT, AHEAD=loop_ahead()))
    return out
