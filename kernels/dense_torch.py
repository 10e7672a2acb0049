"""Dense attention, PyTorch twin of the Triton dense kernel (also pass 1 of exact selection)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _torch_softmax as core
from ._checks import check_qkv, check_scale


def attention_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                    return_lse: bool = False):
    """Dense softmax attention through the device's ``scaled_dot_product_attention``.

    q: (B, H, Nq, D); k, v: (B, H, Nk, D); fp16, bf16 or fp32 (one dtype; SDPA runs in it with an fp32
    softmax). scale: softmax scale, default D**-0.5.
    Returns out (B, H, Nq, D) in q's dtype, and with ``return_lse`` also lse (B, H, Nq) fp32 (natural log).

    The LSE comes from the SDPA op that returns it on CPU (flash kernel) and CUDA (flash / memory-efficient
    kernels); elsewhere (e.g. Apple MPS) from a chunked fp32 ``matmul`` + ``logsumexp``. Where SDPA may
    materialise the scores (devices outside ``_torch_softmax.FUSED_SDPA_DEVICES``) the call is cut into
    query chunks of at most ``CHUNK_ELEMS`` scores. Ops: scaled_dot_product_attention, matmul, logsumexp.
    """
    b, h, nq, nk, d = check_qkv(q, k, v)
    scale = check_scale(scale, d)
    if core.fused_sdpa(q.device):
        if return_lse:
            res = core.dense_with_lse(q, k, v, scale)
            if res is not None:
                return res
            return F.scaled_dot_product_attention(q, k, v, scale=scale), core.dense_lse_fallback(q, k, scale)
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    out = torch.empty_like(q)
    step = max(1, core.CHUNK_ELEMS // max(1, b * h * nk))
    for s0 in range(0, nq, step):
        out[:, :, s0:s0 + step] = F.scaled_dot_product_attention(q[:, :, s0:s0 + step], k, v, scale=scale)
    return (out, core.dense_lse_fallback(q, k, scale)) if return_lse else out
