"""Dense attention, PyTorch twin of the Triton dense kernel (also pass 1 of exact selection)."""

from __future__ import annotations

import torch

from ._checks import check_qkv, check_scale
from ._torch_softmax import attend, rows_per_chunk


def attention_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                    return_lse: bool = False):
    """Dense softmax attention, chunked over query rows so memory stays bounded.

    q: (B, H, Nq, D); k, v: (B, H, Nk, D); fp16, bf16 or fp32 (one dtype). fp32 accumulation.
    scale: softmax scale, default D**-0.5.
    Returns out (B, H, Nq, D) in q's dtype, and with ``return_lse`` also lse (B, H, Nq) fp32
    (natural log).
    """
    b, h, nq, nk, d = check_qkv(q, k, v)
    scale = check_scale(scale, d)
    out = torch.empty_like(q)
    lse = torch.empty((b, h, nq), dtype=torch.float32, device=q.device)
    step = rows_per_chunk(h * nk * 2, nq)  # scores + probabilities per query row and head
    for bi in range(b):
        kf = k[bi].float()
        vf = v[bi].float()
        for s0 in range(0, nq, step):
            o, row_lse = attend(q[bi, :, s0:s0 + step].float(), kf, vf, None, scale)
            out[bi, :, s0:s0 + step] = o.to(q.dtype)
            lse[bi, :, s0:s0 + step] = row_lse
    return (out, lse) if return_lse else out
