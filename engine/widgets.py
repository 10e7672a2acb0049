"""The Sparse Attention node's inputs, declared once: name, kind, tooltip, range and the configuration fields
each one sets. Defaults are the "balanced" preset's configuration (the measured speed setting; fields it does not
set keep SparseConfig's defaults), read from the preset file so the node and the preset cannot disagree.

nodes/ turns each Widget into a ComfyUI input and ``config_from_widgets`` back into a SparseConfig. Widget
names and their order are permanent: saved workflows store widget values by position (new widgets are only
ever appended).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .config import SparseConfig, parse_layers
from .layer_density import anchor_factors_text, layer_densities_text, parse_anchor_factors, parse_layer_densities
from .policy import method_names
from .presets import PRESET_DIR, load_preset
from .schedule import warmup_text

log = logging.getLogger(__name__)

# A user who drags the full node in gets the setting the presets ship, chosen by measurement (docs/decisions.md,
# "Presets at density 0.08 with every layer sparse"), not the library's defaults (mc_sparse 0.15, one anchor).
DEFAULT_PRESET = "balanced"


def node_defaults(name: str = DEFAULT_PRESET, directory: Path = PRESET_DIR) -> SparseConfig:
    """The node's default configuration: preset ``name``, or SparseConfig's defaults (logged) when that file is
    missing or invalid, so an edited preset never takes the pack's nodes down at import."""
    try:
        return load_preset(name, directory=directory)
    except ValueError as exc:
        log.warning("sparse attention: the Sparse Attention node's defaults are the engine's, not the %s preset: %s",
                    name, exc)
        return SparseConfig()


DEFAULTS = node_defaults()


@dataclass(frozen=True)
class Widget:
    """One node input. kind: combo | float | int | string | bool. ``fields``: the SparseConfig fields it sets;
    ``to_config`` converts the widget value to the fields' value, ``default`` reads the widget's default off
    the configuration defaults."""

    name: str
    kind: str
    fields: tuple[str, ...]
    tooltip: str
    options: Callable[[], tuple] | None = None
    minimum: float | None = None
    maximum: float | None = None
    step: float | None = None
    to_config: Callable[[Any], Any] = lambda v: v
    default: Callable[[SparseConfig], Any] | None = None
    # widgets added after the first release are optional: API prompts saved before them still validate
    optional: bool = False

    def default_value(self):
        if self.default is not None:
            return self.default(DEFAULTS)
        return getattr(DEFAULTS, self.fields[0])

    def option_values(self) -> list:
        return list(self.options()) if self.options else []


def _int(v) -> int:
    return int(v)


WIDGETS: tuple[Widget, ...] = (
    Widget("method", "combo", ("method",), options=method_names,
           tooltip="mc_sparse: token-level selection for groups of similar queries, exact at anchor steps (most "
                   "quality per density without the mass-weighted residual; costly anchors). block_topk: pooled "
                   "block scores (every video and image preset). hybrid: local windows + top-k blocks. static: "
                   "fixed local windows. dense: no sparsity."),
    Widget("density", "float", ("density",), minimum=0.01, maximum=1.0, step=0.01,
           tooltip="Fraction of image/video keys each query attends (text stays dense). Lower is faster; "
                   "0.08-0.25 is typical."),
    Widget("block_size", "combo", ("block_q", "block_k"), options=lambda: ("128", "64"), to_config=_int,
           default=lambda c: str(c.block_k), tooltip="Block size of the block methods (query and key blocks)."),
    Widget("query_group_size", "combo", ("group_size",), options=lambda: ("128", "64"), to_config=_int,
           default=lambda c: str(c.group_size),
           tooltip="Queries per group for mc_sparse (the kernel's tile). 128 is faster."),
    Widget("warmup_steps", "string", ("warmup_steps",), default=lambda c: warmup_text(c.warmup_steps),
           tooltip="Dense denoising steps at the start of the run (they fix the layout): a step count like '3' "
                   "or a share of the run like '10%'. Steps count in the whole run, also across split samplers."),
    Widget("warmup_layers", "int", ("warmup_layers",), minimum=0, maximum=1000,
           tooltip="The first N transformer blocks always run dense."),
    Widget("dense_layers", "string", ("dense_layers",), to_config=parse_layers,
           default=lambda c: ",".join(map(str, c.dense_layers)),
           tooltip="Further blocks to keep dense, e.g. '0,1,38-39' (blocks numbered in model order)."),
    Widget("anchor_steps", "string", ("anchor_steps",), default=lambda c: c.anchor_steps.text(),
           tooltip="Steps that recompute the selection (and residual): steps '10,26', shares of the run "
                   "'20%,50%', 'every 5' or 'every 25%', or combined '0 + every 10'. The first sparse step is "
                   "always an anchor, so '' means one anchor there; a sampler that starts mid-run (Wan 2.2's "
                   "second expert, denoise < 1) anchors at its first step, which then serves the listed anchors up "
                   "to 5% of the run after it."),
    Widget("residual_caching", "bool", ("residual",),
           tooltip="Cache dense-minus-sparse at anchors and add it back at the other steps (better quality, one "
                   "output-sized tensor per layer of memory)."),
    Widget("cache_offload", "bool", ("offload",),
           tooltip="Keep caches that do not fit the GPU budget in CPU memory (prefetched before use) instead of "
                   "dropping them."),
    Widget("min_tokens", "int", ("min_tokens",), minimum=0, maximum=10_000_000,
           tooltip="Attention over fewer tokens stays dense (sparsity does not pay there)."),
    Widget("backend", "combo", ("backend",), options=lambda: ("auto", "triton", "torch"),
           tooltip="auto: Triton kernels on NVIDIA GPUs, PyTorch elsewhere."),
    Widget("layer_densities", "string", ("layer_densities",), to_config=parse_layer_densities,
           default=lambda c: layer_densities_text(c.layer_densities),
           tooltip="Density per layer or per head, as factors of the density above (which stays the average): "
                   "'{0: 0.5, 3: [0.4, 1.6]}' (layer 0 at half, layer 3's two heads at 0.4x and 1.6x; unlisted "
                   "layers 1x). The Sparse Attention Calibrate node measures them on your model. '' = uniform."),
    Widget("anchor_density_factors", "string", ("anchor_density_factors",), to_config=parse_anchor_factors,
           default=lambda c: anchor_factors_text(c.anchor_density_factors),
           tooltip="Density between anchor steps, as factors of the density above: '1.5, 0.82' runs the steps from "
                   "the first sparse step to the second anchor step at 1.5x and the rest at 0.82x (the last factor "
                   "holds for later spans). Keep the steps' mean at 1 (warm-up 2, anchors at steps 2 and 10 of 30: "
                   "7 reuse steps in the first span, 19 in the second). On the quality testbed at density 0.10, "
                   "+0.5 dB (docs/calibration.md, \"Density moved between anchors\"). '' = 1x throughout.",
           optional=True),
)


def config_from_widgets(values: dict, *, source: str = "Sparse Attention") -> SparseConfig:
    """A validated SparseConfig from widget values keyed by widget name (missing ones take their default).
    Errors are ValueError naming the widget (the configuration field's name is mentioned too)."""
    data = {}
    for w in WIDGETS:
        value = values.get(w.name, w.default_value())
        try:
            converted = w.to_config(value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: {w.name}: cannot read {_short(value)} ({exc})") from None
        # the node's own range, for values that do not pass ComfyUI's checks (the configuration built from a
        # dict, a linked widget); the node's validate_inputs leaves numbers to ComfyUI (nodes_sparse.py)
        if w.kind in ("float", "int") and isinstance(converted, (int, float)) and not isinstance(converted, bool) \
                and not w.minimum <= converted <= w.maximum:
            raise ValueError(f"{source}: {w.name}: must lie in [{w.minimum:g}, {w.maximum:g}], got {_short(value)}")
        for f in w.fields:
            data[f] = converted
    return SparseConfig.from_dict(data, source=source)


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "...'"

