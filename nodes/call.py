"""ComfyUI's attention-override call, translated: the arguments of one call, q/k/v in (B, H, N, D), and the
output converted back to the layout the caller expects.

Contract (comfy/ldm/modules/attention.py): ``fn(func, q, k, v, heads, mask=None, attn_precision=None,
skip_reshape=False, skip_output_reshape=False, **kwargs)``; q/k/v are (B, N, H*D) unless ``skip_reshape``
(then (B, H, N, D)); the output is (B, N, H*D) unless ``skip_output_reshape``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionCall:
    """One override call. q, k, v: (B, H, N, D) views of the caller's tensors."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    heads: int
    transformer_options: dict
    skip_output_reshape: bool

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """(B, H, N, D) -> the layout the caller asked for."""
        if self.skip_output_reshape:
            return out
        b, h, n, d = out.shape
        return out.transpose(1, 2).reshape(b, n, h * d)


def translate(args: tuple, kwargs: dict) -> AttentionCall | str:
    """The call as an AttentionCall, or the reason it cannot be one (its calls then run dense, untouched)."""
    if len(args) < 3:
        return "an unexpected call signature"
    q, k, v = args[:3]
    heads = args[3] if len(args) > 3 else kwargs.get("heads")
    mask = args[4] if len(args) > 4 else kwargs.get("mask")
    if heads is None or not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "an unexpected call signature"
    if mask is not None:
        return "calls with an attention mask"
    skip_reshape = kwargs.get("skip_reshape", False)
    if kwargs.get("enable_gqa") and k.shape[-3 if skip_reshape else -1] != q.shape[-3 if skip_reshape else -1]:
        return "grouped-query attention"
    if skip_reshape:
        qh, kh, vh = q, k, v
    else:
        if q.dim() != 3:
            return "an unexpected call signature"
        b, _, hd = q.shape
        if hd % heads:
            return "an unexpected call signature"
        d = hd // heads
        # k/v may arrive as (B, N, H*D) or already split (B, N, H, D) (SD3 passes v that way): views either way
        qh, kh, vh = (t.reshape(b, -1, heads, d).transpose(1, 2) for t in (q, k, v))
    if qh.dim() != 4:
        return "an unexpected call signature"
    return AttentionCall(qh, kh, vh, int(heads), kwargs.get("transformer_options") or {},
                         kwargs.get("skip_output_reshape", False))
