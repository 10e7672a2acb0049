"""The engine's configuration: one validated object built from keyword arguments, a dict or a YAML file.

Every invalid value raises ``ValueError`` naming the field (and the file, for YAML presets).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..kernels.backend import BACKENDS
from .layer_density import parse_layer_densities
from .policy import method_names
from .schedule import AnchorSchedule, parse_warmup

RESIDUAL_PRECISIONS = ("fp8", "model")
GROUPINGS = ("pca", "cuboid")


@dataclass(frozen=True)
class Densities:
    """Fraction of keys kept per modality pair (query -> key). None means "use the global density".

    Text rows and text columns stay dense by default (text->text, text->image, image->text = 1.0;
    docs/method.md, "Modalities"); image->image (video/image/3D tokens among themselves) takes the global
    density.
    """

    text_to_text: float = 1.0
    text_to_image: float = 1.0
    image_to_text: float = 1.0
    image_to_image: float | None = None


@dataclass(frozen=True)
class SparseConfig:
    """Everything the engine needs to decide and compute one attention call.

    method: dense | static | block_topk | mc_sparse | hybrid.
    density: fraction of query-key pairs kept among image tokens (0 < density <= 1).
    block_q, block_k: 64 or 128 (block granularity of block masks).
    group_size: queries per group for mc_sparse (64 or 128, the kernel's query tile).
    grouping: how mc_sparse forms its query groups: "pca" (similar queries, per head, at each anchor) or
        "cuboid" (neighbouring tiles of the latent grid: free, the same for every head).
    warmup_steps: dense steps at the start of the run: a step count, or a fraction of the run (0.1 or "10%").
    warmup_layers / dense_layers: computed densely (layers numbered in model order).
    anchor_steps: when selection (and residual) are recomputed; steps or fractions of the run, or every N
        steps / every fraction (engine/schedule.py, AnchorSchedule).
    residual: keep O_dense - O_sparse from the anchor and add it at reuse steps.
    residual_precision: "fp8" (default: float8 with a per-row scale, half the bytes; the model's dtype
        where fp8 is unavailable) or "model" (the model's dtype).
    select_every_step: block_topk re-selects at every step (cheap pooled scores) instead of reusing.
    mass: block_topk keeps the smallest set of KV blocks reaching this share of pooled mass instead of a
        fixed count (0 < mass <= 1), or None.
    sink_blocks: static/hybrid keep the first ``sink_blocks`` image KV blocks for every query.
    temporal_weight: static/hybrid distance weight of one frame relative to one token row/column.
    cache_budget_mb: GPU memory for cached selections/residuals, in MB, or "auto" (the default: what the
        card has free beyond max(8 GiB, 25 %) of its memory, at most half the card; 8 GiB off CUDA);
        offload: move other layers' entries to CPU (pinned) memory and prefetch them; cpu_budget_mb: the
        CPU side's limit (it also always leaves max(8 GiB, 25 %) of the host's memory available).
    min_tokens: calls with fewer tokens stay dense. backend: auto | triton | torch.
    layer_densities: per-layer / per-head density factors relative to the image density, {layer: factor |
        [factor per head]} (engine/layer_density.py); unlisted layers and heads keep factor 1.
    """

    method: str = "mc_sparse"
    density: float = 0.15
    densities: Densities = field(default_factory=Densities)
    block_q: int = 128
    block_k: int = 128
    group_size: int = 128
    grouping: str = "pca"
    warmup_steps: int | float = 0
    warmup_layers: int = 0
    dense_layers: tuple[int, ...] = ()
    anchor_steps: AnchorSchedule = field(default_factory=AnchorSchedule)
    residual: bool = True
    residual_precision: str = "fp8"
    select_every_step: bool = False
    mass: float | None = None
    sink_blocks: int = 1
    temporal_weight: float = 1.0
    cache_budget_mb: float | str = "auto"
    offload: bool = True
    cpu_budget_mb: float = 65536.0
    min_tokens: int = 4096
    backend: str = "auto"
    layer_densities: tuple = ()

    def __post_init__(self):
        # friendly forms: anchor_steps="10,26", dense_layers="0-2", densities={...}
        object.__setattr__(self, "anchor_steps", AnchorSchedule.parse(self.anchor_steps))
        object.__setattr__(self, "warmup_steps", parse_warmup(self.warmup_steps))
        if not isinstance(self.dense_layers, tuple) or any(not isinstance(x, int) for x in self.dense_layers):
            object.__setattr__(self, "dense_layers", parse_layers(self.dense_layers))
        if isinstance(self.densities, dict):
            object.__setattr__(self, "densities", Densities(**self.densities))
        _check(self.method in method_names(), "method", f"must be one of {method_names()}, got {self.method!r}")
        _frac("density", self.density)
        for f in dataclasses.fields(Densities):
            v = getattr(self.densities, f.name)
            if v is not None:
                _frac(f"densities.{f.name}", v)
        for name in ("block_q", "block_k"):
            _check(getattr(self, name) in (64, 128), name, f"must be 64 or 128, got {getattr(self, name)!r}")
        _check(self.group_size in (64, 128), "group_size", f"must be 64 or 128, got {self.group_size!r}")
        for name in ("warmup_layers", "sink_blocks", "min_tokens"):
            v = getattr(self, name)
            _check(isinstance(v, int) and not isinstance(v, bool) and v >= 0, name,
                   f"must be a non-negative integer, got {v!r}")
        _check(all(isinstance(x, int) and x >= 0 for x in self.dense_layers), "dense_layers",
               f"must be non-negative layer indices, got {self.dense_layers!r}")
        _check(self.anchor_steps.every >= 0 and all(s >= 0 for s in self.anchor_steps.steps), "anchor_steps",
               "steps must be non-negative")
        if self.mass is not None:
            _frac("mass", self.mass)
        _check(self.temporal_weight > 0 and math.isfinite(self.temporal_weight), "temporal_weight",
               f"must be a positive number, got {self.temporal_weight!r}")
        for name in ("cache_budget_mb", "cpu_budget_mb"):
            v = getattr(self, name)
            if name == "cache_budget_mb" and v == "auto":
                continue
            alt = " or 'auto'" if name == "cache_budget_mb" else ""
            _check(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0, name,
                   f"must be a number >= 0{alt}, got {v!r}")
        _check(self.grouping in GROUPINGS, "grouping", f"must be one of {GROUPINGS}, got {self.grouping!r}")
        _check(self.residual_precision in RESIDUAL_PRECISIONS, "residual_precision",
               f"must be one of {RESIDUAL_PRECISIONS}, got {self.residual_precision!r}")
        _check(self.backend in BACKENDS, "backend", f"must be one of {BACKENDS}, got {self.backend!r}")
        for name in ("residual", "select_every_step", "offload"):
            _check(isinstance(getattr(self, name), bool), name, f"must be true or false, got {getattr(self, name)!r}")
        # per-layer / per-head densities (engine/layer_density.py) ---------------------------------
        object.__setattr__(self, "layer_densities", parse_layer_densities(self.layer_densities))
        _check(not (self.layer_densities and self.mass is not None), "layer_densities",
               "cannot be combined with mass (mass chooses each row's block count itself)")
        # ------------------------------------------------------------------------------------------

    @property
    def image_density(self) -> float:
        v = self.densities.image_to_image
        return self.density if v is None else v

    @classmethod
    def from_dict(cls, data: dict, *, source: str = "config") -> "SparseConfig":
        """Build from a plain dict (keys as the fields; ``densities`` a dict; ``anchor_steps`` as parsed
        by AnchorSchedule.parse). Unknown keys are errors. ``source`` names the origin in messages."""
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a mapping of settings, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{source}: unknown field(s) {unknown}; known: {sorted(known)}")
        kw = dict(data)
        try:
            if "densities" in kw:
                dens = kw["densities"] or {}
                if not isinstance(dens, dict):
                    raise ValueError("densities: expected a mapping")
                dfields = {f.name for f in dataclasses.fields(Densities)}
                bad = sorted(set(dens) - dfields)
                if bad:
                    raise ValueError(f"densities: unknown key(s) {bad}; known: {sorted(dfields)}")
                kw["densities"] = Densities(**dens)
            if "anchor_steps" in kw:
                kw["anchor_steps"] = AnchorSchedule.parse(kw["anchor_steps"])
            if "dense_layers" in kw:
                kw["dense_layers"] = parse_layers(kw["dense_layers"])
            return cls(**kw)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None
        except TypeError as exc:
            raise ValueError(f"{source}: {exc}") from None

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: dict | None = None) -> "SparseConfig":
        """Load a preset: a YAML mapping whose ``sparse`` key (or the whole file) holds the fields."""
        import yaml

        path = Path(path)
        try:
            doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as exc:
            raise ValueError(f"{path.name}: cannot read preset ({exc})") from None
        if isinstance(doc, dict) and "sparse" in doc:
            doc = doc["sparse"]
        data = dict(doc or {})
        data.update(overrides or {})
        return cls.from_dict(data, source=path.name)

    def replace(self, **changes) -> "SparseConfig":
        return dataclasses.replace(self, **changes)


def parse_layers(value) -> tuple[int, ...]:
    """"0,1,5-7" / [0, 1] / "" -> sorted tuple of layer indices."""
    if value is None or value == "":
        return ()
    if isinstance(value, (list, tuple)):
        items = [str(v) for v in value]
    else:
        items = [p for p in str(value).replace(";", ",").split(",")]
    out: set[int] = set()
    for item in (p.strip() for p in items):
        if not item:
            continue
        if "-" in item:
            a, b = item.split("-", 1)
            if not (a.strip().isdigit() and b.strip().isdigit()) or int(a) > int(b):
                raise ValueError(f"dense_layers: cannot read range {item!r}")
            out.update(range(int(a), int(b) + 1))
        elif item.isdigit():
            out.add(int(item))
        else:
            raise ValueError(f"dense_layers: cannot read {item!r} (expected e.g. '0,1,5-7')")
    return tuple(sorted(out))


def _check(ok: bool, name: str, msg: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {msg}")


def _frac(name: str, v) -> None:
    _check(isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 < float(v) <= 1.0, name,
           f"must lie in (0, 1], got {v!r}")
