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
    kv_expanded: bool = False  # grouped-query k/v repeated to the query heads (the dense path drops enable_gqa)

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
    gqa = bool(kwargs.get("enable_gqa"))
    if skip_reshape:
        qh, kh, vh = q, k, v
    else:
        if q.dim() != 3:
            return "an unexpected call signature"
        b, _, hd = q.shape
        if hd % heads:
            return "an unexpected call signature"
        d = hd // heads
        qh = q.reshape(b, -1, heads, d).transpose(1, 2)
        # k/v may arrive as (B, N, H*D) or already split (B, N, H, D) (SD3 passes v that way): views either way;
        # grouped-query k/v carry fewer heads of the same width
        kvh = (k.shape[-1] // d if k.dim() == 3 else k.shape[-2]) if gqa else heads
        if gqa and (k.shape[-1] % d if k.dim() == 3 else k.shape[-1] != d):
            return "an unexpected call signature"
        kh, vh = (t.reshape(b, -1, kvh, d).transpose(1, 2) for t in (k, v))
    if qh.dim() != 4 or kh.dim() != 4 or vh.dim() != 4:
        return "an unexpected call signature"
    expanded = False
    if gqa and kh.shape[1] != qh.shape[1]:
        # grouped-query attention (OmniGen2, Boogu: 3-4 query heads per k/v head): query head i reads k/v head
        # i // group, as torch's enable_gqa does; the kernels take equal heads, so k/v are repeated to them
        if kh.shape[1] != vh.shape[1] or kh.shape[1] == 0 or qh.shape[1] % kh.shape[1]:
            return "grouped-query attention"
        group = qh.shape[1] // kh.shape[1]
        kh, vh = kh.repeat_interleave(group, dim=1), vh.repeat_interleave(group, dim=1)
        expanded = True
    return AttentionCall(qh, kh, vh, int(heads), kwargs.get("transformer_options") or {},
                         kwargs.get("skip_output_reshape", False), expanded)
