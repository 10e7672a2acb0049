"""The engine's configuration: one validated object built from keyword arguments, a dict or a YAML file.

Every invalid value raises ``ValueError`` naming the field (and the file, for YAML presets).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..kernels.backend import BACKENDS
from ..kernels.grouping_torch import GROUPING_DIMS
from .messages import MAX_TEXT, shown
from .modalities import Densities
from .layer_density import parse_anchor_factors, parse_layer_densities
from .policy import method_names
from .preset_yaml import read_yaml
from .schedule import AnchorSchedule, parse_warmup

RESIDUAL_PRECISIONS = ("fp8", "int4", "auto", "model")
RESIDUAL_WEIGHTINGS = ("auto", "mass", "fixed")
GROUPINGS = ("pca", "cuboid")


@dataclass(frozen=True)
class SparseConfig:
    """Everything the engine needs to decide and compute one attention call.

    method: dense | static | block_topk | mc_sparse | hybrid.
    density: fraction of query-key pairs kept among image tokens (0 < density <= 1).
    densities: fraction kept per modality pair of the token layout's segments (engine/modalities.py).
    block_q, block_k: 64 or 128 (block granularity of block masks).
    group_size: queries per group for mc_sparse (64 or 128, the kernel's query tile).
    grouping: how mc_sparse forms its query groups: "pca" (similar queries, per head, at each anchor) or
        "cuboid" (neighbouring tiles of the latent grid: free, the same for every head).
    mass_queries: how many queries of each mc_sparse group pass 2 reads to rank the group's keys: 16 (default), 32 or
        (groups of 128) 64, an evenly spaced subset (16: 1/4 to 1/8 of pass 2's work at the anchor, the same testbed
        PSNR as all of them, docs/decisions.md, "mc_sparse ranks a group's keys by 16 of its queries"); 0 all of them.
    grouping_dims: "pca" grouping on each head's queries projected on their 16 (default), 32 or 64 leading
        principal directions (fewer values read per query at every level of the partition: the grouping 88 -> 47 ms
        at Wan 14B, the same testbed PSNR, docs/decisions.md, "mc_sparse groups queries on 16 leading directions");
        0 on the queries themselves. A value of at least the head dimension means 0.
    warmup_steps: dense steps at the start of the run: a step count, or a fraction of the run (0.1 or "10%").
    warmup_layers / dense_layers: computed densely (layers numbered in model order).
    anchor_steps: when selection (and residual) are recomputed; steps or fractions of the run, or every N
        steps / every fraction (engine/schedule.py, AnchorSchedule).
    residual: keep O_dense - O_sparse from the anchor and add it at reuse steps.
    residual_precision: "auto" (default: "fp8", and 4 bits for a residual that finds no room at fp8, before any
        residual is dropped and its layer sent dense at reuse steps), "fp8" (float8 with a per-row scale, half the
        bytes of bf16; the model's dtype where fp8 is unavailable), "int4" (4 bits a value on the fp8 row's scale:
        half of fp8's bytes, read back as fp8 by each reuse call; -0.05 dB on the testbed (8 videos): docs/decisions.md,
        "Residuals at 4 bits") or "model" (the model's dtype).
    residual_weighting: "mass": a block selection's reuse step weights the cached residual by the share of the
        softmax mass the left-out blocks have now (measured from the sparse call's own LSE) against their share at
        the anchor (docs/method.md, "The residual weighted by the mass"), except after anchors at the run's first
        step; "fixed": the residual is added as cached; "auto" (default): "mass" where the block-sparse call runs
        the Triton kernels (its LSE is free there), "fixed" on the PyTorch backend (its LSE costs a second score
        pass: 2.2-2.5x per reuse call on a CPU). Token selections (mc_sparse) always add it as cached (the
        weighting measured worse for them).
    select_every_step: block_topk re-selects at every step (cheap pooled scores) instead of reusing.
    mass: block_topk keeps the smallest set of KV blocks reaching this share of pooled mass instead of a
        fixed count (0 < mass <= 1), or None.
    sink_blocks: static/hybrid keep the first ``sink_blocks`` image KV blocks for every query.
    temporal_weight: static/hybrid distance weight of one frame relative to one token row/column.
    cache_budget_mb: GPU memory for cached selections/residuals, in MB, or "auto" (the default: what the
        card has free beyond max(8 GiB, 25 %) of its memory, at most half the card; 8 GiB off CUDA);
        offload: move other layers' entries to CPU (pinned) memory and prefetch them; cpu_budget_mb: the
        CPU side's limit (it also always leaves max(8 GiB, 25 %) of the host's memory available; the selections
        of layers whose residual was dropped for room may pass it by 10 %: engine/cache.py, SELECTION_SLACK).
    min_tokens: calls with fewer tokens stay dense. backend: auto | triton | torch.
    layer_densities: per-layer / per-head density factors relative to the image density, {layer: factor |
        [factor per head]} (engine/layer_density.py); unlisted layers and heads keep factor 1.
    anchor_density_factors: density factors of the run's anchor spans: the first from the first sparse step (always
        an anchor) up to the next anchor step of the schedule, the second from there to the one after, ... (past
        the list, its last factor), times any layer_densities factor; () keeps every span at factor 1. A span's
        anchors select at its factor and its reuse steps keep that selection (engine/schedule.py, span_index).
    """

    method: str = "mc_sparse"
    density: float = 0.15
    densities: Densities = field(default_factory=Densities)
    block_q: int = 128
    block_k: int = 128
    group_size: int = 128
    grouping: str = "pca"
    mass_queries: int = 16
    grouping_dims: int = 16
    warmup_steps: int | float = 0
    warmup_layers: int = 0
    dense_layers: tuple[int, ...] = ()
    anchor_steps: AnchorSchedule = field(default_factory=AnchorSchedule)
    residual: bool = True
    residual_precision: str = "auto"
    residual_weighting: str = "auto"
    select_every_step: bool = False
    mass: float | None = None
    sink_blocks: int = 1
    temporal_weight: float = 1.0
    cache_budget_mb: float | str = "auto"
    offload: bool = True
    cpu_budget_mb: float = 65536.0
    # below 8192 tokens a reuse call is no faster than cuDNN dense on the H200 (host-bound launches; Flux 1024²
    # and Hunyuan3D make their steps slower): docs/benchmarks.md, "Host overhead at 4 608 tokens"
    min_tokens: int = 8192
    backend: str = "auto"
    layer_densities: tuple = ()
    anchor_density_factors: tuple = ()

    def __post_init__(self):
        # friendly forms: anchor_steps="10,26", dense_layers="0-2", densities={...}
        object.__setattr__(self, "anchor_steps", AnchorSchedule.parse(self.anchor_steps))
        object.__setattr__(self, "warmup_steps", parse_warmup(self.warmup_steps))
        if not isinstance(self.dense_layers, tuple) or not all(_is_int(x) for x in self.dense_layers):
            object.__setattr__(self, "dense_layers", parse_layers(self.dense_layers))
        if isinstance(self.densities, dict):
            object.__setattr__(self, "densities", densities_of(self.densities))
        _check(isinstance(self.densities, Densities), "densities",
               f"expected a mapping of modality pairs, got {shown(self.densities)}")
        _choice("method", self.method, method_names())
        _frac("density", self.density)
        for f in dataclasses.fields(Densities):
            v = getattr(self.densities, f.name)
            if v is not None or f.name != "image_to_image":  # only image_to_image may follow the global density
                _frac(f"densities.{f.name}", v)
        for name in ("block_q", "block_k", "group_size"):
            v = getattr(self, name)
            _check(_is_int(v) and v in (64, 128), name, f"must be 64 or 128 (an integer), got {shown(v)}")
        for name in ("warmup_layers", "sink_blocks", "min_tokens"):
            v = getattr(self, name)
            _check(_is_int(v) and v >= 0, name, f"must be a non-negative integer, got {shown(v)}")
        _check(all(_is_int(x) and 0 <= x <= MAX_LAYER for x in self.dense_layers), "dense_layers",
               f"must be layer indices in [0, {MAX_LAYER}], got {shown(self.dense_layers)}")
        _check(self.anchor_steps.every >= 0 and all(s >= 0 for s in self.anchor_steps.steps), "anchor_steps",
               "steps must be non-negative")
        if self.mass is not None:
            _frac("mass", self.mass)
        _check(_is_number(self.temporal_weight) and self.temporal_weight > 0, "temporal_weight",
               f"must be a positive number, got {shown(self.temporal_weight)}")
        for name in ("cache_budget_mb", "cpu_budget_mb"):
            v = getattr(self, name)
            if name == "cache_budget_mb" and isinstance(v, str) and v == "auto":
                continue
            alt = " or 'auto'" if name == "cache_budget_mb" else ""
            _check(_is_number(v) and v >= 0, name, f"must be a finite number >= 0{alt}, got {shown(v)}")
        _choice("grouping", self.grouping, GROUPINGS)
        # group_size is checked above (64 or 128)
        _check(_is_int(self.mass_queries) and self.mass_queries in (0, 16, 32, 64)
               and self.mass_queries < self.group_size, "mass_queries",
               f"must be 0 (all) or 16, 32 or 64 below group_size (an integer), got {shown(self.mass_queries)}")
        _check(_is_int(self.grouping_dims) and self.grouping_dims in GROUPING_DIMS, "grouping_dims",
               f"must be 0 (every coordinate), 16, 32 or 64 (an integer), got {shown(self.grouping_dims)}")
        _choice("residual_precision", self.residual_precision, RESIDUAL_PRECISIONS)
        _choice("residual_weighting", self.residual_weighting, RESIDUAL_WEIGHTINGS)
        _choice("backend", self.backend, BACKENDS)
        for name in ("residual", "select_every_step", "offload"):
            _check(isinstance(getattr(self, name), bool), name,
                   f"must be true or false, got {shown(getattr(self, name))}")
        # per-layer / per-head densities (engine/layer_density.py) ---------------------------------
        object.__setattr__(self, "layer_densities", parse_layer_densities(self.layer_densities))
        _check(not (self.layer_densities and self.mass is not None), "layer_densities",
               "cannot be combined with mass (mass chooses each row's block count itself)")
        object.__setattr__(self, "anchor_density_factors", parse_anchor_factors(self.anchor_density_factors))
        _check(not (self.anchor_density_factors and self.mass is not None), "anchor_density_factors",
               "cannot be combined with mass (mass chooses each row's block count itself)")
        # ------------------------------------------------------------------------------------------

    @property
    def image_density(self) -> float:
        v = self.densities.image_to_image
        return self.density if v is None else v

    @classmethod
    def from_dict(cls, data: dict, *, source: str = "config") -> "SparseConfig":
        """Build from a plain dict (keys as the fields; ``densities`` a dict; ``anchor_steps`` as parsed
        by AnchorSchedule.parse). Unknown keys are errors. ``source`` names the origin in messages; every
        error is a ValueError naming it and the field."""
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a mapping of settings, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(shown(k) for k in data if k not in known)
        if unknown:
            raise ValueError(f"{source}: unknown field(s) {', '.join(unknown[:10])}; known: {', '.join(sorted(known))}")
        kw = dict(data)
        try:
            if "densities" in kw:
                kw["densities"] = densities_of(kw["densities"] or {})
            if "anchor_steps" in kw:
                kw["anchor_steps"] = AnchorSchedule.parse(kw["anchor_steps"])
            if "dense_layers" in kw:
                kw["dense_layers"] = parse_layers(kw["dense_layers"])
            return cls(**kw)
        except (ValueError, TypeError) as exc:  # TypeError: a value of a type no check anticipated
            raise ValueError(f"{source}: {exc}") from None

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: dict | None = None) -> "SparseConfig":
        """Load a preset: a YAML mapping whose ``sparse`` key (or the whole file) holds the fields, read
        strictly (engine/preset_yaml.py). Errors are ValueError naming the file and the field."""
        path = Path(path)
        doc = read_yaml(path)
        if doc is None:
            doc = {}
        if not isinstance(doc, dict):
            raise ValueError(f"{path.name}: expected a mapping of settings (or a 'sparse' mapping), "
                             f"got {type(doc).__name__}")
        if "sparse" in doc:
            doc = doc["sparse"]
            if doc is None:
                doc = {}
            if not isinstance(doc, dict):
                raise ValueError(f"{path.name}: sparse: expected a mapping of settings, got {shown(doc)}")
        data = dict(doc)
        data.update(overrides or {})
        return cls.from_dict(data, source=path.name)

    def replace(self, **changes) -> "SparseConfig":
        return dataclasses.replace(self, **changes)


MAX_LAYER = 9_999  # no model has this many blocks (Flux: 57 with its single-stream blocks after the double ones)


def densities_of(value) -> Densities:
    """A Densities from a mapping of modality pairs (unknown keys are errors naming the field)."""
    if isinstance(value, Densities):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"densities: expected a mapping of modality pairs, got {shown(value)}")
    names = {f.name for f in dataclasses.fields(Densities)}
    bad = sorted(shown(k) for k in value if k not in names)
    if bad:
        raise ValueError(f"densities: unknown key(s) {', '.join(bad)}; known: {', '.join(sorted(names))}")
    return Densities(**value)


def parse_layers(value) -> tuple[int, ...]:
    """"0,1,5-7" / [0, 1] / "" -> sorted tuple of layer indices (each in [0, MAX_LAYER])."""
    if value is None or value == "":
        return ()
    if isinstance(value, (list, tuple)):
        if len(value) > MAX_LAYER + 1:
            raise ValueError(f"dense_layers: {len(value)} entries (at most {MAX_LAYER + 1} layers)")
        items = [str(v) if not isinstance(v, bool) else "?" for v in value]
    elif isinstance(value, (str, int)) and not isinstance(value, bool):
        text = str(value)
        if len(text) > MAX_TEXT:
            raise ValueError(f"dense_layers: {len(text)} characters (at most {MAX_TEXT}): {shown(text)}")
        items = [p for p in text.replace(";", ",").split(",")]
    else:
        raise ValueError(f"dense_layers: expected layer numbers like '0,1,5-7', got {shown(value)}")
    out: set[int] = set()
    for item in (p.strip() for p in items):
        if not item:
            continue
        if len(item) > 16:
            raise ValueError(f"dense_layers: cannot read {shown(item)} (layers are numbered 0 to {MAX_LAYER})")
        if "-" in item:
            a, b = item.split("-", 1)
            if not (_digits(a.strip()) and _digits(b.strip())) or int(a) > int(b):
                raise ValueError(f"dense_layers: cannot read range {shown(item)}")
            if int(b) > MAX_LAYER:
                raise ValueError(f"dense_layers: range {shown(item)} goes beyond layer {MAX_LAYER}")
            out.update(range(int(a), int(b) + 1))
        elif _digits(item):
            if int(item) > MAX_LAYER:
                raise ValueError(f"dense_layers: layer {shown(item)} is beyond layer {MAX_LAYER}")
            out.add(int(item))
        else:
            raise ValueError(f"dense_layers: cannot read {shown(item)} (expected e.g. '0,1,5-7')")
    return tuple(sorted(out))


def _digits(text: str) -> bool:
    return text.isascii() and text.isdigit()


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    """A finite int or float (not a boolean)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check(ok: bool, name: str, msg: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {msg}")


def _choice(name: str, v, options: tuple) -> None:
    _check(isinstance(v, str) and v in options, name, f"must be one of {options}, got {shown(v)}")


def _frac(name: str, v) -> None:
    _check(_is_number(v) and 0.0 < float(v) <= 1.0, name, f"must lie in (0, 1], got {shown(v)}")
