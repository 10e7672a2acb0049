"""What the engine knows about one attention call besides the tensors."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLayout:
    """Where the text and the image/video/3D tokens sit in the joint sequence.

    text_len: number of text tokens; text_first: True when they lead the sequence (Flux, HunyuanVideo,
    Qwen, Lumina, SD3, Hunyuan3D 2.0), False when they trail it (HiDream). grid: (F, H, W) of the image
    tokens in raster order when known (video: frames; images F = 1), else None (treated as 1-D).
    extra_len: reference/extra tokens after the grid (kept dense like text).
    """

    text_len: int = 0
    text_first: bool = True
    grid: tuple[int, int, int] | None = None
    extra_len: int = 0

    def image_span(self, n: int) -> tuple[int, int]:
        """[start, end) of the grid tokens in a sequence of n tokens."""
        start = self.text_len if self.text_first else 0
        end = n - (0 if self.text_first else self.text_len) - self.extra_len
        return start, max(start, end)


@dataclass(frozen=True)
class CallContext:
    """One attention call: layer index, self/cross, batch-chunk identity, step and token layout.

    layer: index of the transformer block (per forward; counted when the model does not say).
    is_self: self-attention (query and key sequences are the same tokens).
    chunk: identity of the batch chunk (e.g. cond/uncond order), part of every cache key.
    step: denoising step index within the whole run (0-based; a sampler that continues a run split across
        samplers starts at the step where the run stands, engine/schedule.py); total_steps: the run's step
        count when known (fractions of the run in the schedule resolve against it).
    """

    layer: int
    step: int
    is_self: bool = True
    chunk: tuple = ()
    total_steps: int | None = None
    layout: TokenLayout = TokenLayout()

    def key(self, n_tokens: int) -> tuple:
        """Cache key: layer, self/cross, batch chunk, token count."""
        return (self.layer, self.is_self, self.chunk, n_tokens)
