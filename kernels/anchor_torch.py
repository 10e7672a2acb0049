"""Anchor attention for block selections, PyTorch twin of the fused Triton kernel (``anchor_triton``).

An anchor step needs the dense output (returned to the model) and the residual R = dense - sparse over
the step's block selection (cached for the reuse steps). The twin composes the dense and block-sparse
twins; the Triton kernel does both in one pass over the KV blocks.
"""

from __future__ import annotations

import torch

from . import block_sparse_torch, dense_torch
from ._residual import encode_residual, mass_of


def block_anchor_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_indices: torch.Tensor,
                           kv_counts: torch.Tensor, *, block_q: int, block_k: int, scale: float | None = None,
                           residual_precision: str = "model", return_lse: bool = False, validate: bool = True,
                           return_mass: bool = False):
    """Dense attention plus the residual of block-sparse attention over the given block lists.

    q: (B, H, Nq, D); k, v: (B, H, Nk, D); fp16/bf16/fp32. kv_indices int32 (B, H, ceil(Nq/block_q), max_k)
    sorted within kv_counts int32 (B, H, ceil(Nq/block_q)); block_q, block_k: 64 or 128.
    residual_precision: "model" -> R in q's dtype, scale None; "fp8" -> float8_e4m3fn R with an fp32
    (B, H, Nq, 1) per-row scale (row amax / 448, 1 for all-zero rows).
    Returns (out_dense (B, H, Nq, D) in q's dtype, (r_data, r_scale)) where R = out_dense - out_sparse is
    computed in fp32 (a row with an empty list has R = out_dense); with ``return_lse`` also the dense
    row LSE (B, H, Nq) fp32 in the middle: (out_dense, lse, (r_data, r_scale)). With ``return_mass`` the residual
    is a (r_data, r_scale, mass) triple, mass fp32 (B, H, Nq, 2) (kernels/_residual.py, ``mass_of``): what a reuse
    call needs to weight R by the selected keys' mass.
    """
    out, lse = dense_torch.attention_dense(q, k, v, scale=scale, return_lse=True)
    res = block_residual(q, k, v, kv_indices, kv_counts, out, lse, block_q=block_q, block_k=block_k, scale=scale,
                         residual_precision=residual_precision, validate=validate, return_mass=return_mass)
    return (out, lse, res) if return_lse else (out, res)


def block_residual(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_indices: torch.Tensor,
                   kv_counts: torch.Tensor, dense: torch.Tensor, lse: torch.Tensor, *, block_q: int, block_k: int,
                   scale: float | None = None, residual_precision: str = "model", validate: bool = True,
                   return_mass: bool = False):
    """The residual of block-sparse attention against a dense output computed before (the anchor composed of one
    dense call and one sparse call; the Triton twin forms R in the sparse kernel's epilogue).

    q, k, v, kv_indices, kv_counts, block_q, block_k, scale, residual_precision as in ``block_anchor_attention``;
    dense: (B, H, Nq, D) the dense attention output of the same q, k, v in q's dtype; lse: fp32 (B, H, Nq) its row
    LSE (natural log; read only with ``return_mass``). Returns (r_data, r_scale) of R = dense - sparse, or with
    ``return_mass`` (r_data, r_scale, mass fp32 (B, H, Nq, 2)).
    """
    sparse = block_sparse_torch.block_sparse_attention(q, k, v, kv_indices, kv_counts, block_q=block_q,
                                                       block_k=block_k, scale=scale, validate=validate,
                                                       return_lse=return_mass)
    if return_mass:
        sparse, lse_sparse = sparse
    res = residual_of(dense, sparse, residual_precision)
    return (*res, mass_of(lse, lse_sparse)) if return_mass else res


def residual_of(dense: torch.Tensor, sparse: torch.Tensor, precision: str, return_sums: bool = False):
    """Residual pair of dense - sparse ((B, H, N, D) each), formed in fp32 a few heads at a time and encoded as
    ``precision``, in dense's dtype (the composed anchor's R where no kernel forms it in its epilogue). With
    ``return_sums``: (pair, fp32 (2,) [sum of R^2, sum of dense^2]) on dense's device, R^2 of R in fp32 before
    encoding. Twin of ``residual_encode_triton.residual_of``."""
    sums = torch.zeros(2, dtype=torch.float32, device=dense.device) if return_sums else None
    pair = encode_residual(dense, precision, dense.dtype, minus=sparse, sums=sums)  # one pass, the sums with it
    return (pair, sums) if return_sums else pair
