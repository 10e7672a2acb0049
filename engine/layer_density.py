"""Per-layer and per-head densities (docs/method.md, "Per-layer and per-head density").

``SparseConfig.layer_densities`` maps layers (numbered in model order, as ``dense_layers``) to a density
*factor* for the whole layer or a list of factors, one per head. A head's image->image density is
``min(1, image_density * factor)``; layers and heads not listed keep factor 1. The factors are relative so
the density a user sets stays the average: a calibrated set (tools/calibrate.py) averages exactly 1 over the
model's layers and heads, and changing the density scales every head with it.

At an anchor the engine groups the heads of the call by density, asks the policy once per group on the
heads' slice with that density, and concatenates the selections along the head dimension
(``BlockSelection.concat_heads`` / ``TokenSelection.concat_heads``), so every policy and kernel honours
the densities without knowing about them.
"""

from __future__ import annotations

import dataclasses
import math

FIELD = "layer_densities"
ANCHOR_FIELD = "anchor_density_factors"
MAX_ANCHOR_FACTORS = 64
NEARLY_DENSE = 1.0 - 2.0 ** -20  # a head at density 1 beside sparser ones: budgets round(d * n) = n below 2**19 keys


def parse_layer_densities(value) -> tuple:
    """The normalised, hashable form of ``layer_densities``: a sorted tuple of (layer, factor) pairs, where
    factor is a float (the whole layer) or a tuple of floats (one per head).

    Accepts None / "" / {} (none), a mapping {layer: factor | [factor per head]} whose keys are layer
    numbers, "a-b" ranges or "a,b" lists, the YAML/JSON text of such a mapping ("{0: 0.5, 3: [0.4, 1.6]}"),
    or the normalised tuple itself. ValueError naming ``layer_densities`` on anything else."""
    if value is None or value == "" or value == () or value == {}:
        return ()
    if isinstance(value, str):
        import yaml

        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            raise ValueError(f"{FIELD}: cannot read the text as a mapping ({str(exc).splitlines()[0]})") from None
        if value is None:
            return ()
    if isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in value):
        value = dict(value)
    if not isinstance(value, dict):
        raise ValueError(f"{FIELD}: expected a mapping of layer -> density factor or [factor per head], "
                         f"e.g. {{0: 0.5, 3: [0.4, 1.6]}}; got {type(value).__name__}")
    out: dict[int, float | tuple[float, ...]] = {}
    for key, factor in value.items():
        layers = _layers_of(key)
        parsed = _factor(factor, key)
        for layer in layers:
            if layer in out:
                raise ValueError(f"{FIELD}: layer {layer} is listed twice")
            out[layer] = parsed
    return tuple(sorted(out.items()))


def _layers_of(key) -> tuple[int, ...]:
    from .config import parse_layers

    if isinstance(key, bool):
        raise ValueError(f"{FIELD}: {key!r} is not a layer number")
    if isinstance(key, int):
        if key < 0:
            raise ValueError(f"{FIELD}: layer numbers are non-negative, got {key}")
        return (key,)
    try:
        layers = parse_layers(str(key))
    except ValueError:
        raise ValueError(f"{FIELD}: cannot read the layer key {key!r} (a layer number, '4-7' or '0,2')") from None
    if not layers:
        raise ValueError(f"{FIELD}: empty layer key {key!r}")
    return layers


def _number(x, where: str, field: str = FIELD) -> float:
    """x as a positive finite float; else ValueError "{field}: {where}: ..."."""
    try:
        finite = isinstance(x, (int, float)) and math.isfinite(float(x))
    except OverflowError:  # an int too large for a float (from YAML or a dict)
        finite = False
    if isinstance(x, bool) or not finite or float(x) <= 0:
        raise ValueError(f"{field}: {where}: density factors must be positive numbers, got {x!r}")
    return float(x)


def _factor(value, key):
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"{FIELD}: layer {key}: an empty list of head factors")
        return tuple(_number(x, f"layer {key}") for x in value)
    return _number(value, f"layer {key}")


def layer_densities_text(value) -> str:
    """The widget / preset form: "{0: 0.5, 3: [0.4, 1.6]}" ("" for none); ``parse_layer_densities`` reads it
    back to the same value."""
    pairs = parse_layer_densities(value)
    if not pairs:
        return ""
    items = []
    for layer, f in pairs:
        items.append(f"{layer}: " + (f"[{', '.join(_g(x) for x in f)}]" if isinstance(f, tuple) else _g(f)))
    return "{" + ", ".join(items) + "}"


def layer_densities_dict(value) -> dict:
    """{layer: factor | [factor per head]} with plain Python numbers and lists (for YAML presets)."""
    return {layer: (list(f) if isinstance(f, tuple) else f) for layer, f in parse_layer_densities(value)}


def _g(x: float) -> str:
    return format(x, ".6g")


def parse_anchor_factors(value) -> tuple[float, ...]:
    """The normalised form of ``anchor_density_factors``: a tuple of positive floats, the density factors of the
    run's first, second, ... anchor span (engine/schedule.py, ``AnchorSchedule.span_index``; spans past the list
    keep its last factor).

    Accepts None / "" / () (none: every anchor keeps factor 1), a list or tuple of numbers, or their text
    ("1.5, 0.8" or "[1.5, 0.8]"). ValueError naming ``anchor_density_factors`` on anything else."""
    if value is None or value == "" or value == ():
        return ()
    if isinstance(value, str):
        text = value.strip().removeprefix("[").removesuffix("]").strip()
        if not text:  # a cleared field ("", "  " or "[]"): none
            return ()
        if len(text) > 2000:
            raise ValueError(f"{ANCHOR_FIELD}: {len(text)} characters; expected a few factors like '1.5, 0.8'")
        parts = [t.strip() for t in text.split(",")]
        try:
            value = [float(t) for t in parts]
        except ValueError:
            raise ValueError(f"{ANCHOR_FIELD}: cannot read {value!r} (factors like '1.5, 0.8')") from None
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{ANCHOR_FIELD}: expected a list of density factors, one per anchor, e.g. [1.5, 0.8]; "
                         f"got {value!r}")
    if len(value) > MAX_ANCHOR_FACTORS:
        raise ValueError(f"{ANCHOR_FIELD}: {len(value)} factors listed (at most {MAX_ANCHOR_FACTORS})")
    return tuple(_number(x, "every factor", ANCHOR_FIELD) for x in value)


def anchor_factors_text(value) -> str:
    """The widget / preset form of ``anchor_density_factors``: "1.5, 0.8" ("" for none)."""
    return ", ".join(_g(x) for x in parse_anchor_factors(value))


def anchor_factor(cfg, index: int) -> float:
    """The density factor of anchor span ``index`` (0 for the run's first): 1 without ``anchor_density_factors``,
    the last listed factor past the list."""
    f = cfg.anchor_density_factors
    return f[min(index, len(f) - 1)] if f else 1.0


def head_densities(cfg, layer: int, heads: int, factor: float = 1.0) -> tuple[float, ...] | None:
    """The image->image density of each of the ``heads`` heads of ``layer``, times ``factor`` (the anchor
    span's factor, ``anchor_factor``) and at most 1, or None when the layer keeps the configured density (no entry and
    factor 1). ValueError when the entry lists a different number of heads."""
    entry = dict(cfg.layer_densities).get(layer) if cfg.layer_densities else None
    if entry is None and factor == 1.0:
        return None
    base = cfg.image_density * factor
    if isinstance(entry, tuple):
        if len(entry) != heads:
            raise ValueError(f"{FIELD}: layer {layer} lists {len(entry)} head densities but its attention has "
                             f"{heads} heads")
        return tuple(min(1.0, base * f) for f in entry)
    return (min(1.0, base * (1.0 if entry is None else entry)),) * heads


def config_at(cfg, density: float):
    """``cfg`` with image->image density ``density`` and no per-layer factors (what one head group uses)."""
    return cfg.replace(density=density, densities=dataclasses.replace(cfg.densities, image_to_image=None),
                       layer_densities=(), anchor_density_factors=())


def select_heads(policy, q, k, lse, layout, cfg, densities: tuple[float, ...] | None, *, scale, backend,
                 prepared=None):
    """A selection for q, k: (B, H, N, D) (lse fp32 (B, H, N) or None) where head h keeps ``densities[h]``.

    ``densities`` None: the policy's own selection at the configured density. Otherwise the heads are grouped
    by density; the policy selects once per group on the group's head slice and the parts are concatenated
    along the head dimension in the original head order. prepared: the policy's ``prepare`` of q (or None),
    handed to each group as its ``heads(...)``."""
    if densities is None:
        return policy.select(q, k, lse, layout, cfg, scale=scale, backend=backend, **_given(prepared))
    if len(set(densities)) > 1 and max(densities) >= 1.0:
        # a policy at density 1 may describe the call as dense rows with no query groups (mc_sparse), which cannot
        # be concatenated with other heads' groups: those heads keep every key of their groups instead
        densities = tuple(min(d, NEARLY_DENSE) for d in densities)
    groups: dict[float, list[int]] = {}
    for h, d in enumerate(densities):
        groups.setdefault(d, []).append(h)
    if len(groups) == 1:
        return policy.select(q, k, lse, layout, config_at(cfg, densities[0]), scale=scale, backend=backend,
                             **_given(prepared))
    parts, heads = [], []
    for d, idx in groups.items():
        sl = _head_slice(idx, q.device)
        parts.append(policy.select(q[:, sl], k[:, sl], None if lse is None else lse[:, sl], layout,
                                   config_at(cfg, d), scale=scale, backend=backend,
                                   **_given(None if prepared is None else prepared.heads(sl))))
        heads.append(idx)
    return type(parts[0]).concat_heads(parts, heads)


def _given(prepared) -> dict:
    """select's ``prepared`` argument when there is one: policies without ``prepare`` need not take it."""
    return {} if prepared is None else {"prepared": prepared}


def _head_slice(idx: list[int], device):
    """A slice when the heads are contiguous (a view), else an index tensor (a copy)."""
    from .selection import device_index  # here: config.py imports this module, and selection imports the kernels

    if idx == list(range(idx[0], idx[-1] + 1)):
        return slice(idx[0], idx[-1] + 1)
    return device_index(tuple(idx), device)  # kept: no copy from the host at later anchors
