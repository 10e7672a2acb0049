"""Public attention primitives with backend dispatch (``backend="auto"|"triton"|"torch"``).

``validate=False`` (sparse primitives) skips the value checks of index lists, which read tensors back
from the GPU; the engine passes it for lists it built itself. Each function has the signature and
semantics of its PyTorch twin (``*_torch.py``), whose docstring
states layouts, shapes and dtypes. ``auto`` runs the Triton kernel (``*_triton.py``) when the tensors
are on CUDA, Triton imports and the case is supported; otherwise the twin. ``triton`` raises
``ValueError`` with the reason when the kernel cannot run. Triton modules are imported only here,
lazily, so importing the pack never needs Triton.
"""

from __future__ import annotations

import torch

from . import (anchor_torch, block_sparse_torch, compact_torch, dense_torch, grouping_graph, grouping_torch,
               selection_torch, threshold_torch, token_sparse_torch)
from ._checks import FLOAT_DTYPES, GATHER_WIDTHS, TRITON_HEAD_DIMS, triton_group_problem
from ._residual import check_residual, mass_of, refuse_mass, residual_mass
from .backend import announce, check_backend, choose, triton_problem


def _why_not(q, group: int | None = None) -> str | None:
    """Reason the Triton kernels cannot take this case (dtype, head dim, group size), or None."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        return "q is not a (B, H, N, D) tensor"
    if q.dtype not in FLOAT_DTYPES:
        return f"dtype {q.dtype} is not supported"
    if q.shape[-1] not in TRITON_HEAD_DIMS:
        return f"head dim {q.shape[-1]} is not one of {TRITON_HEAD_DIMS}"
    return None if group is None else triton_group_problem(group)


def block_sparse_on_triton(q, backend: str = "auto") -> bool:
    """Whether ``block_sparse_attention`` would run its Triton kernel for q under ``backend`` (nothing logged, nothing
    raised): the engine weights residuals by the mass only there (SparseConfig.residual_weighting "auto")."""
    return backend != "torch" and triton_problem(backend, q, _why_not(q)) is None


INT32_SPAN = 2**31


def _addressable(*ts: torch.Tensor) -> tuple:
    """The tensors as the kernels can address them: a tensor whose element offsets reach 2**31 (the
    kernels' pointer arithmetic is 32-bit: e.g. q/k/v viewed out of a fused QKV+MLP projection, where
    one token's stride is the whole projection width) or whose last dim is strided is copied contiguous.
    Raises ValueError when even the contiguous tensor is too large (the engine then goes dense)."""
    out = []
    for t in ts:
        if t.numel() and (t.stride(-1) != 1 or sum((n - 1) * st for n, st in zip(t.shape, t.stride())) >= INT32_SPAN):
            if t.numel() >= INT32_SPAN:
                raise ValueError(f"tensor of {t.numel()} elements is beyond the kernels' 32-bit offsets")
            t = t.contiguous()
        out.append(t)
    return tuple(out)


def _group_size(q_groups) -> int | None:
    return q_groups.shape[-1] if isinstance(q_groups, torch.Tensor) and q_groups.dim() == 4 else None


def attention_dense(q, k, v, *, scale=None, return_lse=False, backend="auto"):
    """Dense attention. q: (B,H,Nq,D), k/v: (B,H,Nk,D) -> out (B,H,Nq,D) [+ lse (B,H,Nq) fp32].

    ``auto`` on CUDA prefers, on Hopper, the Gluon kernel (faster than cuDNN there: kernels/attention_gluon.py), then
    cuDNN's fused attention (faster than our other Triton kernels, and it returns the LSE too), then the Triton
    kernel; ``triton`` always runs a Triton kernel (Gluon's first where it may run).
    """
    if choose(backend, q, _why_not(q), "attention_dense") == "triton":
        from . import _hopper, dense_cudnn, dense_triton
        q, k, v = _addressable(q, k, v)
        if backend == "auto" and _hopper.use_gluon("gluon_dense", q, k, v):
            res = dense_triton.gluon_attention_dense(q, k, v, scale=scale, return_lse=return_lse)
            if res is not None:
                return res  # else it failed (logged once): cuDNN, as the calls after this one
        if backend == "auto" and dense_cudnn.supported(q):
            from ._checks import check_qkv, check_scale
            res = dense_cudnn.attention_dense(q, k, v, scale=check_scale(scale, check_qkv(q, k, v)[4]),
                                              return_lse=return_lse)
            if res is not None:
                return res
        return dense_triton.attention_dense(q, k, v, scale=scale, return_lse=return_lse)
    return dense_torch.attention_dense(q, k, v, scale=scale, return_lse=return_lse)


def _addressable_residual(residual, q):
    """The checked residual with tensors the kernels can address (see ``_addressable``): a (data, scale) pair, or a
    (data, scale, mass) triple when it carries a mass (kernels/_residual.py; contiguous, so addressable)."""
    res = check_residual(residual, q)
    if res is None:
        return None
    data, scale = res
    pair = (*_addressable(data), None if scale is None else _addressable(scale)[0])
    mass = residual_mass(residual, q)
    return pair if mass is None else (*pair, mass)


def block_sparse_attention(q, k, v, kv_indices, kv_counts, *, block_q, block_k, scale=None, backend="auto",
                           validate=True, residual=None, return_lse=False):
    """Block-sparse attention over CSR block lists kv_indices (B,H,nqb,max_k) / kv_counts (B,H,nqb).

    residual: None or a (data, scale) pair added to the output in the kernel's epilogue: data (B,H,Nq,D)
    in q's dtype with scale None, or float8_e4m3fn data with an fp32 (B,H,Nq,1) per-row scale
    (kernels/_residual.py). Rows with nothing to attend get exactly the residual. A (data, scale, mass) triple
    (or a ``mass`` attribute) weights the residual by the selected keys' mass (kernels/_residual.py).
    return_lse: (out, lse fp32 (B,H,Nq)), the sparse attention's row LSE (-inf where nothing is attended).
    """
    if choose(backend, q, _why_not(q), "block_sparse_attention") == "triton":
        from . import block_sparse_triton
        q, k, v = _addressable(q, k, v)
        return block_sparse_triton.block_sparse_attention(q, k, v, kv_indices, kv_counts, block_q=block_q,
                                                          block_k=block_k, scale=scale, validate=validate,
                                                          residual=_addressable_residual(residual, q),
                                                          return_lse=return_lse)
    return block_sparse_torch.block_sparse_attention(q, k, v, kv_indices, kv_counts, block_q=block_q,
                                                     block_k=block_k, scale=scale, validate=validate,
                                                     residual=residual, return_lse=return_lse)


def token_sparse_attention(q, k, v, q_groups, kv_tokens, kv_counts, *, scale=None, backend="auto", validate=True,
                           residual=None):
    """Token-sparse attention of query groups (B,H,G,C) over KV token lists (B,H,G,max_k).

    residual: None or a (data, scale) pair added to the output (as in ``block_sparse_attention``);
    queries in no group, or with nothing to attend, get exactly the residual.
    """
    refuse_mass(residual, q)  # before the backend choice: the same error on every backend
    if choose(backend, q, _why_not(q, _group_size(q_groups)), "token_sparse_attention") == "triton":
        from . import token_sparse_triton
        q, k, v = _addressable(q, k, v)
        return token_sparse_triton.token_sparse_attention(q, k, v, q_groups, kv_tokens, kv_counts, scale=scale,
                                                          validate=validate,
                                                          residual=_addressable_residual(residual, q))
    return token_sparse_torch.token_sparse_attention(q, k, v, q_groups, kv_tokens, kv_counts, scale=scale,
                                                     validate=validate, residual=residual)


def token_sparse_attention_compact(q, k, v, q_groups, kv_low, seg_ends, kv_counts, *, scale=None, backend="auto",
                                   validate=True, residual=None, fill_ungrouped=True):
    """``token_sparse_attention`` over the compact lists the engine caches (kv_low int16 (B,H,G,W), seg_ends int32
    (B,H,G,S), kv_counts int32 (B,H,G): kernels.compact_keep's format with its default segment size); the Triton
    kernel decodes them in registers, the twin decodes them first
    (token_sparse_torch.token_sparse_attention_compact). ``fill_ungrouped=False``: rows in no group are left
    unwritten on the Triton path (their content is undefined; the caller writes them), which spares a pass over
    the whole residual (or a zero fill) when the groups cover every row the caller does not write itself."""
    refuse_mass(residual, q)  # before the backend choice: the same error on every backend
    if choose(backend, q, _why_not(q, _group_size(q_groups)), "token_sparse_attention") == "triton":
        from . import token_sparse_triton
        q, k, v = _addressable(q, k, v)
        return token_sparse_triton.token_sparse_attention_compact(
            q, k, v, q_groups, kv_low, seg_ends, kv_counts, scale=scale, validate=validate,
            residual=_addressable_residual(residual, q), fill_ungrouped=fill_ungrouped)
    return token_sparse_torch.token_sparse_attention_compact(q, k, v, q_groups, kv_low, seg_ends, kv_counts,
                                                             scale=scale, validate=validate, residual=residual,
                                                             fill_ungrouped=fill_ungrouped)


# Where the Gluon anchor does not run (another GPU, or a reason _hopper.gluon_problem names: fewer than
# GLUON_MIN_TOKENS tokens, 64-query blocks, another head dim or dtype, SPARSE_ATTN_GLUON=0, an earlier failure): above
# this fraction of the (query, key) pairs the TMA kernels' fused one-pass anchor is cheaper than one dense call plus
# the block-sparse kernel with the residual in its epilogue; below it, the composed path. Since the fused kernel
# runs under the 128-register cap the two cost the same at 0.08-0.12 at Wan 14B and 0.12-0.15 at HunyuanVideo, and
# the fused one is cheaper above (docs/kernel_notes.md, "v16"; 0.15 before, "v10").
FUSED_ANCHOR_ABOVE = 0.12


def block_anchor_attention(q, k, v, kv_indices, kv_counts, *, block_q, block_k, scale=None,
                           residual_precision="model", return_lse=False, backend="auto", validate=True,
                           return_mass=False, density=None):
    """Anchor step of a block selection: dense output plus the residual R = dense - block-sparse.

    Returns (out_dense (B,H,Nq,D), (r_data, r_scale)) or with ``return_lse`` (out_dense, lse (B,H,Nq) fp32,
    (r_data, r_scale)); residual_precision "model" (R in q's dtype, scale None) or "fp8" (float8_e4m3fn R,
    fp32 (B,H,Nq,1) scale); ``return_mass``: the residual is a (r_data, r_scale, mass) triple, mass fp32
    (B,H,Nq,2) for mass-weighted reuse (kernels/_residual.py). Semantics of ``anchor_torch.block_anchor_attention``.
    On Hopper ``auto`` and ``triton`` run the Gluon kernel's one pass (kernels/anchor_gluon.py: the selected blocks,
    then the complement, at the Gluon dense rate; docs/kernel_notes.md "v29") where ``_hopper.gluon_problem`` finds
    nothing against it; otherwise the TMA kernels' fused one-pass kernel when the lists keep more than
    FUSED_ANCHOR_ABOVE of the pairs, and the dense call (cuDNN where available) plus the block-sparse kernel with the
    residual in its epilogue below; elsewhere the dense and block-sparse primitives are composed, R formed in PyTorch.
    ``density``: the fraction of pairs the lists keep when the caller knows it (the engine's selections do); without
    it the widest list's share of the KV blocks stands in, read on the host without a synchronisation (an upper
    bound: one dense row, e.g. text, makes it 1).
    """
    if choose(backend, q, _why_not(q), "block_anchor_attention") == "triton":
        from . import _hopper, anchor_triton  # a compile failure: logged once, the composed path runs from now on
        q, k, v = _addressable(q, k, v)
        if _hopper.use_gluon("gluon_anchor", q, k, v, block_q, block_k):  # one pass at the Gluon dense rate
            done = _hopper.attempt("gluon_anchor", True, lambda: anchor_triton.block_anchor_attention(
                q, k, v, kv_indices, kv_counts, block_q=block_q, block_k=block_k, scale=scale,
                residual_precision=residual_precision, return_lse=return_lse, validate=validate,
                return_mass=return_mass, path="gluon"))
            if done is not None:
                return done
        kept = density if density is not None else kv_indices.shape[-1] / -(-k.shape[2] // block_k)
        if kept > FUSED_ANCHOR_ABOVE and anchor_triton.supported(k, v):
            done = _hopper.attempt("anchor", True, lambda: anchor_triton.block_anchor_attention(
                q, k, v, kv_indices, kv_counts, block_q=block_q, block_k=block_k, scale=scale,
                residual_precision=residual_precision, return_lse=return_lse, validate=validate,
                return_mass=return_mass))
            if done is not None:
                return done
        # the dense LSE only where it is returned or weighs the residual (cuDNN's LSE output costs 0.5-1.2 %)
        dense = attention_dense(q, k, v, scale=scale, return_lse=return_lse or return_mass, backend=backend)
        out, lse = dense if return_lse or return_mass else (dense, None)
        res = None
        if _hopper.use_tma("residual", k, v):
            res = _hopper.attempt("residual", True, lambda: anchor_triton.block_residual(
                q, k, v, kv_indices, kv_counts, out, lse, block_q=block_q, block_k=block_k, scale=scale,
                residual_precision=residual_precision, validate=validate, return_mass=return_mass))
        if res is None:
            sparse = block_sparse_attention(q, k, v, kv_indices, kv_counts, block_q=block_q, block_k=block_k,
                                            scale=scale, backend=backend, validate=validate, return_lse=return_mass)
            if return_mass:
                sparse, lse_sparse = sparse
            res = residual_of(out, sparse, precision=residual_precision, backend=backend)
            if return_mass:
                res = (*res, mass_of(lse, lse_sparse))
        return (out, lse, res) if return_lse else (out, res)
    return anchor_torch.block_anchor_attention(q, k, v, kv_indices, kv_counts, block_q=block_q, block_k=block_k,
                                               scale=scale, residual_precision=residual_precision,
                                               return_lse=return_lse, validate=validate, return_mass=return_mass)


def residual_of(dense, sparse, *, precision="model", return_sums=False, backend="auto"):
    """An anchor's residual R = dense - sparse, formed in fp32 and encoded: dense, sparse (B,H,N,D) of one float
    dtype -> (R in dense's dtype, None) for precision "model", (float8_e4m3fn R, fp32 (B,H,N,1) row scale) for
    "fp8" (kernels/_residual.py); with ``return_sums`` (pair, fp32 (2,) [sum of R^2, sum of dense^2]) on the device,
    read without a synchronisation. On CUDA one Triton pass (kernels/residual_encode_triton.py) where Triton types
    fp8 (or for "model"); elsewhere the twin ``anchor_torch.residual_of``."""
    if precision not in ("model", "fp8"):
        raise ValueError(f"precision must be 'model' or 'fp8', got {precision!r}")
    if choose(backend, dense, _why_not(dense), "residual_of") == "triton":
        from . import residual_encode_triton
        if residual_encode_triton.supported(dense, precision) and sparse.shape == dense.shape \
                and sparse.dtype == dense.dtype:
            try:
                d, s = _addressable(dense, sparse)
            except ValueError:  # beyond 32-bit offsets even contiguous: the twin works a few heads at a time
                d = None
            if d is not None:
                return residual_encode_triton.residual_of(d, s, precision, return_sums)
    return anchor_torch.residual_of(dense, sparse, precision, return_sums)


def group_queries(q, group_size, *, dims=0, backend="auto"):
    """Principal-direction median-split grouping -> int32 (B,H,ceil(N/C),C), -1 pads; dims 16/32/64: on each head's
    queries projected on that many leading principal directions (grouping_torch.group_queries).

    Built from batched PyTorch operations (matmuls and sorts), which run on the GPU as they are; where Triton can run
    (never raising: an explicit "triton" that cannot falls back as "auto" does), each level's row gather is
    ``gather_triton.gather_rows``, which gives the same rows as the twin's ``index_select``; on CUDA, with dims, the
    partition of the projected queries is replayed from a CUDA graph from a shape's second call on
    (``grouping_graph.group_points``; ``release_graphs`` frees them).
    """
    check_backend(backend)
    grouping_torch.check_grouping_args(q, group_size, dims)
    width = dims if dims and dims < q.shape[-1] else q.shape[-1]
    why = None if width in GATHER_WIDTHS else f"row width {width} is not one of {GATHER_WIDTHS}"
    if backend != "torch" and isinstance(q, torch.Tensor) and triton_problem(backend, q, why) is None:
        from . import gather_triton
        announce("group_queries", q, "torch", "PyTorch operations, the row gathers on a Triton kernel")
        # group_points runs the partition as it is off CUDA (the interpreter's tests)
        return grouping_torch.group_queries(q, group_size, dims, gather=gather_triton.gather_rows,
                                            partition=grouping_graph.group_points)
    announce("group_queries", q, "torch", "one PyTorch implementation for every backend")
    return grouping_torch.group_queries(q, group_size, dims)


def release_graphs() -> bool:
    """Free the query grouping's CUDA graphs and their memory (grouping_graph.release; the engine calls it at the end
    of each run and when it makes room after running out of memory). Returns whether any was dropped."""
    return grouping_graph.release()


def pooled_block_scores(q, k, *, block_q, block_k, scale=None, backend="auto"):
    """Softmax of mean-pooled Q vs mean-pooled K -> fp32 (B,H,nqb,nkb) (PyTorch ops on any device)."""
    check_backend(backend)
    announce("pooled_block_scores", q, "torch", "one PyTorch implementation for every backend")
    return selection_torch.pooled_block_scores(q, k, block_q=block_q, block_k=block_k, scale=scale)


def group_kv_mass(q, k, lse, q_groups, *, scale=None, backend="auto", validate=True):
    """Exact per-group KV attention mass -> fp32 (B,H,G,Nk) (pass 2 of exact selection)."""
    if choose(backend, q, _why_not(q, _group_size(q_groups)), "group_kv_mass") == "triton":
        from . import mass_triton
        q, k = _addressable(q, k)
        return mass_triton.group_kv_mass(q, k, lse, q_groups, scale=scale, validate=validate)
    return selection_torch.group_kv_mass(q, k, lse, q_groups, scale=scale, validate=validate)


def keep_at_threshold(scores, thresh, k, *, cap=None, backend="auto"):
    """A row threshold applied with a budget: scores float (..., L), thresh (..., 1) of its dtype, k int, cap None or
    an int >= k -> bool (..., L), the entries above the threshold plus ties in index order up to k a row, at most
    ``cap`` a row (+inf entries aside) where cap is given (threshold_torch.keep_at_threshold)."""
    threshold_torch.check_threshold_args(scores, thresh, k, cap)
    why = None if scores.dtype in FLOAT_DTYPES else f"dtype {scores.dtype} is not supported"
    if choose(backend, scores, why, "keep_at_threshold") == "triton":
        from . import threshold_triton
        return threshold_triton.keep_at_threshold(scores, thresh, k, cap)
    return threshold_torch.keep_at_threshold(scores, thresh, k, cap)


def compact_keep(keep, *, segment=compact_torch.SEGMENT, width=None, backend="auto"):
    """Kept-token mask bool (..., L) -> compact sorted lists (kv_low int16 (..., W), seg_ends int32 (..., S), counts
    int32 (...)), the format of mc_sparse's cached selections (compact_torch.compact_keep); ``width``: a bound on
    every row's count known on the host (nothing read back), or None."""
    compact_torch.check_compact_args(keep, segment)
    if choose(backend, keep, None, "compact_keep") == "triton":
        from . import compact_triton
        return compact_triton.compact_keep(keep, segment, width)
    return compact_torch.compact_keep(keep, segment, width)
