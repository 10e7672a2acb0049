"""Dense attention through cuDNN's fused SDPA, which also returns the row LSE.

On Hopper cuDNN's attention is the fastest dense kernel available to PyTorch (docs/benchmarks.md: ~570 TF/s
against ~420 for our Triton kernel, docs/benchmarks.md), so ``backend="auto"`` uses it for dense
calls it supports (CUDA, fp16/bf16) and falls back to the Triton kernel if the
op is missing or refuses the case (logged once).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)
_failed: set[str] = set()


def supported(q: torch.Tensor) -> bool:
    """cuDNN path: CUDA tensors in fp16/bf16, head dim <= 128 and a multiple of 8."""
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] <= 128 and q.shape[-1] % 8 == 0 and "op" not in _failed
            and hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"))


def attention_dense(q, k, v, *, scale, return_lse):
    """q: (B,H,Nq,D), k/v: (B,H,Nk,D) fp16/bf16 CUDA -> out (B,H,Nq,D) [+ lse (B,H,Nq) fp32], or None
    when cuDNN refuses the case (the caller then runs the Triton kernel)."""
    try:
        return _run(q, k, v, scale, return_lse)
    except (RuntimeError, TypeError) as exc:
        first = exc
    if not all(t.is_contiguous() for t in (q, k, v)):
        try:  # cuDNN refuses some strided layouts: a contiguous copy is cheap next to the attention
            return _run(q.contiguous(), k.contiguous(), v.contiguous(), scale, return_lse)
        except (RuntimeError, TypeError) as exc:
            first = exc
    if "op" not in _failed:
        log.info("sparse attention: cuDNN dense attention unavailable (%s); using the Triton kernel",
                 str(first).splitlines()[0][:200])
        _failed.add("op")
    return None


def _run(q, k, v, scale, return_lse):
    if not return_lse:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, scale=scale)
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False, scale=scale)
    out, lse = res[0], res[1]
    return out, lse.reshape(q.shape[0], q.shape[1], q.shape[2]).float()
