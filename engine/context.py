"""What the engine knows about one attention call besides the tensors: its token layout and its identity."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .modalities import KIND_MODALITY, KINDS


@dataclass(frozen=True)
class Segment:
    """A contiguous run of tokens of one kind in the self-attention sequence.

    kind: text | pad | video | image | voxels | tokens | audio | ref | cond (engine/modalities.py maps each to
    its modality). length: number of tokens, or None for "the rest of the sequence" (at most one open segment
    per layout). grid: (F, H, W) of the segment's tokens in raster order (frames outermost; an image has F = 1),
    or None for a 1-D run (tokens ordered in time or in an unknown order). label: what the model calls the
    segment (reports only).
    """

    kind: str
    length: int | None = None
    grid: tuple[int, int, int] | None = None
    label: str = ""

    def __post_init__(self):
        if self.kind not in KIND_MODALITY:
            raise ValueError(f"segment kind: must be one of {KINDS}, got {self.kind!r}")
        if self.length is not None and (not isinstance(self.length, int) or self.length < 0):
            raise ValueError(f"segment length: must be a non-negative integer or None, got {self.length!r}")
        if self.grid is not None:
            grid = tuple(int(g) for g in self.grid)
            if len(grid) != 3 or min(grid) < 1:
                raise ValueError(f"segment grid: must be three positive sizes (F, H, W), got {self.grid!r}")
            object.__setattr__(self, "grid", grid)
            if self.length is not None and math.prod(grid) != self.length:
                raise ValueError(f"segment {self.kind}: grid {grid} holds {math.prod(grid)} tokens, not {self.length}")

    @property
    def modality(self) -> str:
        return KIND_MODALITY[self.kind]

    def describe(self, length: int | None = None) -> str:
        """'video 3x6x8', 'text 7', 'ref 48 (reference_latent)'."""
        n = self.length if length is None else length
        if self.grid is not None:
            size = "x".join(map(str, self.grid if self.grid[0] > 1 else self.grid[1:]))
        else:
            size = "rest" if n is None else str(n)
        return f"{self.kind} {size}" + (f" ({self.label})" if self.label else "")


@dataclass(frozen=True)
class Span:
    """A segment placed in a sequence: tokens [start, stop)."""

    start: int
    stop: int
    segment: Segment

    @property
    def length(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, init=False)
class TokenLayout:
    """The self-attention sequence as named segments in order (docs/method.md, "Modalities").

    Two ways to build one:

    - ``TokenLayout(segments=(Segment("text", 7), Segment("audio", 20), Segment("video", grid=(3, 6, 8))))``;
    - the text/grid form ``TokenLayout(text_len, text_first, grid, extra_len)``: text_len text tokens leading
      the sequence (text_first) or trailing it, the image tokens (an F x H x W grid when known, else 1-D) in
      between taking the rest, and extra_len reference tokens after the image tokens. ``TokenLayout()`` is one
      1-D run of image tokens.

    A layout fits a sequence of n tokens when its fixed lengths add up to n (an open segment takes the rest,
    and a grid on it must hold exactly that many tokens); ``misfit(n)`` says why it does not.
    """

    segments: tuple[Segment, ...]

    def __init__(self, text_len: int = 0, text_first: bool = True, grid: tuple[int, int, int] | None = None,
                 extra_len: int = 0, *, segments=None):
        if segments is None:
            image = Segment("image", None, grid)
            text = (Segment("text", int(text_len)),) if text_len else ()
            extra = (Segment("ref", int(extra_len)),) if extra_len else ()
            segments = (*text, image, *extra) if text_first else (image, *extra, *text)
        segments = tuple(segments)
        if not segments or not all(isinstance(s, Segment) for s in segments):
            raise ValueError("layout segments: expected a non-empty sequence of Segment")
        if sum(s.length is None for s in segments) > 1:
            raise ValueError("layout segments: at most one segment may take the rest of the sequence")
        object.__setattr__(self, "segments", segments)

    @classmethod
    def of(cls, *segments: Segment) -> "TokenLayout":
        return cls(segments=segments)

    # placing the layout in a sequence -------------------------------------------------------------------
    def misfit(self, n: int) -> str | None:
        """Why this layout cannot describe a sequence of n tokens (None when it can)."""
        fixed = sum(s.length for s in self.segments if s.length is not None)
        open_seg = next((s for s in self.segments if s.length is None), None)
        if open_seg is None:
            return None if fixed == n else f"{n} tokens, layout {self.describe()} has {fixed}"
        rest = n - fixed
        if rest < 0:
            return f"{n} tokens, layout {self.describe()} needs at least {fixed}"
        if open_seg.grid is not None and math.prod(open_seg.grid) != rest:
            return f"{n} tokens leave {rest} for {open_seg.describe()}, whose grid holds {math.prod(open_seg.grid)}"
        return None

    def spans(self, n: int) -> tuple[Span, ...]:
        """The segments placed in a sequence of n tokens; ValueError (naming the layout) when it does not fit."""
        why = self.misfit(n)
        if why is not None:
            raise ValueError(f"layout: does not fit the call ({why})")
        fixed = sum(s.length for s in self.segments if s.length is not None)
        out, pos = [], 0
        for s in self.segments:
            length = s.length if s.length is not None else n - fixed
            out.append(Span(pos, pos + length, s))
            pos += length
        return tuple(out)

    def closed(self, n: int) -> "TokenLayout":
        """This layout with the open segment's length filled in for n tokens (itself when it does not fit n, so
        the misfit stays visible)."""
        if self.misfit(n) is not None or all(s.length is not None for s in self.segments):
            return self
        return TokenLayout(segments=tuple(sp.segment if sp.segment.length is not None else
                                          Segment(sp.segment.kind, sp.length, sp.segment.grid, sp.segment.label)
                                          for sp in self.spans(n)))

    def describe(self, n: int | None = None) -> str:
        """'text 7 | audio 20 | video 3x6x8' (with n: the open segment's length filled in, empty ones left out)."""
        if n is not None and self.misfit(n) is None:
            parts = [sp.segment.describe(sp.length) for sp in self.spans(n) if sp.length]
            return " | ".join(parts) + f" = {n}"
        return " | ".join(s.describe() for s in self.segments)

    @property
    def has_generated_tokens(self) -> bool:
        """Whether any segment holds generated tokens (image/video/3-D or audio) rather than text or references."""
        return any(s.modality in ("image", "audio") and s.length != 0 for s in self.segments)

    # the text/grid view (layouts built the old way read back the same) ---------------------------------
    @property
    def text_len(self) -> int:
        return sum(s.length or 0 for s in self.segments if s.modality == "text")

    @property
    def text_first(self) -> bool:
        mods = [s.modality for s in self.segments]
        return "text" not in mods or "image" not in mods or mods.index("text") < mods.index("image")

    @property
    def extra_len(self) -> int:
        return sum(s.length or 0 for s in self.segments if s.modality == "ref")

    @property
    def grid(self) -> tuple[int, int, int] | None:
        """The grid of the largest image segment (None when it has none)."""
        main = self._main_image()
        return None if main is None else main.grid

    def _main_image(self) -> Segment | None:
        images = [s for s in self.segments if s.modality == "image"]
        if not images:
            return None
        return max(images, key=lambda s: float("inf") if s.length is None else s.length)

    def image_span(self, n: int) -> tuple[int, int]:
        """[start, end) of the largest image segment in a sequence of n tokens ((0, 0) without one)."""
        main = self._main_image()
        for sp in self.spans(n):
            if sp.segment is main:
                return sp.start, sp.stop
        return 0, 0


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
