"""ComfyUI's attention-override call, translated: the arguments of one call, q/k/v in (B, H, N, D), and the
output converted back to the layout the caller expects.

Contract (comfy/ldm/modules/attention.py): ``fn(func, q, k, v, heads, mask=None, attn_precision=None,
skip_reshape=False, skip_output_reshape=False, **kwargs)``; q/k/v are (B, N, H*D) unless ``skip_reshape``
(then (B, H, N, D)); the output is (B, N, H*D) unless ``skip_output_reshape``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.engine import with_query_heads


@dataclass
class AttentionCall:
    """One override call. q: (B, H, N, D), k, v: (B, H / kv_group, N, D) views of the caller's tensors (grouped-
    query attention passes fewer k/v heads: the engine repeats them for its sparse calls, ``kv`` for a recording)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    heads: int
    transformer_options: dict
    skip_output_reshape: bool
    kv_group: int = 1  # query heads per k/v head

    def kv(self, row: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """k and v with the query's heads: (B, H, N, D), or (H, N, D) of batch ``row``; query head i reads k/v head
        i // kv_group, as torch's ``enable_gqa`` does. Copies only for grouped-query calls (only the row asked)."""
        if row is None:
            return with_query_heads(self.q, self.k, self.v)
        k, v = with_query_heads(self.q[row:row + 1], self.k[row:row + 1], self.v[row:row + 1])
        return k[0], v[0]

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """(B, H, N, D) -> the layout the caller asked for."""
        if self.skip_output_reshape:
            return out
        b, h, n, d = out.shape
        return out.transpose(1, 2).reshape(b, n, h * d)


def _mask_of(args: tuple, kwargs: dict):
    """The call's attention mask (positional 5th argument or keyword), or None."""
    return args[4] if len(args) > 4 else kwargs.get("mask")


def carries_mask(args: tuple, kwargs: dict) -> bool:
    """Whether the call passes an attention mask."""
    return _mask_of(args, kwargs) is not None


def translate(args: tuple, kwargs: dict, ignore_mask: bool = False) -> AttentionCall | str:
    """The call as an AttentionCall, or the reason it cannot be one (its calls then run dense, untouched).
    ``ignore_mask``: the call's key mask, (B, 1, 1, Nk), is known to change nothing (its family said so for this
    forward); a mask of another shape (a patch's own) still runs the call dense."""
    if len(args) < 3:
        return "an unexpected call signature"
    q, k, v = args[:3]
    heads = args[3] if len(args) > 3 else kwargs.get("heads")
    if heads is None or not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "an unexpected call signature"
    mask = _mask_of(args, kwargs)
    if mask is not None and not ignore_mask:
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
        if not gqa and k.dim() == 3 and k.shape[-1] != hd:
            return "an unexpected call signature"  # k of another width: its heads cannot be read
        qh = q.reshape(b, -1, heads, d).transpose(1, 2)
        # k/v may arrive as (B, N, H*D) or already split (B, N, H, D) (SD3 passes v that way): views either way;
        # grouped-query k/v carry fewer heads of the same width
        kvh = (k.shape[-1] // d if k.dim() == 3 else k.shape[-2]) if gqa else heads
        if gqa and (k.shape[-1] % d if k.dim() == 3 else k.shape[-1] != d):
            return "an unexpected call signature"
        kh, vh = (t.reshape(b, -1, kvh, d).transpose(1, 2) for t in (k, v))
    if qh.dim() != 4 or kh.dim() != 4 or vh.dim() != 4 or kh.shape[:3] != vh.shape[:3]:
        return "an unexpected call signature"
    if mask is not None and tuple(getattr(mask, "shape", ())) not in ((kh.shape[0], 1, 1, kh.shape[2]),
                                                                       (1, 1, 1, kh.shape[2])):
        return "calls with an attention mask"  # ignore_mask covers a family's key mask (B, 1, 1, Nk) only
    group = 1
    if kh.shape[1] != qh.shape[1] or vh.shape[1] != kh.shape[1]:
        # grouped-query attention (OmniGen2, Boogu: 3-4 query heads per k/v head): repeated to the query heads only
        # on the engine's sparse path (dense calls keep the model's own grouped-query attention)
        if not gqa or vh.shape[1] != kh.shape[1] or kh.shape[1] == 0 or qh.shape[1] % kh.shape[1]:
            return "grouped-query attention"
        group = qh.shape[1] // kh.shape[1]
    return AttentionCall(qh, kh, vh, int(heads), kwargs.get("transformer_options") or {},
                         kwargs.get("skip_output_reshape", False), group)
