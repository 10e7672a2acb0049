"""Calibration: per-layer and per-head densities measured on a q/k/v recording (docs/method.md, "Per-layer and
per-head density"; the recording format: engine/recording.py).

1. ``measure``: for each recorded layer and head and each method, the relative L2 error of the attention output
   against dense attention at a grid of densities, with the engine's own policies, selections, kernels and
   residual: the error of a fresh selection at the step it was made (no residual), and — when two or more steps
   are recorded — the error at a later step with the anchor's selection, with the anchor's residual (what a reuse
   step returns; a block selection anchored after the run's first step weights the residual by the mass as the
   engine does, SparseConfig.residual_weighting) and without it.
2. ``allocate``: densities per (layer, head) minimising the summed squared error at the requested average
   density: each head's cost curve (its share of the layer's output energy times its squared relative error)
   is replaced by its lower convex hull, and density goes greedily to the steepest marginal gain until the
   budget is spent exactly (the last step may stop between grid points).
3. ``preset_text`` / ``report_markdown`` / ``plot``: a preset YAML with ``layer_densities`` factors (density /
   requested density, so they average 1), a markdown report and a plot of error against density.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import kernels
from .config import SparseConfig
from .layer_density import config_at, layer_densities_text
from .policy import method_names, policy_for
from .recording import Recording
from .residual import Residual, residual_precision, weighs_by_mass
from .selection import BlockSelection

DEFAULT_GRID = (0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5)
OBJECTIVES = ("reuse", "reuse_plain", "fresh")


@dataclass
class Curve:
    """One (method, layer, head): errors at each grid density. fresh: rel-L2 of the sparse output at the step the
    selection was made, no residual (RMS over anchor steps); reuse / reuse_plain: rel-L2 at later recorded steps
    with the anchor's selection, with / without the anchor's residual (RMS over the pairs, each weighted by the
    share of reuse steps it stands for; None without pairs);
    achieved: the exact density the head computed; weight: the head's share of its layer's output energy;
    anchors: the anchor steps measured, in order; reuse_spans / reuse_plain_spans: the reuse errors of each anchor's
    own pairs (one list per anchor, [] for an anchor without a later recorded step), what ``allocate_spans``
    trades between the anchors' spans."""

    method: str
    layer: int
    head: int
    densities: tuple[float, ...]
    fresh: list[float]
    reuse: list[float] | None
    reuse_plain: list[float] | None
    achieved: list[float]
    weight: float
    anchors: tuple[int, ...] = ()
    reuse_spans: list[list[float]] | None = None
    reuse_plain_spans: list[list[float]] | None = None

    def errors(self, objective: str) -> list[float]:
        out = {"fresh": self.fresh, "reuse": self.reuse, "reuse_plain": self.reuse_plain}[objective]
        if out is None:
            raise ValueError(f"objective {objective!r} needs two or more recorded steps")
        return out

    def error_at(self, objective: str, d: float) -> float:
        """The error interpolated linearly at density d (clamped to the grid)."""
        return _interp(self.densities, self.errors(objective), d)

    def span_error_at(self, objective: str, span: int, d: float) -> float:
        """The reuse error of anchor ``span``'s own pairs (``anchors[span]``) at density d, interpolated as
        ``error_at``; ValueError for the fresh objective or a span without a later recorded step."""
        spans = {"reuse": self.reuse_spans, "reuse_plain": self.reuse_plain_spans}.get(objective)
        if spans is None:
            raise ValueError(f"objective {objective!r}: density moved between anchors is measured at reuse steps "
                             "(reuse or reuse_plain, two or more recorded steps)")
        if not spans[span]:
            raise ValueError(f"anchor step {self.anchors[span]}: no later step was recorded before the next anchor, "
                             "so its reuse steps cannot be measured; record one")
        return _interp(self.densities, spans[span], d)


@dataclass
class Allocation:
    """Densities per (layer, head) for one method at average density ``target``; cost = sum of weight x error^2."""

    method: str
    target: float
    objective: str
    densities: dict            # (layer, head) -> configured density
    cost_uniform: float
    cost_calibrated: float
    achieved: dict = field(default_factory=dict)  # (layer, head) -> density computed (measured)
    layer_weights: dict | None = None  # {layer: weight} the costs were multiplied by, if any
    factors: dict = field(default_factory=dict)  # layer -> float | tuple of per-head factors (as written)

    @property
    def mean_density(self) -> float:
        """Mean configured density (the factors' mean times the target)."""
        return sum(self.densities.values()) / len(self.densities)

    @property
    def mean_achieved(self) -> float:
        """Mean density computed: equal to what the uniform density computes on the recording."""
        return sum(self.achieved.values()) / len(self.achieved)

    def layer_densities(self) -> dict:
        return dict(self.factors)


def pairs_for(steps, anchors=None, source: str = "recording") -> list[tuple[int, int]]:
    """(anchor step, later step) pairs among the recorded ``steps``: with ``anchors`` (recorded steps where the
    selection is made) each other recorded step after the first anchor pairs with the latest anchor before it;
    without, consecutive recorded steps pair up. One recorded step: no pairs."""
    steps = sorted(steps)
    if anchors is None:
        return list(zip(steps, steps[1:]))
    anchors = sorted(set(anchors))
    missing = [a for a in anchors if a not in steps]
    if missing:
        raise ValueError(f"{source}: anchor step(s) {missing} were not recorded (recorded steps: {steps})")
    out = []
    for s in steps:
        before = [a for a in anchors if a < s]
        if s not in anchors and before:
            out.append((before[-1], s))
    return out


def pair_weights(pairs, anchors=None, total_steps: int | None = None) -> list[float]:
    """The share of the run's reuse steps each (anchor, later) pair stands for: every step after an anchor, up to the
    next anchor or the end of a ``total_steps`` run, counts for the recorded later step of that anchor nearest to it.
    Equal shares without ``anchors`` or ``total_steps``."""
    if not pairs:
        return []
    equal = [1.0 / len(pairs)] * len(pairs)
    if anchors is None or total_steps is None:
        return equal
    anchors = sorted(set(anchors))
    counts = [0] * len(pairs)
    for i, a in enumerate(anchors):
        end = anchors[i + 1] if i + 1 < len(anchors) else total_steps
        mine = [(j, s) for j, (aa, s) in enumerate(pairs) if aa == a]
        for t in range(a + 1, end):
            if mine:
                counts[min(mine, key=lambda js: (abs(js[1] - t), js[1]))[0]] += 1
    total = sum(counts)
    return [c / total for c in counts] if total else equal


def density_grid(target_densities, grid=None) -> tuple[float, ...]:
    """The measurement grid: ``grid`` (default DEFAULT_GRID) with the requested densities added (so a uniform
    allocation is among the candidates and its error is measured, not interpolated)."""
    values = set(DEFAULT_GRID if grid is None else grid) | set(target_densities)
    for d in values:
        if not (0 < d <= 1):
            raise ValueError(f"density grid: densities lie in (0, 1], got {d!r}")
    return tuple(sorted(values))


def _rel(diff: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per-head relative L2 of (1, H, N, D) tensors: float64 (H,)."""
    num = torch.linalg.vector_norm(diff.float(), dim=(-2, -1))[0].double()
    den = torch.linalg.vector_norm(ref.float(), dim=(-2, -1))[0].double().clamp(min=1e-30)
    return (num / den).cpu()


def measure(rec: Recording, methods, grid, base: SparseConfig | None = None, *, pairs=None, weights=None,
            anchors=None, layers=None, device="cpu", dtype=None, progress=None) -> list[Curve]:
    """Error curves for every recorded layer (or ``layers``), head and method at each density of ``grid``.

    base: the configuration measured (block / group sizes, grouping, residual precision, densities of text
    pairs; its density and layer_densities are ignored). pairs: (anchor, later) step pairs (default
    ``pairs_for(rec.steps)``); weights: each pair's share (default equal; ``pair_weights``); anchors: the recorded
    steps where selections are made (default: the pairs' anchors), each measured fresh, one without a later recorded
    step keeping [] as its span's reuse errors (``Curve.reuse_spans``). Errors over several
    anchors or pairs are root-mean-square (pairs weighted), so squared errors add. device / dtype: where and in which
    dtype to compute (default: fp16 on CUDA, fp32 elsewhere). progress(done, total): called after each (layer,
    method, density)."""
    base = (base or SparseConfig()).replace(layer_densities=())
    for m in methods:
        if m not in method_names() or m == "dense":
            raise ValueError(f"methods: {m!r} is not a sparse method (have {method_names()[:-1]})")
    device = torch.device(device)
    dtype = dtype or (torch.float16 if device.type == "cuda" else torch.float32)
    pairs = pairs_for(rec.steps) if pairs is None else list(pairs)
    weights = pair_weights(pairs) if weights is None else list(weights)
    pair_w = dict(zip(pairs, weights))
    # every anchor named (an anchor without a later recorded step keeps [] as its span's errors), else the pairs'
    anchors = sorted(set(anchors) | {a for a, _ in pairs}) if anchors else sorted({a for a, _ in pairs})
    anchors = anchors or [rec.steps[0]]
    later = {a: [s for aa, s in pairs if aa == a] for a in anchors}
    layers = list(rec.layers if layers is None else layers)
    total, done = len(layers) * len(methods) * len(grid), 0
    curves: list[Curve] = []
    for layer in layers:
        layout = rec.layouts[layer]
        steps_needed = sorted(set(anchors) | {s for _, s in pairs})
        cache = {}
        for s in steps_needed:
            q, k, v = rec.qkv(layer, s, device=device, dtype=dtype)
            out, lse = kernels.attention_dense(q, k, v, return_lse=True, backend=base.backend)
            cache[s] = (q, k, v, out, lse)
        n = cache[anchors[0]][0].shape[2]
        energy = torch.linalg.vector_norm(cache[anchors[0]][3].float(), dim=(-2, -1))[0].double().pow(2).cpu()
        weight = (energy / energy.sum().clamp(min=1e-30)).tolist()
        for method in methods:
            policy = policy_for(method)
            h = rec.heads
            fresh = torch.zeros(len(grid), h, dtype=torch.float64)
            reuse = torch.zeros(len(grid), h, dtype=torch.float64)
            plain = torch.zeros(len(grid), h, dtype=torch.float64)
            by_anchor = {a: (torch.zeros(len(grid), h, dtype=torch.float64),
                             torch.zeros(len(grid), h, dtype=torch.float64)) for a in anchors}
            achieved = torch.zeros(len(grid), h, dtype=torch.float64)
            for i, d in enumerate(grid):
                cfg = config_at(base.replace(method=method), d)
                for a in anchors:
                    q, k, v, out, lse = cache[a]
                    sel = policy.select(q, k, lse if policy.needs_lse else None, layout, cfg, scale=None,
                                        backend=cfg.backend)
                    out_s = sel.run(q, k, v, backend=cfg.backend)
                    fresh[i] += _rel(out - out_s, out).pow(2) / len(anchors)
                    achieved[i] += sel.head_density(n) / len(anchors)
                    if isinstance(sel, BlockSelection) and weighs_by_mass(cfg, a, q) and not policy.reselects(cfg):
                        # the residual as a run anchored at step a caches it: with its mass, so the reuse below
                        # weights it as the engine's reuse step does (docs/method.md, "The residual weighted by
                        # the mass"); a reselecting policy (select_every_step) keeps it fixed, as the engine does.
                        # Under "auto" the device decides, as in the engine: a CPU calibration measures it fixed
                        _, res = sel.anchor(q, k, v, backend=cfg.backend, mass=True,
                                            precision=residual_precision(cfg.residual_precision, q.device))
                        residual = Residual(*res).stored_as(cfg.residual_precision)
                    else:  # formed in fp32 and encoded as the engine's anchor stores it (engine.Engine._store)
                        pair = kernels.residual_of(out, out_s, backend=cfg.backend,
                                                   precision=residual_precision(cfg.residual_precision, q.device))
                        residual = Residual(*pair).stored_as(cfg.residual_precision)
                    residual = residual.unpacked()  # 4-bit storage measured as the reuse call reads it
                    span_w = sum(pair_w[(a, s)] for s in later[a])
                    for s in later[a]:
                        q2, k2, v2, out2, _ = cache[s]
                        o = sel.run(q2, k2, v2, backend=cfg.backend)
                        e_plain = _rel(o - out2, out2).pow(2)
                        if residual.mass is not None:
                            o = sel.run(q2, k2, v2, backend=cfg.backend, residual=residual)
                        else:
                            residual.add_to(o)
                        e_reuse = _rel(o - out2, out2).pow(2)
                        plain[i] += e_plain * pair_w[(a, s)]
                        reuse[i] += e_reuse * pair_w[(a, s)]
                        # the anchor's own RMS (its pairs' shares renormalised), for density moved between anchors
                        share = pair_w[(a, s)] / span_w if span_w > 0 else 1.0 / len(later[a])
                        by_anchor[a][0][i] += e_reuse * share
                        by_anchor[a][1][i] += e_plain * share
                    del sel, out_s, residual
                done += 1
                if progress is not None:
                    progress(done, total)
            fresh, reuse, plain = fresh.sqrt(), reuse.sqrt(), plain.sqrt()
            spans = [(r.sqrt(), p.sqrt(), bool(later[a])) for a, (r, p) in by_anchor.items()]
            for hh in range(h):
                curves.append(Curve(method, layer, hh, tuple(grid), fresh[:, hh].tolist(),
                                    reuse[:, hh].tolist() if pairs else None,
                                    plain[:, hh].tolist() if pairs else None, achieved[:, hh].tolist(), weight[hh],
                                    anchors=tuple(anchors),
                                    reuse_spans=[r[:, hh].tolist() if has else [] for r, _, has in spans]
                                    if pairs else None,
                                    reuse_plain_spans=[p[:, hh].tolist() if has else [] for _, p, has in spans]
                                    if pairs else None))
        del cache
    return curves


def default_objective(residual: bool, has_pairs: bool) -> str:
    """reuse (residual on) / reuse_plain (residual off) with two or more recorded steps, else fresh."""
    if not has_pairs:
        return "fresh"
    return "reuse" if residual else "reuse_plain"


def _interp(xs, ys, x: float) -> float:
    if x <= xs[0]:
        return ys[0]
    for j in range(1, len(xs)):
        if x <= xs[j]:
            t = (x - xs[j - 1]) / (xs[j] - xs[j - 1])
            return ys[j - 1] + t * (ys[j] - ys[j - 1])
    return ys[-1]


def _hull(xs, cs) -> list[tuple[float, float]]:
    """Lower convex hull of the points (xs, cs), non-increasing: past its lowest point it stays flat."""
    hull: list[tuple[float, float]] = []
    for p in zip(xs, cs):
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            if (x2 - x1) * (p[1] - y1) - (y2 - y1) * (p[0] - x1) <= 0:  # hull[-1] lies on or above the chord
                hull.pop()
            else:
                break
        hull.append(p)
    low = min(range(len(hull)), key=lambda i: hull[i][1])
    out = hull[:low + 1]
    if out[-1][0] < xs[-1]:
        out.append((xs[-1], out[-1][1]))  # more density gains nothing measurable: a flat segment
    return out


def _points(c: Curve, cs: list[float], target: float) -> tuple[list[float], list[float], list[float]]:
    """(achieved densities, costs, grid densities) of one curve sorted by achieved density; of grid densities that
    compute the same pairs (block rounding) the cheapest is kept, on a tie the one nearest ``target``."""
    pts = sorted(zip(c.achieved, cs, c.densities))
    xs, ys, ns = [], [], []
    for x, y, d in pts:
        if xs and x - xs[-1] <= 1e-12 * max(1.0, x):
            if (y, abs(d - target)) < (ys[-1], abs(ns[-1] - target)):
                ys[-1], ns[-1] = y, d
            continue
        xs.append(x)
        ys.append(y)
        ns.append(d)
    return xs, ys, ns


def _spend(units, budget: float) -> list[float]:
    """Greedy marginal allocation on lower convex hulls: ``units`` are (xs, costs) with xs ascending; each unit
    starts at its first x and ``budget`` (in units of x) goes to the steepest cost decrease first, the last piece
    possibly between two points. Returns the x each unit ends at."""
    segments = []
    for u, (xs, ys) in enumerate(units):
        hull = _hull(xs, ys)
        for j in range(len(hull) - 1):
            (x0, y0), (x1, y1) = hull[j], hull[j + 1]
            segments.append(((y1 - y0) / (x1 - x0), u, j, x1 - x0))
    segments.sort(key=lambda s: (s[0], s[1], s[2]))
    spent = [xs[0] for xs, _ in units]
    for _slope, u, _j, length in segments:
        if budget <= 1e-12:
            break
        take = min(length, budget)
        spent[u] += take
        budget -= take
    return spent


SCOPES = ("model", "layer")


def allocate(curves: list[Curve], target: float, objective: str, *, source: str = "recording",
             layer_weights: dict | None = None, scope: str = "model") -> Allocation:
    """Densities per (layer, head) of one method's ``curves`` that compute, together, exactly the pairs the uniform
    density ``target`` computes (the measured ``achieved`` densities, so block rounding favours neither side) and
    minimise sum(weight x error^2) over the convex hulls of the measured curves. The densities returned are the
    configured ones (what ``layer_densities`` factors scale). layer_weights: {layer: w} multiplying each layer's
    cost (how strongly the layer's attention error reaches the model's output, when measured; default 1).
    scope: "model" (the budget moves freely between layers and heads) or "layer" (each layer keeps the pairs the
    uniform density gives it; only its heads share them: on the quality testbed moving density between layers
    lost PSNR in both directions, docs/calibration.md).
    ValueError (naming ``source``) when the grid cannot meet the average or the scope is unknown."""
    if not curves:
        raise ValueError(f"{source}: nothing to allocate (no curves)")
    if scope not in SCOPES:
        raise ValueError(f"{source}: scope must be one of {SCOPES}, got {scope!r}")
    if scope == "layer":
        parts = [allocate([c for c in curves if c.layer == layer], target, objective, source=source,
                          layer_weights=layer_weights) for layer in sorted({c.layer for c in curves})]
        alloc = Allocation(curves[0].method, target, objective,
                           {k: v for a in parts for k, v in a.densities.items()},
                           sum(a.cost_uniform for a in parts), sum(a.cost_calibrated for a in parts),
                           achieved={k: v for a in parts for k, v in a.achieved.items()},
                           layer_weights=dict(layer_weights) if layer_weights else None)
        alloc.factors = _factors(alloc.densities, target)
        return alloc
    method = curves[0].method
    grid = curves[0].densities
    if not (grid[0] - 1e-12 <= target <= grid[-1] + 1e-12):
        raise ValueError(f"{source}: an average density of {target:g} cannot be met: the densities measured span "
                         f"{grid[0]:g}..{grid[-1]:g} (every head gets one of them)")
    points = {}
    budget = 0.0
    for u, c in enumerate(curves):
        lw = 1.0 if layer_weights is None else float(layer_weights.get(c.layer, 1.0))
        cs = [lw * c.weight * e * e for e in c.errors(objective)]
        xs, ys, ns = points[u] = _points(c, cs, target)
        budget += _interp(grid, c.achieved, target) - xs[0]
    spent = _spend([points[u][:2] for u in range(len(curves))], budget)  # achieved density of each unit
    densities, achieved = {}, {}
    cost_uniform = cost_cal = 0.0
    for u, c in enumerate(curves):
        xs, ys, ns = points[u]
        x = min(xs[-1], spent[u])
        densities[(c.layer, c.head)] = _interp(xs, ns, x)
        achieved[(c.layer, c.head)] = x
        cost_cal += _interp(xs, ys, x)
        lw = 1.0 if layer_weights is None else float(layer_weights.get(c.layer, 1.0))
        cost_uniform += lw * c.weight * c.error_at(objective, target) ** 2
    alloc = Allocation(method, target, objective, densities, cost_uniform, cost_cal, achieved=achieved,
                       layer_weights=dict(layer_weights) if layer_weights else None)
    alloc.factors = _factors(densities, target)
    return alloc


SPAN_FACTORS = tuple(round(0.25 + 0.05 * i, 2) for i in range(56))  # 0.25 ... 3.0, the factors a span may take


@dataclass
class SpanAllocation:
    """Density factors of the anchor spans (``anchor_density_factors``) for one method at average density
    ``target``: span i runs from anchor ``anchors[i]`` to the next; ``steps[i]`` of its steps reuse that anchor's
    selection. The factors keep the mean over the reuse steps at 1 (sum of steps x factor = sum of steps). cost =
    sum over spans of steps x sum over heads of weight x (the span's reuse error at density x factor)^2."""

    method: str
    target: float
    objective: str
    anchors: tuple[int, ...]
    steps: tuple[int, ...]
    factors: tuple[float, ...]
    cost_uniform: float
    cost_calibrated: float


def span_steps(anchors, total_steps: int, source: str = "recording") -> tuple[int, ...]:
    """The reuse steps of each anchor's span in a run of ``total_steps``: from the step after anchor i up to the
    next anchor (the last anchor's up to the end). ValueError naming ``source`` when an anchor lies outside the run
    or no span has a reuse step."""
    anchors = sorted(set(anchors))
    if not anchors or anchors[0] < 0 or anchors[-1] >= total_steps:
        raise ValueError(f"{source}: anchor steps {anchors} must lie within the run's {total_steps} steps")
    ends = anchors[1:] + [total_steps]
    out = tuple(e - a - 1 for a, e in zip(anchors, ends))
    if not any(out):
        raise ValueError(f"{source}: anchors {anchors} leave no reuse step in a run of {total_steps} steps")
    return out


def allocate_spans(curves: list[Curve], target: float, objective: str, total_steps: int, *, warmup_steps: int,
                   densities=None, factors=SPAN_FACTORS, source: str = "recording") -> SpanAllocation:
    """The density factor of each anchor's span (docs/calibration.md, "Density moved between anchors") that
    minimises sum over spans of (its reuse steps) x sum over heads of weight x error^2, each head's error being the
    reuse error of that anchor's own pairs at (its density x the span's factor), under sum of steps x factor = sum
    of steps (the reuse steps compute the pairs they compute at factor 1). ``densities``: {(layer, head): density}
    of a per-head allocation (default: ``target`` for every head). Greedy on the convex hulls of the spans' costs
    over ``factors``, as ``allocate`` does over densities; a span without reuse steps keeps factor 1. The curves'
    anchors must be every anchor of the run, the first at ``warmup_steps`` (the engine's first span starts at the
    first sparse step: engine/schedule.py, ``span_index``), so factor i is the engine's span i.
    ValueError (naming ``source``) for the fresh objective, an anchor without a later recorded step, a first anchor
    off the first sparse step, curves of several methods or anchors, a head missing from ``densities``, or a run
    too short for its anchors."""
    if not curves:
        raise ValueError(f"{source}: nothing to allocate (no curves)")
    if len({c.method for c in curves}) > 1 or len({c.anchors for c in curves}) > 1:
        raise ValueError(f"{source}: allocate_spans takes one method's curves, measured at the same anchors")
    anchors = curves[0].anchors
    if not anchors or anchors[0] != warmup_steps:
        raise ValueError(f"{source}: the run's first span starts at its first sparse step ({warmup_steps}, after the "
                         f"warm-up), but the first anchor measured is step {anchors[0] if anchors else None}: "
                         "measure at every anchor of the run, the first where the warm-up ends")
    if densities is not None:
        missing = [(c.layer, c.head) for c in curves if (c.layer, c.head) not in densities]
        if missing:
            raise ValueError(f"{source}: densities: no density for (layer, head) {missing[:4]}")
    steps = span_steps(anchors, total_steps, source)
    factors = sorted(set(factors) | {1.0})

    def cost(span: int, f: float) -> float:
        return steps[span] * _span_cost(curves, span, f, target, objective, densities, source)

    live = [i for i, n in enumerate(steps) if n > 0]
    units = [([steps[i] * f for f in factors], [cost(i, f) for f in factors]) for i in live]
    budget = sum(steps[i] * (1.0 - factors[0]) for i in live)
    spent = _spend(units, budget)
    out = [1.0] * len(steps)
    for i, x in zip(live, spent):
        out[i] = round(x / steps[i], 4)
    return SpanAllocation(curves[0].method, target, objective, tuple(anchors), steps, tuple(out),
                          sum(cost(i, 1.0) for i in live),
                          sum(_interp(units[j][0], units[j][1], spent[j]) for j in range(len(live))))


def _span_cost(curves, span: int, f: float, target: float, objective: str, densities, source: str) -> float:
    """sum over heads of weight x (anchor ``span``'s reuse error at the head's density x f)^2."""
    total = 0.0
    for c in curves:
        d = target if densities is None else densities[(c.layer, c.head)]
        try:
            e = c.span_error_at(objective, span, min(1.0, d * f))
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None
        total += c.weight * e * e
    return total


def span_cost(curves: list[Curve], target: float, objective: str, total_steps: int, factors, *, densities=None,
              source: str = "recording") -> float:
    """The cost ``allocate_spans`` minimises, at the given ``factors`` (one per anchor span; later spans keep the
    last, as the engine does): sum over spans of reuse steps x sum over heads of weight x error^2."""
    steps = span_steps(curves[0].anchors, total_steps, source)
    factors = list(factors) or [1.0]
    return sum(n * _span_cost(curves, i, factors[min(i, len(factors) - 1)], target, objective, densities, source)
               for i, n in enumerate(steps) if n > 0)


def layer_costs(curves: list[Curve], objective: str, densities) -> dict:
    """{layer: sum over its heads of weight x error^2} at ``densities`` (a number for every head, or {(layer, head):
    density}); the quantity ``allocate`` minimises, per layer."""
    out: dict = {}
    for c in curves:
        d = densities if isinstance(densities, (int, float)) else densities[(c.layer, c.head)]
        out[c.layer] = out.get(c.layer, 0.0) + c.weight * c.error_at(objective, d) ** 2
    return out


def _factors(densities: dict, target: float) -> dict:
    """{layer: factor | (factor per head)} of densities / target, rounded to 4 decimals."""
    out = {}
    for layer in sorted({lay for lay, _ in densities}):
        f = tuple(round(densities[(layer, h)] / target, 4) for h in sorted(h for la, h in densities if la == layer))
        out[layer] = f[0] if len(set(f)) == 1 else f
    return out


def preset_text(alloc: Allocation, rec: Recording, base: dict, *, command: str = "") -> str:
    """A preset YAML (title, sparse) with ``alloc``'s factors as ``layer_densities`` and the ``base`` fields; its
    comment says where the values come from."""
    import yaml

    fields = dict(base)
    fields.update(method=alloc.method, density=alloc.target)
    fields.pop("layer_densities", None)
    body = yaml.safe_dump({"sparse": fields}, sort_keys=False, default_flow_style=False).rstrip("\n")
    lines = [f"# Source: calibrated by {command or 'tools/calibrate.py'} on the q/k/v recording {rec.path.name} "
             f"({rec.family}, {len(rec.layers)} layers x {rec.heads} heads, steps {list(rec.steps)}).",
             f"# layer_densities: factors of the density per layer (one per head; mean {_mean_factor(alloc):.4f}): "
             f"together the heads compute the query-key pairs the uniform density computes, placed to minimise the "
             f"summed squared {alloc.objective} error measured on the recording",
             f"# (predicted: {_ratio_db(alloc)} lower than the uniform density {alloc.target:g})"
             + ("; layers weighted by measured output sensitivity " + ", ".join(
                 f"{la}: {w:.3g}" for la, w in sorted(alloc.layer_weights.items())) if alloc.layer_weights else "")
             + ".",
             f"title: Calibrated {alloc.method} at density {alloc.target:g} ({rec.family}, {rec.path.stem})",
             body, "  layer_densities:"]
    for layer, f in sorted(alloc.factors.items()):
        lines.append(f"    {layer}: " + (f"[{', '.join(format(x, 'g') for x in f)}]" if isinstance(f, tuple)
                                         else format(f, "g")))
    return "\n".join(lines) + "\n"


def _mean_factor(alloc: Allocation) -> float:
    return alloc.mean_density / alloc.target


def _ratio_db(alloc: Allocation) -> str:
    if alloc.cost_calibrated <= 0 or alloc.cost_uniform <= 0:
        return "an error"
    return f"{10 * math.log10(alloc.cost_uniform / alloc.cost_calibrated):.2f} dB of squared error"


def plain_fields(cfg: SparseConfig) -> dict:
    """The fields of ``cfg`` that differ from the defaults, as plain YAML values (method, density and
    layer_densities left out: the calibration sets them)."""
    import dataclasses

    from .schedule import warmup_text

    default = SparseConfig()
    out = {}
    for f in dataclasses.fields(SparseConfig):
        if f.name in ("method", "density", "layer_densities"):
            continue
        v = getattr(cfg, f.name)
        if v == getattr(default, f.name):
            continue
        if f.name == "anchor_steps":
            v = v.text()
        elif f.name == "warmup_steps":
            v = v if isinstance(v, int) else warmup_text(v)
        elif f.name == "densities":
            v = {k: x for k, x in dataclasses.asdict(v).items() if x is not None}
        elif f.name == "dense_layers":
            v = ",".join(map(str, v))
        elif f.name == "anchor_density_factors":
            v = list(v)  # YAML's safe dump writes lists, not tuples
        out[f.name] = v
    return out


def write_preset(path: str | Path, text: str) -> Path:
    """Write a preset and check that it loads (ValueError naming the file otherwise)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    SparseConfig.from_yaml(path)
    return path


def report_markdown(rec: Recording, curves: list[Curve], allocations: list[Allocation], *, pairs, weights=None,
                    plot_name=None, command: str = "", seconds: float | None = None) -> str:
    """The calibration report: what was measured, the allocation per method, and the error curves as tables."""
    grid = curves[0].densities if curves else ()
    lines = ["# Density calibration", "",
             f"Recording `{rec.path.name}`: {rec.family}, layers {list(rec.layers)}, {rec.heads} heads of "
             f"{rec.head_dim}, steps {list(rec.steps)}" + (f" of {rec.total_steps}" if rec.total_steps else "")
             + f"; pairs (anchor → later step) {_pairs_text(pairs, weights)}.",
             f"Generated by `{command or 'tools/calibrate.py'}`" + (f" in {seconds:.1f} s" if seconds else "") + ".",
             "",
             "Errors are relative L2 of the attention output against dense attention, per head. *fresh*: the "
             "selection made at that step, no residual. *reuse*: the anchor's selection at the later step plus the "
             "anchor's residual (what a reuse step returns). *reuse, no residual*: the same without the residual. "
             "The allocation minimises Σ weight × error² (weight: the head's share of its layer's output energy) at "
             "the requested average density.", "",
             "**Check the result before keeping it.** The attention error is what this report can measure, not the "
             "picture: on the pack's trained quality testbed, the allocation it computed lowered mc_sparse's PSNR by "
             "0.8 dB at density 0.10, and its predicted gains ranked single-head changes barely better than chance "
             "(rank correlation 0.10; docs/calibration.md). Sample once with the calibrated densities and once "
             "uniform, and compare them against a dense run (Sparse Attention Compare).", ""]
    for a in allocations:
        cs = [c for c in curves if c.method == a.method]
        lw = "" if not a.layer_weights else "; layer weights " + ", ".join(
            f"{la}: {w:.3g}" for la, w in sorted(a.layer_weights.items()))
        lines += [f"## {a.method} at average density {a.target:g} (objective: {a.objective}{lw})", "",
                  f"Predicted Σ weight × error²: uniform {a.cost_uniform:.5f}, calibrated {a.cost_calibrated:.5f} "
                  f"({_ratio_db(a)} lower). Computed density (mean of the heads, measured): "
                  f"{a.mean_achieved:.4f}, as the uniform density's; configured densities average "
                  f"{a.mean_density:.4f}.", "",
                  f"`layer_densities: {layer_densities_text(a.factors)}`", "",
                  "| layer | head | weight | density | computed | factor | error at uniform | error calibrated "
                  "| fresh at uniform |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for c in cs:
            d = a.densities[(c.layer, c.head)]
            lines.append(f"| {c.layer} | {c.head} | {c.weight:.3f} | {d:.4f} | {a.achieved[(c.layer, c.head)]:.4f} | "
                         f"{d / a.target:.3f} | "
                         f"{c.error_at(a.objective, a.target):.4f} | {c.error_at(a.objective, d):.4f} | "
                         f"{c.error_at('fresh', a.target):.4f} |")
        lines.append("")
    for method in dict.fromkeys(c.method for c in curves):
        cs = [c for c in curves if c.method == method]
        for kind in ("reuse", "reuse_plain", "fresh"):
            if cs[0].reuse is None and kind != "fresh":
                continue
            title = {"reuse": "reuse with residual", "reuse_plain": "reuse, no residual", "fresh": "fresh"}[kind]
            lines += [f"### {method}: error against density ({title})", "",
                      "| layer.head | " + " | ".join(format(d, "g") for d in grid) + " |",
                      "|---|" + "---|" * len(grid)]
            for c in cs:
                lines.append(f"| {c.layer}.{c.head} | " + " | ".join(f"{e:.3f}" for e in c.errors(kind)) + " |")
            lines.append("")
    if plot_name:
        lines += [f"![error against density per layer]({plot_name})", ""]
    return "\n".join(lines)


def _pairs_text(pairs, weights) -> str:
    if not pairs:
        return "none (one step: fresh selections only)"
    if weights is None:
        return str(pairs)
    return ", ".join(f"{a}→{b} ({w:.0%} of the reuse steps)" for (a, b), w in zip(pairs, weights))


def plot(curves: list[Curve], allocations: list[Allocation], path: str | Path) -> bool:
    """Error against density per layer and head (one panel per method; the allocation marked), as a PNG. Returns
    False without writing when matplotlib is not importable."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    methods = list(dict.fromkeys(c.method for c in curves))
    fig, axes = plt.subplots(1, len(methods), figsize=(6.5 * len(methods), 4.6), squeeze=False)
    layers = sorted({c.layer for c in curves})
    cmap = plt.get_cmap("viridis")
    for ax, method in zip(axes[0], methods):
        alloc = next((a for a in allocations if a.method == method), None)
        objective = alloc.objective if alloc else ("reuse" if curves[0].reuse is not None else "fresh")
        for c in (c for c in curves if c.method == method):
            color = cmap(layers.index(c.layer) / max(1, len(layers) - 1))
            style = ("-", "--", ":", "-.")[c.head % 4]
            ax.plot(c.densities, c.errors(objective), style, color=color, lw=1.2,
                    label=f"layer {c.layer}" if c.head == 0 else None)
            if alloc is not None:
                d = alloc.densities[(c.layer, c.head)]
                ax.plot([d], [c.error_at(objective, d)], "o", color=color, ms=4)
        if alloc is not None:
            ax.axvline(alloc.target, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("density")
        ax.set_ylabel(f"relative L2 error ({objective})")
        ax.set_title(f"{method}" + (f": dots = calibrated at average {alloc.target:g}" if alloc else ""))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def calibrate(rec: Recording, methods, targets, *, base: SparseConfig | None = None, grid=None, anchors=None,
              objective: str | None = None, layer_weights: dict | None = None, device="cpu",
              progress=None, scope: str = "model"
              ) -> tuple[list[Curve], list[Allocation], list[tuple[int, int]], float]:
    """measure + allocate (``scope`` as in ``allocate``) for every method and target density: (curves, allocations,
    pairs, seconds)."""
    if scope not in SCOPES:
        raise ValueError(f"scope: must be one of {SCOPES}, got {scope!r}")
    t0 = time.perf_counter()
    base = base or SparseConfig()
    for t in targets:
        if not (0 < t <= 1):
            raise ValueError(f"{rec.path.name}: an average density of {t:g} cannot be met: densities lie in (0, 1]")
        if grid is not None and not (min(grid) <= t <= max(grid)):
            raise ValueError(f"{rec.path.name}: an average density of {t:g} cannot be met: the densities measured "
                             f"span {min(grid):g}..{max(grid):g} (every head gets one of them); widen the grid")
    grid = density_grid(targets, grid)
    pairs = pairs_for(rec.steps, anchors, rec.path.name)
    skip = set(base.dense_layers) | set(range(base.warmup_layers))
    layers = [layer for layer in rec.layers if layer not in skip]
    if not layers:
        raise ValueError(f"{rec.path.name}: every recorded layer is dense in the configuration (warmup_layers / "
                         "dense_layers): nothing to calibrate")
    obj = objective or default_objective(base.residual, bool(pairs))
    if obj not in OBJECTIVES:
        raise ValueError(f"objective: must be one of {OBJECTIVES}, got {obj!r}")
    weights = pair_weights(pairs, anchors, rec.total_steps)
    curves = measure(rec, methods, grid, base, pairs=pairs, weights=weights, anchors=anchors, layers=layers,
                     device=device, progress=progress)
    allocations = [allocate([c for c in curves if c.method == m], t, obj, source=rec.path.name,
                            layer_weights=layer_weights, scope=scope) for m in methods for t in targets]
    return curves, allocations, pairs, time.perf_counter() - t0
