"""Model-family adapters: token layout (text position and length, latent grid, extra tokens) and layer
index for one attention call, from what ComfyUI exposes.

An APPLY_MODEL wrapper (present for every model) stores the latent shape and a per-forward call counter
in the forward's ``transformer_options``; the attention override reads them back. Wan exports its grid
(``grid_sizes``); for other families the grid is the latent shape divided by the family's patch size.
Text leads the joint sequence for Flux, HunyuanVideo, Qwen-Image, Lumina, SD3 and Hunyuan3D 2.0, and
trails it for HiDream; Wan, LTX-Video, Cosmos and Kandinsky 5 attend text through cross-attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..engine import TokenLayout

INFO_KEY = "sparse_attention_forward"


@dataclass(frozen=True)
class Family:
    name: str
    joint_text: bool          # text tokens inside the self-attention sequence
    text_first: bool          # where they sit when joint
    patch: tuple[int, int, int]  # (t, h, w) latent cells per token
    grid: bool = True         # tokens form a latent grid (False: Hunyuan3D's unordered vecset)


FAMILIES = {
    "wan": Family("wan", False, True, (1, 2, 2)),
    "flux": Family("flux", True, True, (1, 2, 2)),
    "chroma": Family("chroma", True, True, (1, 2, 2)),
    "hunyuan_video": Family("hunyuan_video", True, True, (1, 2, 2)),
    "qwen_image": Family("qwen_image", True, True, (1, 2, 2)),
    "lumina": Family("lumina", True, True, (1, 2, 2)),
    "mmdit": Family("sd3", True, True, (1, 2, 2)),
    "hidream": Family("hidream", True, False, (1, 2, 2)),
    "lightricks": Family("ltxv", False, True, (1, 1, 1)),
    "cosmos": Family("cosmos", False, True, (1, 2, 2)),
    "kandinsky5": Family("kandinsky5", False, True, (1, 2, 2)),
    "hunyuan3d": Family("hunyuan3d", True, True, (1, 1, 1), grid=False),
    "hunyuan3dv2_1": Family("hunyuan3d_2_1", False, True, (1, 1, 1), grid=False),
}
UNKNOWN = Family("unknown", False, True, (1, 2, 2), grid=False)


def family_of(diffusion_model) -> Family:
    """Family of a ComfyUI diffusion model, from its module path (comfy.ldm.<family>.…)."""
    module = type(diffusion_model).__module__
    parts = module.split(".")
    for p in parts:
        if p in FAMILIES:
            return FAMILIES[p]
    return UNKNOWN


def forward_info(x_shape, family: Family) -> dict:
    """Per-forward record stored by the APPLY_MODEL wrapper: latent shape, family, and the counter of
    self-attention calls (the layer index of models that do not report ``block_index``)."""
    return {"x_shape": tuple(x_shape), "family": family, "calls": 0}


def latent_grid(x_shape, family: Family) -> tuple[int, int, int] | None:
    """(F, H, W) token grid of a latent (B, C, [T,] H, W) after the family's patchification."""
    if not family.grid or len(x_shape) < 4:
        return None
    pt, ph, pw = family.patch
    if len(x_shape) == 5:
        t, h, w = x_shape[2], x_shape[3], x_shape[4]
    else:
        t, h, w = 1, x_shape[2], x_shape[3]
    return (math.ceil(t / pt), math.ceil(h / ph), math.ceil(w / pw))


def layout_for(n_tokens: int, transformer_options: dict, family: Family) -> TokenLayout:
    """Token layout of a self-attention call over ``n_tokens`` tokens."""
    info = transformer_options.get(INFO_KEY) or {}
    grid = transformer_options.get("grid_sizes")
    grid = tuple(int(g) for g in grid) if grid is not None and len(grid) == 3 else None
    if grid is None and info.get("x_shape") is not None:
        grid = latent_grid(info["x_shape"], family)
    extra = int(transformer_options.get("reference_image_num_tokens", 0) or 0) if family.joint_text else 0
    if isinstance(transformer_options.get("reference_image_num_tokens"), (list, tuple)):
        extra = int(sum(transformer_options["reference_image_num_tokens"]))
    x_shape = info.get("x_shape")
    if grid is None and not family.grid and family.joint_text and x_shape is not None and len(x_shape) == 3:
        # an unordered latent set (Hunyuan3D: latent (B, C, N)) after the conditioning tokens
        n_set = int(x_shape[2])
        if n_set <= n_tokens:
            text = n_tokens - n_set
            return TokenLayout(text_len=text, text_first=family.text_first)
    n_img = math.prod(grid) if grid is not None else 0
    if grid is None or n_img > n_tokens:
        return TokenLayout()  # unknown: a 1-D sequence, nothing treated as text
    rest = n_tokens - n_img
    if family.joint_text:
        text = max(0, rest - extra)
        return TokenLayout(text_len=text, text_first=family.text_first, grid=grid, extra_len=rest - text)
    # separate cross-attention: extra tokens (reference / in-context) are kept dense like text
    if rest == 0:
        return TokenLayout(grid=grid)
    return TokenLayout(text_len=0, grid=grid, extra_len=rest)


def layer_index(transformer_options: dict) -> int | None:
    """The block's index: ``block_index`` (single-stream blocks offset by 1000), or None if absent."""
    idx = transformer_options.get("block_index")
    if idx is None:
        return None
    offset = 1000 if transformer_options.get("block_type") == "single" else 0
    return int(idx) + offset


def step_index(transformer_options: dict) -> tuple[int, int | None]:
    """(step, total_steps) of this model call within the sampling run.

    The current sigma is located in the run's schedule ``sample_sigmas`` (descending): an exact match
    gives its index; an intermediate sigma of a multi-evaluation sampler (heun, dpm_2, …) belongs to the
    step it lies in. Without a schedule: step 0.
    """
    sigmas = transformer_options.get("sigmas")
    sched = transformer_options.get("sample_sigmas")
    if sigmas is None or sched is None:
        return 0, None
    s = float(sigmas.reshape(-1)[0])
    vals = [float(x) for x in sched.reshape(-1)]
    total = max(1, len(vals) - 1)
    tol = 1e-5 * max(1.0, abs(s))
    count = sum(1 for x in vals if x >= s - tol)
    return min(max(0, count - 1), total - 1), total
