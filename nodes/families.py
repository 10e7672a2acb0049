"""The model-family registry: every fact the pack knows about a ComfyUI model family, in one table.

Per family: how it is detected (its ``comfy.ldm.<module>`` package), where text sits in the self-attention
sequence, how latent cells map to tokens (patch size, grid or unordered set), how its blocks are numbered for
users (model order: Flux-style single-stream blocks continue after the double-stream ones), which module's
attention bypasses ComfyUI's override hook, and the preset that suits it. Adding a family is one entry in
FAMILIES (docs/architecture.md, "Adding a model family").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from ..engine import TokenLayout


@dataclass(frozen=True)
class Family:
    """name: the family's one spelling (logs, reports). modules: ``comfy.ldm`` package names that identify it.
    joint_text: text tokens are part of the self-attention sequence (text_first: at its start, else at its end);
    otherwise text is attended through separate cross-attention. patch: (t, h, w) latent cells per token.
    latent: "grid" (latent (B, C, [T,] H, W) in raster order) or "set" (an unordered (B, C, N) token set).
    bypass_module: the module whose ``optimized_attention`` calls pass no ``transformer_options`` (routed
    through the hook per forward by the patch). preset: the preset name, or a function of the diffusion model.
    """

    name: str
    modules: tuple[str, ...]
    joint_text: bool
    text_first: bool = True
    patch: tuple[int, int, int] = (1, 2, 2)
    latent: str = "grid"
    bypass_module: str | None = None
    preset: str | Callable[[object], str] = "balanced"

    # layout -------------------------------------------------------------------------------------------
    def latent_grid(self, x_shape) -> tuple[int, int, int] | None:
        """(F, H, W) token grid of a latent (B, C, [T,] H, W) after patchification (None for a token set)."""
        if self.latent != "grid" or x_shape is None or len(x_shape) < 4:
            return None
        pt, ph, pw = self.patch
        t, h, w = (x_shape[2], x_shape[3], x_shape[4]) if len(x_shape) == 5 else (1, x_shape[2], x_shape[3])
        return (math.ceil(t / pt), math.ceil(h / ph), math.ceil(w / pw))

    def layout(self, n_tokens: int, x_shape, transformer_options: dict) -> TokenLayout:
        """Token layout of a self-attention call over ``n_tokens`` tokens in a forward of latent ``x_shape``."""
        to = transformer_options
        grid = to.get("grid_sizes")
        grid = tuple(int(g) for g in grid) if grid is not None and len(grid) == 3 else None
        if grid is None:
            grid = self.latent_grid(x_shape)
        ref = to.get("reference_image_num_tokens", 0) or 0
        extra = int(sum(ref)) if isinstance(ref, (list, tuple)) else (int(ref) if self.joint_text else 0)
        if grid is None and self.latent == "set" and self.joint_text and x_shape is not None and len(x_shape) == 3:
            n_set = int(x_shape[2])  # the token set after the conditioning tokens
            if n_set <= n_tokens:
                return TokenLayout(text_len=n_tokens - n_set, text_first=self.text_first)
        n_img = math.prod(grid) if grid is not None else 0
        if grid is None or n_img > n_tokens:
            return TokenLayout()  # unknown: a 1-D sequence, nothing treated as text
        rest = n_tokens - n_img
        if self.joint_text:
            text = max(0, rest - extra)
            return TokenLayout(text_len=text, text_first=self.text_first, grid=grid, extra_len=rest - text)
        if rest == 0:  # separate cross-attention: extra tokens (reference / in-context) stay dense like text
            return TokenLayout(grid=grid)
        return TokenLayout(text_len=0, grid=grid, extra_len=rest)

    # layer numbering ----------------------------------------------------------------------------------
    @staticmethod
    def layer_offsets(diffusion_model) -> dict[str, int]:
        """Offset added to ``block_index`` per ``block_type`` so blocks are numbered in model order: the
        single-stream blocks of Flux, Chroma and HunyuanVideo follow their double-stream blocks."""
        doubles = getattr(diffusion_model, "double_blocks", None)
        return {"single": len(doubles)} if doubles is not None else {}

    def preset_for(self, diffusion_model) -> str:
        """Name of the preset that suits this model (presets/<name>.yaml)."""
        return self.preset(diffusion_model) if callable(self.preset) else self.preset


def _wan_preset(dm) -> str:
    dim = getattr(dm, "dim", None)
    if dim == 1536:
        return "wan21_t2v_1.3b"
    if dim == 3072:
        return "wan22_5b_ti2v"
    return "wan21_i2v_14b" if getattr(dm, "model_type", "t2v") == "i2v" else "wan21_t2v_14b"


# The registry: one entry per family.
FAMILIES: tuple[Family, ...] = (
    Family("wan", ("wan",), joint_text=False, preset=_wan_preset),
    Family("flux", ("flux",), joint_text=True, preset="flux"),
    Family("chroma", ("chroma",), joint_text=True, preset="flux"),
    Family("hunyuan_video", ("hunyuan_video",), joint_text=True, preset="hunyuan_video"),
    Family("qwen_image", ("qwen_image",), joint_text=True, preset="qwen_image"),
    Family("lumina", ("lumina",), joint_text=True, preset="lumina2_zimage"),
    Family("sd3", ("mmdit",), joint_text=True, preset="sd35"),
    Family("hidream", ("hidream",), joint_text=True, text_first=False, preset="hidream"),
    Family("ltxv", ("lightricks",), joint_text=False, patch=(1, 1, 1), preset="ltx_video"),
    Family("cosmos", ("cosmos",), joint_text=False, preset="cosmos_predict2"),
    Family("kandinsky5", ("kandinsky5",), joint_text=False, preset="kandinsky5"),
    Family("hunyuan3d", ("hunyuan3d",), joint_text=True, patch=(1, 1, 1), latent="set", preset="hunyuan3d_2"),
    Family("hunyuan3d_2_1", ("hunyuan3dv2_1",), joint_text=False, patch=(1, 1, 1), latent="set",
           bypass_module="comfy.ldm.hunyuan3dv2_1.hunyuandit", preset="hunyuan3d_2"),
)
UNKNOWN = Family("unknown", (), joint_text=False, latent="none")
BY_NAME = {f.name: f for f in FAMILIES}
_BY_MODULE = {m: f for f in FAMILIES for m in f.modules}


def family_of(diffusion_model) -> Family:
    """Family of a ComfyUI diffusion model, from its module path (comfy.ldm.<module>.…); UNKNOWN otherwise."""
    for part in type(diffusion_model).__module__.split("."):
        if part in _BY_MODULE:
            return _BY_MODULE[part]
    return UNKNOWN
