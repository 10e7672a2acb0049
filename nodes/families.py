"""The model-family registry: every fact the pack knows about a ComfyUI model family, in one table.

Per family: how it is detected (its ``comfy.ldm.<module>`` package), the segments of its self-attention
sequence (text, video/image grid, audio, reference tokens: engine/context.py), how latent cells map to tokens,
which of its self-attention calls are its main blocks and how every call is numbered for users (model order:
Flux-style single-stream blocks continue after the double-stream ones; refiner and other extra self-attention
calls come after all main blocks), which module's attention bypasses ComfyUI's override hook, and the preset
that suits it. docs/families.md lists what each ComfyUI 0.33.0 family sends through the hook; adding a family is
one entry in FAMILIES, or a subclass when its layout needs more than the fields say (docs/architecture.md,
"Adding a model family"). Nothing here imports ComfyUI: the diffusion model and the conditioning are read as
plain objects.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..engine import TokenLayout
from ..engine.context import Segment

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Family:
    """name: the family's one spelling (logs, reports). modules: dotted ``comfy.ldm`` module paths that identify
    it (the longest match wins: ``lightricks.av_model`` before ``lightricks``). joint_text: text tokens are part
    of the self-attention sequence (text_first: at its start, else at its end); otherwise text is attended
    through separate cross-attention. patch: (t, h, w) latent cells per token; model_patch: read it from the
    diffusion model's ``patch_size`` instead (models of one class with different patches). latent: "grid" (latent
    (B, C, [T,] H, W) in raster order) or "set" (an unordered (B, C, N) token set). indexed: its main blocks set
    ``block_index`` (a self-attention call without one, or a second one in the same block, is an extra call).
    blocks: attributes of the diffusion model holding its main blocks (their count is where extra calls'
    numbers start). bypass_module: the module whose ``optimized_attention`` calls pass no
    ``transformer_options`` (routed through the hook per forward by the patch). preset: the preset name, or a
    function of the diffusion model. facts: what ``bind`` read off one diffusion model (class, patch, blocks).
    """

    name: str
    modules: tuple[str, ...]
    joint_text: bool
    text_first: bool = True
    patch: tuple[int, int, int] = (1, 2, 2)
    latent: str = "grid"
    bypass_module: str | None = None
    preset: str | Callable[[object], str] = "balanced"
    indexed: bool = False
    blocks: tuple[str, ...] = ()
    model_patch: bool = False
    image_kind: str = "video"
    facts: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    # binding to one diffusion model ---------------------------------------------------------------------
    def bind(self, diffusion_model) -> "Family":
        """This family with the facts of one diffusion model (its class, patch size, block count, ...)."""
        return dataclasses.replace(self, facts=self.read_facts(diffusion_model))

    def read_facts(self, dm) -> dict:
        cls = type(dm)
        facts = {"class": f"{cls.__module__}.{cls.__qualname__}", "blocks": _count_blocks(dm, self.blocks)}
        if self.indexed and _sets_block_index(cls) is False:
            facts["indexed"] = False  # an older ComfyUI whose blocks do not report block_index yet
        if self.model_patch:
            patch = _patch_of(dm)
            if patch is not None:
                facts["patch"] = patch
        return facts

    @property
    def is_indexed(self) -> bool:
        """Whether this model's main blocks report ``block_index`` (the field, unless its source says not)."""
        return self.facts.get("indexed", self.indexed)

    @property
    def token_patch(self) -> tuple[int, int, int]:
        return self.facts.get("patch", self.patch)

    # layout -------------------------------------------------------------------------------------------
    def latent_grid(self, x_shape) -> tuple[int, int, int] | None:
        """(F, H, W) token grid of a latent (B, C, [T,] H, W) after patchification (None for a token set)."""
        if self.latent != "grid" or x_shape is None or len(x_shape) < 4:
            return None
        pt, ph, pw = self.token_patch
        t, h, w = (x_shape[2], x_shape[3], x_shape[4]) if len(x_shape) == 5 else (1, x_shape[2], x_shape[3])
        return (math.ceil(t / pt), math.ceil(h / ph), math.ceil(w / pw))

    def image_grid(self, x_shape, transformer_options: dict, conds: dict) -> tuple[int, int, int] | None:
        """The grid of the generated tokens: ``grid_sizes`` when the model exports it, else from the latent."""
        grid = transformer_options.get("grid_sizes")
        if grid is not None and len(grid) == 3:
            return tuple(int(g) for g in grid)
        return self.latent_grid(x_shape)

    def stream(self, forward, nq: int, nk: int, width: int, transformer_options: dict) -> str | None:
        """Which sequence a self-attention call runs over: "main" (the blocks' joint or video sequence), "extra"
        (refiners, extra passes over part of the sequence) or another named stream (LTX-2 "audio"); None for a
        cross-attention call. Families without block indices tell extra calls by their size."""
        if nq != nk:
            return None
        if self.is_indexed:
            return "main"
        n_img = forward.image_tokens()
        if n_img and (nq < n_img or (self.joint_text and nq == n_img)):
            return "extra"
        return "main"

    def layout(self, n_tokens: int, x_shape, transformer_options: dict, conds: dict | None = None,
               stream: str = "main") -> TokenLayout:
        """Token layout of a self-attention call over ``n_tokens`` tokens in a forward of latent ``x_shape``
        (conds: the forward's conditioning, as APPLY_MODEL receives it)."""
        return self.build_layout(n_tokens, x_shape, transformer_options, conds or {}, stream).closed(n_tokens)

    def build_layout(self, n_tokens, x_shape, transformer_options, conds, stream) -> TokenLayout:
        grid = self.image_grid(x_shape, transformer_options, conds)
        if stream != "main":
            return self.extra_layout(n_tokens, grid)
        return self.main_layout(n_tokens, x_shape, transformer_options, conds, grid)

    def main_layout(self, n_tokens, x_shape, to, conds, grid) -> TokenLayout:
        refs = to.get("reference_image_num_tokens") or []
        refs = [int(r) for r in refs] if isinstance(refs, (list, tuple)) else [int(refs)]
        ref_segs = tuple(Segment("ref", r, label="reference image") for r in refs if r)
        if grid is None and self.latent == "set" and x_shape is not None and len(x_shape) == 3:
            # conditioning tokens (text, or Hunyuan3D 2.1's time token) before the set, kept dense
            tokens = Segment("tokens", int(x_shape[2]), label="latent set")
            cond = Segment("text", None, label="conditioning" if self.joint_text else "time token")
            return TokenLayout.of(cond, tokens) if self.text_first else TokenLayout.of(tokens, cond)
        if grid is None:
            return TokenLayout()  # a 1-D sequence of image tokens (unknown families: said once in the log)
        image = Segment(self.image_kind, math.prod(grid), grid)
        if self.joint_text:
            text = Segment("text", None)
            return TokenLayout.of(text, image, *ref_segs) if self.text_first else TokenLayout.of(image, *ref_segs, text)
        rest = Segment("ref", None, label="extra tokens")  # reference / in-context tokens after the grid
        return TokenLayout.of(image, *ref_segs, rest)

    def extra_layout(self, n_tokens: int, grid) -> TokenLayout:
        """An extra call (a refiner, an image-only pass): the image tokens when it runs over exactly them (padded
        to the family's multiple, if any), else tokens the pack cannot place — text, kept dense."""
        if grid is not None:
            n_img = math.prod(grid)
            pad = self.facts.get("pad_multiple")
            padded = -(-n_img // pad) * pad if pad else n_img
            if n_tokens == n_img:
                return TokenLayout.of(Segment(self.image_kind, n_img, grid))
            if n_tokens == padded:
                return TokenLayout.of(Segment(self.image_kind, n_img, grid), Segment("pad", padded - n_img))
        return TokenLayout.of(Segment("text", n_tokens, label="refiner / unplaced tokens"))

    # layer numbering ----------------------------------------------------------------------------------
    def layer_offsets(self, diffusion_model) -> dict[str, int]:
        """First layer number per kind of call: Flux-style single-stream blocks ("single") follow the double-
        stream ones; extra self-attention calls ("extra": refiners, VACE passes, x-only passes) follow every
        main block."""
        out = {}
        doubles = getattr(diffusion_model, "double_blocks", None)
        if doubles is not None:
            out["single"] = len(doubles)
        blocks = _count_blocks(diffusion_model, self.blocks)
        if blocks:
            out["extra"] = blocks
        return out

    def mask_is_noop(self, conds: dict) -> bool:
        """Whether the attention mask this family's self-attention calls carry changes nothing for a forward with
        these conditionings (then the pack takes the calls as if unmasked); False: a masked call runs dense."""
        return False

    def preset_for(self, diffusion_model) -> str:
        """Name of the preset that suits this model (presets/<name>.yaml)."""
        return self.preset(diffusion_model) if callable(self.preset) else self.preset

    def presets_by_steps(self, diffusion_model) -> tuple[tuple[int, str], ...]:
        """((most run steps, preset), ...) that replace ``preset_for``'s many-step preset on short runs (distilled
        LoRAs), shortest first; () when the family has none. Used by the Preset node's `auto` once the run's step
        count is known (nodes/patch.py, ``cfg_for``)."""
        return FEW_STEP_PRESETS.get(self.preset_for(diffusion_model), ())

    def describe(self) -> str:
        """One line for the report: the family, and for an unknown one the model class and the assumption."""
        if self.name != "unknown":
            return self.name
        return (f"unknown ({self.facts.get('class', 'model class not known')}): {UNKNOWN_ASSUMPTION}")


UNKNOWN_ASSUMPTION = ("the pack assumes a self-attention sequence of image tokens in one 1-D run (no text, no "
                      "grid); text or audio tokens in it would be made sparse like image tokens — set method "
                      "'dense' if the results suffer")


def _sets_block_index(cls) -> bool | None:
    """Whether the modules defining a model class or the classes it inherits from set ``block_index`` (None when no
    source can be read). ComfyUI added block indices family by family; 0.3.75's Wan, Lumina and Cosmos blocks have
    none; Chroma Radiance inherits Chroma's forward."""
    seen, readable = set(), False
    for klass in cls.__mro__:
        module = sys.modules.get(klass.__module__)
        path = getattr(module, "__file__", None)
        if not path or path in seen or klass.__module__.split(".")[0] in ("torch", "builtins"):
            continue
        seen.add(path)
        try:
            if "block_index" in Path(path).read_text(encoding="utf-8", errors="replace"):
                return True
            readable = True
        except OSError:
            pass
    return False if readable else None


def _count_blocks(dm, names) -> int:
    total = 0
    for name in names:
        blocks = getattr(dm, name, None)
        if blocks is not None:
            try:
                total += len(blocks)
            except TypeError:
                pass
    return total


def _patch_of(dm) -> tuple[int, int, int] | None:
    ps = getattr(dm, "patch_size", None)
    if ps is None:
        ps = getattr(dm, "patch", None)  # Krea 2
    pt = getattr(dm, "patch_size_t", None) or 1
    if isinstance(ps, int):
        return (int(pt), ps, ps)
    if isinstance(ps, (list, tuple)) and all(isinstance(p, int) for p in ps):
        if len(ps) == 3:
            return tuple(ps)
        if len(ps) == 2:
            return (1, *ps)
    return None


def _shape(t) -> tuple | None:
    return tuple(t.shape) if hasattr(t, "shape") else None


# --- families whose layout needs more than the fields ----------------------------------------------------

@dataclass(frozen=True)
class WanFamily(Family):
    """Wan 2.1/2.2 (T2V, I2V, TI2V 5B, Fun, VACE, ...): the video grid from ``grid_sizes``; a reference image
    through ``ref_conv`` is prepended (one frame of tokens, outside the grid), in-context latents appended."""

    def read_facts(self, dm) -> dict:
        facts = super().read_facts(dm)
        facts["ref_conv"] = getattr(dm, "ref_conv", None) is not None
        return facts

    def main_layout(self, n_tokens, x_shape, to, conds, grid) -> TokenLayout:
        if grid is None:
            return TokenLayout()
        video = Segment("video", math.prod(grid), grid)
        ref = _shape(conds.get("reference_latent"))
        if self.facts.get("ref_conv") and ref is not None and len(ref) >= 4:
            _, ph, pw = self.token_patch
            n_ref = (ref[-2] // ph) * (ref[-1] // pw)
            return TokenLayout.of(Segment("ref", n_ref, label="reference image"), video,
                                  Segment("ref", None, label="context latents"))
        return TokenLayout.of(video, Segment("ref", None, label="extra tokens"))


@dataclass(frozen=True)
class HunyuanVideoFamily(Family):
    """HunyuanVideo 1.0/1.5 and HunyuanImage 2.1: text first ([vision | byT5 | text], refined), then the image
    tokens: a ``ref_latent`` (I2V) prepended to the video. The patch (1x2x2 for 1.0, 1x1x1 for 1.5, 2-D for
    HunyuanImage) is read from the model."""

    def main_layout(self, n_tokens, x_shape, to, conds, grid) -> TokenLayout:
        if grid is None:
            return TokenLayout()
        video = Segment(self.image_kind if x_shape is not None and len(x_shape) == 5 else "image",
                        math.prod(grid), grid)
        ref = _shape(conds.get("ref_latent"))
        refs = ()
        if ref is not None and len(ref) == len(x_shape or ()):
            g = self.latent_grid(ref)
            refs = (Segment("ref", math.prod(g), g, label="ref_latent"),) if g is not None else ()
        return TokenLayout.of(Segment("text", None), *refs, video)


@dataclass(frozen=True)
class LuminaFamily(Family):
    """Lumina 2 and Z-Image (one class, NextDiT): caption then image; Z-Image pads the caption and the image
    each to a multiple of ``pad_tokens_multiple`` at their ends. Z-Image Omni's reference tokens lie between
    the caption and the image and count with the caption (dense)."""

    def read_facts(self, dm) -> dict:
        facts = super().read_facts(dm)
        pad = getattr(dm, "pad_tokens_multiple", None)
        if isinstance(pad, int) and pad > 1:
            facts["pad_multiple"] = pad
        return facts

    def main_layout(self, n_tokens, x_shape, to, conds, grid) -> TokenLayout:
        if grid is None:
            return TokenLayout()
        n_img = math.prod(grid)
        image = Segment("image", n_img, grid)
        pad = self.facts.get("pad_multiple")
        tail = (Segment("pad", -(-n_img // pad) * pad - n_img, label="image padding"),) if pad else ()
        tail = tuple(s for s in tail if s.length)
        return TokenLayout.of(Segment("text", None, label="caption and its padding" if pad else ""), image, *tail)


@dataclass(frozen=True)
class HiDreamFamily(Family):
    """HiDream I1/E1: image first, then the text (T5, llama layers). E1's edit image (``image_cond``) is joined
    to the latent along the width before patchifying: one image grid twice as wide, each row [target | edit]."""

    def image_grid(self, x_shape, to, conds):
        grid = super().image_grid(x_shape, to, conds)
        cond = _shape(conds.get("image_cond"))
        if grid is not None and cond is not None and x_shape is not None and len(cond) == len(x_shape):
            _, _, pw = self.token_patch
            grid = (grid[0], grid[1], math.ceil((x_shape[-1] + cond[-1]) / pw))
        return grid

    def main_layout(self, n_tokens, x_shape, to, conds, grid) -> TokenLayout:
        if grid is None:
            return TokenLayout()
        label = "target | edit image side by side" if conds.get("image_cond") is not None else ""
        return TokenLayout.of(Segment("image", math.prod(grid), grid, label=label), Segment("text", None))


@dataclass(frozen=True)
class OmniGen2Family(Family):
    """OmniGen2 and Boogu: refiners over the caption, the image and the reference images (``ref_latents``, their
    own pass over all of them), then joint blocks over [text | refs | image]; Boogu's double blocks add a pass over
    [refs | image]. The refs' token counts come from ``ref_latents`` (each padded to the patch), so those passes are
    told from the joint ones by their size and laid out as reference and image tokens."""

    def ref_tokens(self, conds: dict) -> list[int]:
        refs = conds.get("ref_latents")
        if refs is None:
            return []
        _, ph, pw = self.token_patch
        shapes = [_shape(r) for r in (refs if isinstance(refs, (list, tuple)) else [refs])]
        return [math.ceil(s[-2] / ph) * math.ceil(s[-1] / pw) for s in shapes if s is not None and len(s) >= 4]

    def stream(self, forward, nq: int, nk: int, width: int, transformer_options: dict) -> str | None:
        if nq == nk:
            refs = sum(self.ref_tokens(forward.conds))
            if refs and nq in (refs, refs + forward.image_tokens()):
                return "extra"  # the reference refiner; Boogu's [refs | image] pass
        return super().stream(forward, nq, nk, width, transformer_options)

    def build_layout(self, n_tokens, x_shape, transformer_options, conds, stream) -> TokenLayout:
        refs = self.ref_tokens(conds)
        grid = self.image_grid(x_shape, transformer_options, conds)
        if not refs or grid is None:
            return super().build_layout(n_tokens, x_shape, transformer_options, conds, stream)
        image = Segment(self.image_kind, math.prod(grid), grid)
        ref_segs = tuple(Segment("ref", r, label="reference image") for r in refs)
        if stream != "main":
            if n_tokens == sum(refs) + image.length:
                return TokenLayout.of(*ref_segs, image)
            if n_tokens == sum(refs):
                # the reference refiner, kept dense as other refiners are; when the references make as many tokens
                # as the target, the noise refiner has this size too and cannot be told apart: both run dense
                return TokenLayout.of(*ref_segs)
            return super().build_layout(n_tokens, x_shape, transformer_options, conds, stream)
        return TokenLayout.of(Segment("text", None), *ref_segs, image)


@dataclass(frozen=True)
class LensFamily(Family):
    """Lens: [image | text] in every block, with an additive key mask on every call, built from the text mask of the
    conditioning (``attention_mask``; all ones when there is none): zero for image and valid text keys, the dtype's
    minimum for padded text. Without padding it changes nothing."""

    def mask_is_noop(self, conds: dict) -> bool:
        mask = conds.get("attention_mask")
        if mask is None:
            return True
        if not hasattr(mask, "all") or getattr(getattr(mask, "device", None), "type", None) == "meta":
            return False
        return bool(mask.bool().all())


@dataclass(frozen=True)
class LTXVideoFamily(Family):
    """LTX-Video: one token per latent voxel; keyframe guide frames (``keyframe_idxs``) are appended to the
    latent and their surviving tokens follow the generated video."""

    def video_grid(self, x_shape, conds) -> tuple[int, int, int] | None:
        """The generated video's grid: the latent's, less the keyframe guide frames appended to it."""
        grid = self.latent_grid(x_shape)
        if grid is None:
            return None
        f, h, w = grid
        kf = _shape(conds.get("keyframe_idxs"))
        guide_frames = (kf[2] // (h * w)) if kf is not None and len(kf) >= 3 and h * w else 0
        return (f - guide_frames, h, w) if 0 < guide_frames < f else grid

    def image_grid(self, x_shape, to, conds):
        return self.video_grid(x_shape, conds)

    def video_layout(self, n_tokens, x_shape, conds) -> TokenLayout:
        grid = self.video_grid(x_shape, conds)
        if grid is None:
            return TokenLayout()
        return TokenLayout.of(Segment("video", math.prod(grid), grid),
                              Segment("ref", None, label="keyframe guides"))

    def main_layout(self, n_tokens, x_shape, to, conds, grid) -> TokenLayout:
        return self.video_layout(n_tokens, x_shape, conds)


@dataclass(frozen=True)
class LTX2Family(LTXVideoFamily):
    """LTX-2 (audio and video): per block a video self-attention, video<->text, an audio self-attention,
    audio<->text, then audio->video and video->audio cross-attention. The sampler carries a packed latent;
    ``latent_shapes`` gives the video (B, C, F, H, W) and audio (B, C, T, bins) latents. Video self-attention
    calls are the main blocks (numbered 0..L-1); audio self-attention calls are numbered L..2L-1. The streams
    are told apart by the head width (the model's video and audio attention widths differ); when the video and
    audio token counts are equal, the a2v/v2a calls look like self-attention and are told apart by order: only
    the first audio-width call after each video self-attention is the audio self-attention."""

    def read_facts(self, dm) -> dict:
        facts = super().read_facts(dm)
        blocks = getattr(dm, "transformer_blocks", None)
        if blocks:
            b0 = blocks[0]
            for name, attr in (("video_width", "attn1"), ("audio_width", "audio_attn1")):
                mod = getattr(b0, attr, None)
                if mod is not None and hasattr(mod, "heads") and hasattr(mod, "dim_head"):
                    facts[name] = int(mod.heads) * int(mod.dim_head)
        return facts

    def layer_offsets(self, diffusion_model) -> dict[str, int]:
        blocks = _count_blocks(diffusion_model, self.blocks)
        return {"audio": blocks, "extra": 2 * blocks} if blocks else {}

    def image_grid(self, x_shape, to, conds):
        shapes = conds.get("latent_shapes")
        return self.video_grid(tuple(shapes[0]), conds) if shapes else None

    def stream(self, forward, nq, nk, width, to):
        state = forward.state
        vw, aw = self.facts.get("video_width"), self.facts.get("audio_width")
        if vw is not None and width == vw and vw != aw:
            state["audio_self_taken"] = False
            if nq == nk:
                state.setdefault("video_counts", set()).add(nq)
                return "main"
            return None
        if nq != nk:
            return None
        if aw is None or width != aw:
            return "main" if vw is None else None
        shapes = forward.latent_shapes
        video_n = set(state.get("video_counts", set()))
        if shapes and len(shapes[0]) == 5:
            video_n.add(math.prod(shapes[0][2:]))
        if nq in video_n:  # a2v / v2a look self-shaped: only the first audio-width call of the block is self
            if state.get("audio_self_taken"):
                return None
            state["audio_self_taken"] = True
        return "audio"

    def build_layout(self, n_tokens, x_shape, transformer_options, conds, stream) -> TokenLayout:
        shapes = conds.get("latent_shapes")
        if stream == "audio":
            if shapes and len(shapes) > 1 and len(shapes[1]) >= 3:
                frames = int(shapes[1][2])
                return TokenLayout.of(Segment("ref", None, label="reference audio"), Segment("audio", frames))
            return TokenLayout.of(Segment("audio", None))
        if stream != "main":
            return self.extra_layout(n_tokens, None)
        video_shape = tuple(shapes[0]) if shapes else x_shape
        return self.video_layout(n_tokens, video_shape, conds)


@dataclass(frozen=True)
class MiniMaxFamily(Family):
    """MiniMax H3: one packed sequence [text | keyframe or reference rows | audio (2 channels x T, channel-major)
    | video (T x H/2 x W/2)]. Its exact segment table rides in the conditioning (``minimax_payload["layout"]``,
    built once per run); without it the layout is rebuilt from ``latent_shapes`` and the text length. Cond and
    uncond run as separate batch-1 forwards."""

    def build_layout(self, n_tokens, x_shape, transformer_options, conds, stream) -> TokenLayout:
        if stream != "main":
            return self.extra_layout(n_tokens, None)
        packed = (conds.get("minimax_payload") or {}).get("layout")
        segments = getattr(packed, "segments", None)
        shapes = conds.get("latent_shapes")
        video = tuple(shapes[0]) if shapes and len(shapes[0]) == 5 else None
        grid = self.latent_grid(video) if video is not None else None
        if segments:
            return TokenLayout(segments=_minimax_segments(segments, grid))
        if grid is None or not shapes or len(shapes) < 2:
            return TokenLayout()
        audio_t = int(shapes[1][-1])
        return TokenLayout.of(Segment("text", None), Segment("audio", audio_t, label="left channel"),
                              Segment("audio", audio_t, label="right channel"),
                              Segment("video", math.prod(grid), grid))

    def stream(self, forward, nq, nk, width, to):
        if nq != nk:
            return None
        packed = (forward.conds.get("minimax_payload") or {}).get("layout")
        total = getattr(packed, "seq_len", None)
        return "main" if total is None or nq == total else "extra"


def _minimax_segments(segments, grid) -> tuple[Segment, ...]:
    """Segments of a MiniMax H3 PackedLayout table [(start, stop, kind)]: audio rows split per channel (each
    channel's frames are a 1-D run in time), video and keyframe rows as (T, H, W) grids."""
    out = []
    frame = grid[1] * grid[2] if grid is not None else None
    for a, b, kind in segments:
        n = int(b) - int(a)
        if n <= 0:
            continue
        if kind == "text":
            out.append(Segment("text", n))
        elif kind == "video" and grid is not None and n == math.prod(grid):
            out.append(Segment("video", n, grid))
        elif kind in ("audio",) and n % 2 == 0:
            out += [Segment("audio", n // 2, label="left channel"), Segment("audio", n // 2, label="right channel")]
        elif kind in ("cond", "ref_img") and frame and n % frame == 0:
            out.append(Segment("cond" if kind == "cond" else "ref", n, (n // frame, grid[1], grid[2]), label=kind))
        elif kind == "video" or kind == "audio":
            out.append(Segment(kind, n))
        else:  # cond_audio, ref_audio, reference images of another size
            out.append(Segment("cond" if kind.startswith("cond") else "ref", n, label=kind))
    return tuple(out)


@dataclass(frozen=True)
class Trellis2Family(Family):
    """Trellis 2: stage 1 runs over the dense 16^3 voxel grid of its latent (B, C, 16, 16, 16); the shape and
    texture stages over the active voxels (a latent (B, C, N, 1): an ordered sparse set, kept 1-D)."""

    def main_layout(self, n_tokens, x_shape, to, conds, grid) -> TokenLayout:
        if x_shape is not None and len(x_shape) == 5:
            g = tuple(int(s) for s in x_shape[2:])
            return TokenLayout.of(Segment("voxels", math.prod(g), g, label="structure grid"))
        if x_shape is not None and len(x_shape) == 4 and x_shape[-1] == 1:
            return TokenLayout.of(Segment("voxels", int(x_shape[2]), label="active voxels"))
        return TokenLayout()

    def image_grid(self, x_shape, to, conds):
        return tuple(int(s) for s in x_shape[2:]) if x_shape is not None and len(x_shape) == 5 else None


def _wan_preset(dm) -> str:
    dim = getattr(dm, "dim", None)
    if dim == 1536:
        return "wan21_t2v_1.3b"
    if dim == 3072:
        return "wan22_5b_ti2v"
    return "wan21_i2v_14b" if getattr(dm, "model_type", "t2v") == "i2v" else "wan21_t2v_14b"


def _hunyuan_video_preset(dm) -> str:
    ps = _patch_of(dm)
    return "hunyuan_video_1.5" if ps == (1, 1, 1) else "hunyuan_video"


def _lumina_preset(dm) -> str:
    return "z_image" if getattr(dm, "pad_tokens_multiple", None) else "lumina2_zimage"


# The few-step presets `auto` takes for a many-step preset's model on short runs: runs of up to 5 steps (the 4-step
# distilled LoRAs: lightx2v, Lightning 2+2, MiniMax H3 turbo) and of 6-12 steps (the 8-step ones). Measured on the
# quality testbed at 4 and 8 steps: docs/quality.md, "4 steps" and "8 steps".
FEW_STEPS_WAN14B = ((5, "wan21_14b_4step"), (12, "wan21_14b_8step"))
FEW_STEP_PRESETS: dict[str, tuple[tuple[int, str], ...]] = {
    "wan21_t2v_14b": FEW_STEPS_WAN14B,
    "wan21_i2v_14b": FEW_STEPS_WAN14B,
    "minimax_h3": ((5, "minimax_h3_turbo_4step"), (12, "minimax_h3_turbo_8step")),
}

FLUX_BLOCKS = ("double_blocks", "single_blocks")

# The registry: one entry per family.
FAMILIES: tuple[Family, ...] = (
    WanFamily("wan", ("wan",), joint_text=False, indexed=True, blocks=("blocks",), preset=_wan_preset),
    Family("flux", ("flux",), joint_text=True, indexed=True, blocks=FLUX_BLOCKS, model_patch=True,
           image_kind="image", preset="flux"),
    Family("chroma", ("chroma", "chroma_radiance"), joint_text=True, indexed=True, blocks=FLUX_BLOCKS, model_patch=True,
           image_kind="image", preset="flux"),
    HunyuanVideoFamily("hunyuan_video", ("hunyuan_video",), joint_text=True, indexed=True, blocks=FLUX_BLOCKS,
                       model_patch=True, preset=_hunyuan_video_preset),
    Family("qwen_image", ("qwen_image",), joint_text=True, indexed=True, blocks=("transformer_blocks",),
           model_patch=True, image_kind="image", preset="qwen_image"),
    LuminaFamily("lumina", ("lumina",), joint_text=True, indexed=True, blocks=("layers",), model_patch=True,
                 image_kind="image", preset=_lumina_preset),
    Family("krea2", ("krea2",), joint_text=True, indexed=True, blocks=("blocks",), model_patch=True,
           image_kind="image", preset="flux"),
    Family("sd3", ("mmdit",), joint_text=True, blocks=("joint_blocks",), image_kind="image", preset="sd35"),
    HiDreamFamily("hidream", ("hidream",), joint_text=True, text_first=False,
                  blocks=("double_stream_blocks", "single_stream_blocks"), image_kind="image", preset="hidream"),
    LTXVideoFamily("ltxv", ("lightricks",), joint_text=False, patch=(1, 1, 1), blocks=("transformer_blocks",),
                   preset="ltx_video"),
    LTX2Family("ltx2", ("lightricks.av_model",), joint_text=False, patch=(1, 1, 1), blocks=("transformer_blocks",),
               preset="ltx2"),
    Family("cosmos", ("cosmos",), joint_text=False, indexed=True, blocks=("blocks",), preset="cosmos_predict2"),
    Family("kandinsky5", ("kandinsky5",), joint_text=False, indexed=True, blocks=("visual_transformer_blocks",),
           model_patch=True, preset="kandinsky5"),
    Family("cogvideox", ("cogvideo",), joint_text=True, blocks=("transformer_blocks",), model_patch=True,
           preset="cogvideox"),
    Family("mochi", ("genmo",), joint_text=True, text_first=False, blocks=("blocks",)),
    # image families of 0.33.0 with no measured preset of their own (docs/families.md): `balanced`
    Family("auraflow", ("aura",), joint_text=True, blocks=("double_layers", "single_layers"), model_patch=True,
           image_kind="image"),
    Family("ideogram4", ("ideogram4",), joint_text=True, patch=(1, 1, 1), blocks=("layers",), image_kind="image"),
    Family("joyimage", ("joyimage",), joint_text=True, text_first=False, indexed=True, blocks=("double_blocks",),
           model_patch=True, image_kind="image"),
    Family("mage_flow", ("mage_flow",), joint_text=True, indexed=True, blocks=("transformer_blocks",),
           model_patch=True, image_kind="image"),
    Family("pixeldit", ("pixeldit",), joint_text=True, blocks=("patch_blocks",), model_patch=True,
           image_kind="image"),
    OmniGen2Family("omnigen2", ("omnigen",), joint_text=True, blocks=("layers",), model_patch=True,
                   image_kind="image"),
    LensFamily("lens", ("lens",), joint_text=True, text_first=False, indexed=True, patch=(1, 1, 1),
               blocks=("transformer_blocks",), image_kind="image"),
    OmniGen2Family("boogu", ("boogu",), joint_text=True, blocks=("double_stream_layers", "single_stream_layers"),
                   model_patch=True, image_kind="image"),
    MiniMaxFamily("minimax_h3", ("minimax",), joint_text=True, blocks=("blocks",), preset="minimax_h3"),
    Trellis2Family("trellis2", ("trellis2",), joint_text=False, patch=(1, 1, 1), preset="trellis2"),
    Family("hunyuan3d", ("hunyuan3d",), joint_text=True, patch=(1, 1, 1), latent="set", blocks=FLUX_BLOCKS,
           preset="hunyuan3d_2"),
    Family("hunyuan3d_2_1", ("hunyuan3dv2_1",), joint_text=False, patch=(1, 1, 1), latent="set",
           bypass_module="comfy.ldm.hunyuan3dv2_1.hunyuandit", preset="hunyuan3d_2"),
)
UNKNOWN = Family("unknown", (), joint_text=False, latent="none")
BY_NAME = {f.name: f for f in FAMILIES}
_WARNED: set[str] = set()


def family_of(diffusion_model) -> Family:
    """Family of a ComfyUI diffusion model, bound to it (``Family.bind``), from its module path
    (comfy.ldm.<module>.…; the longest registered module path wins). An unknown model gets UNKNOWN bound to
    its class, and one warning per class naming it and what the pack assumes."""
    path = "." + type(diffusion_model).__module__ + "."
    best, best_len = None, -1
    for fam in FAMILIES:
        for m in fam.modules:
            if f".{m}." in path and len(m) > best_len:
                best, best_len = fam, len(m)
    if best is not None:
        return best.bind(diffusion_model)
    fam = UNKNOWN.bind(diffusion_model)
    cls = fam.facts["class"]
    if cls not in _WARNED:
        _WARNED.add(cls)
        log.warning("sparse attention: model class %s is not a known family; %s", cls, UNKNOWN_ASSUMPTION)
    return fam
