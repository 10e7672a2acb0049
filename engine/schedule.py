"""The denoising schedule: warm-up and anchor steps, given as steps or as fractions of the run, and where one
sampler's steps sit in the whole run (docs/method.md, "Schedule").

Steps are indices in the *whole* denoising trajectory: a run split across samplers (KSamplerAdvanced
start/end steps; Wan 2.2's two experts) counts its steps from the start of the trajectory, so "anchors at 50 %"
means the middle of the whole run for both samplers. ``locate_run`` places a sampler's sigmas in that
trajectory; fractions resolve against its step count.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Sequence

from .messages import MAX_TEXT, shown

MAX_ITEMS = 10_000  # listed anchor steps (a schedule never lists more steps than a run has)
STAND_IN_SHARE = 0.05  # an anchor the schedule did not place, at the first sparse step of a sampler that starts
# mid-run, stands in for the scheduled anchors this share of the run after it (at least the next step): Wan 2.2's
# low-noise expert under a whole-run preset anchored at 50 % (its first step) and again at 53 %; the experts' own
# schedule, 0, 20 % and 50 %, holds 32.9 dB at 20 steps (docs/decisions.md, "A sampler's first anchor stands in")
_NUM = r"\d+(?:\.\d*)?|\.\d+"


def _fraction(value: float, name: str) -> float:
    f = float(value)
    if not (0.0 < f <= 1.0) or not math.isfinite(f):
        raise ValueError(f"{name}: a fraction of the run must lie in (0, 1] (e.g. 0.2 or '20%'), got {shown(value)}")
    return f


def _read_item(text: str, name: str) -> int | float:
    """'12' -> step 12; '20%' -> 0.2; '0.2' -> 0.2 (fractions lie in (0, 1])."""
    t = text.strip()
    if len(t) > 32:  # no step count or fraction is this long (and int() refuses over 4300 digits)
        raise ValueError(f"{name}: cannot read {shown(text)} (a step like 10, or a fraction of the run like 20%)")
    if re.fullmatch(r"\d+", t):
        return int(t)
    m = re.fullmatch(rf"({_NUM})\s*%", t)
    if m:
        return _fraction(float(m.group(1)) / 100.0, name)
    if re.fullmatch(_NUM, t):
        return _fraction(float(t), name)
    raise ValueError(f"{name}: cannot read {shown(text)} (a step like 10, or a fraction of the run like 20% or 0.2)")


def resolve_fraction(f: float, total: int) -> int:
    """Step index of fraction ``f`` of a ``total``-step run (rounded half up, within [0, total - 1])."""
    return max(0, min(total - 1, math.floor(f * total + 0.5)))


def parse_warmup(value) -> int | float:
    """Warm-up as steps (int >= 0) or a fraction of the run (float in (0, 1]): 10, '10', '10%', 0.1."""
    if isinstance(value, bool):
        raise ValueError(f"warmup_steps: expected steps or a fraction of the run, got {shown(value)}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"warmup_steps: must be a non-negative integer or a fraction, got {shown(value)}")
        return value
    if isinstance(value, float):
        if value.is_integer() and value >= 1:
            raise ValueError(f"warmup_steps: write whole steps without a decimal point (got {shown(value)})")
        return _fraction(value, "warmup_steps")
    if isinstance(value, str):
        return _read_item(value, "warmup_steps") if value.strip() else 0
    raise ValueError(f"warmup_steps: expected steps or a fraction of the run, got {type(value).__name__}")


def warmup_text(value: int | float) -> str:
    """The widget form of a warm-up: '10' or '10%'."""
    return str(value) if isinstance(value, int) else f"{value * 100:g}%"


def resolve_warmup(value: int | float, total: int | None) -> int:
    """Dense warm-up steps of a run of ``total`` steps (a fraction of an unknown total counts 0 steps)."""
    if isinstance(value, int):
        return value
    return 0 if total is None else math.floor(value * total + 0.5)


def reuse_steps(schedule: "AnchorSchedule", warmup_steps: int | float, first: int, count: int,
                total: int | None) -> int:
    """How many of the steps ``first`` .. ``first + count - 1`` of a run of ``total`` steps reuse a cached selection,
    decided as the engine decides them (engine/engine.py, ``decide``): warm-up steps dense, the first sparse step an
    anchor (standing in for the scheduled anchors just after it when the sampler starts mid-run off the schedule:
    ``AnchorSchedule.due``), then an anchor wherever an anchor step lies since the last one, a reuse step
    otherwise."""
    warmup = resolve_warmup(warmup_steps, total)
    last, stand_in, reuse = None, False, 0
    for step in range(first, first + count):
        if step < warmup:
            continue
        if last is None:
            last, stand_in = step, first > 0 and not schedule.is_anchor(step, warmup, total)
        elif schedule.due(last, step, warmup, total, stand_in):
            last, stand_in = step, False
        else:
            reuse += 1
    return reuse


@dataclass(frozen=True)
class AnchorSchedule:
    """Anchor steps: explicit steps and fractions of the run, and/or every ``every`` steps (or every fraction
    ``every_fraction`` of the run) after the warm-up. The first sparse step of a run is always an anchor (the
    engine's rule), so the empty schedule means "one anchor, at the first sparse step"."""

    steps: tuple[int, ...] = ()
    every: int = 0
    fractions: tuple[float, ...] = ()
    every_fraction: float | None = None

    @staticmethod
    def parse(value) -> "AnchorSchedule":
        """Accepts "10,26", [10, 26], "20%, 50%", [0.2, 0.5], "every 5", "every 25%", "0 + every 5",
        {"steps": [...], "every": N}, 5 (= every 5) or "" (none). Errors name ``anchor_steps``."""
        if isinstance(value, AnchorSchedule):
            return value
        if value is None or value == "" or value == [] or value == ():
            return AnchorSchedule()
        if isinstance(value, bool):
            raise ValueError("anchor_steps: expected a list of steps or 'every N', got a boolean")
        if isinstance(value, int):
            return AnchorSchedule.parse(f"every {value}")
        if isinstance(value, dict):
            unknown = sorted(shown(k) for k in set(value) - {"steps", "every"})
            if unknown:
                raise ValueError(f"anchor_steps: unknown key(s) {', '.join(unknown)}; known: 'every', 'steps'")
            items = value.get("steps", ()) or ()
            if isinstance(items, (int, float, str)) and not isinstance(items, bool):
                items = [items]  # one step
            if not isinstance(items, (list, tuple)):
                raise ValueError(f"anchor_steps: steps: expected a list of steps, got {shown(items)}")
            items = list(items)
            every = value.get("every")
            if every is not None and (isinstance(every, bool) or not isinstance(every, (int, float, str))):
                raise ValueError(f"anchor_steps: every: expected a step count or a fraction, got {shown(every)}")
            text = [str(every if not isinstance(every, float) else f"{every!r}")] if every is not None else []
            base = AnchorSchedule.parse(items) if items else AnchorSchedule()
            extra = AnchorSchedule.parse("every " + text[0]) if text else AnchorSchedule()
            return AnchorSchedule(base.steps, extra.every, base.fractions, extra.every_fraction)
        if isinstance(value, (list, tuple)):
            if len(value) > MAX_ITEMS:
                raise ValueError(f"anchor_steps: {len(value)} steps listed (at most {MAX_ITEMS})")
            items = []
            for v in value:
                if isinstance(v, bool) or not isinstance(v, (int, float, str)):
                    raise ValueError(f"anchor_steps: expected steps or fractions, got {shown(v)}")
                if isinstance(v, float):
                    items.append(_fraction(v, "anchor_steps"))
                elif isinstance(v, int):
                    if v < 0:
                        raise ValueError(f"anchor_steps: steps must be non-negative, got {shown(v)}")
                    items.append(v)
                else:
                    items.append(_read_item(v, "anchor_steps"))
            return AnchorSchedule._of(items, 0, None)
        if isinstance(value, str):
            if len(value) > MAX_TEXT:
                raise ValueError(f"anchor_steps: {len(value)} characters (at most {MAX_TEXT}): {shown(value)}")
            items, every, every_f = [], 0, None
            for part in re.split(r"[,;+]", value):
                p = part.strip().lower()
                if not p:
                    continue
                if p.startswith("every"):
                    num = p[5:].strip(" :=")
                    item = _read_item(num, "anchor_steps") if num else None
                    if item is None or item == 0:
                        raise ValueError(f"anchor_steps: cannot read {shown(value)} ('every N' needs N >= 1 steps "
                                         "or a fraction like 'every 25%')")
                    if isinstance(item, int):
                        every = item
                    else:
                        every_f = item
                    continue
                items.append(_read_item(p, "anchor_steps"))
            return AnchorSchedule._of(items, every, every_f)
        raise ValueError(f"anchor_steps: unsupported value {shown(value)}")

    @staticmethod
    def _of(items, every, every_fraction) -> "AnchorSchedule":
        steps = tuple(sorted({i for i in items if isinstance(i, int)}))
        fractions = tuple(sorted({i for i in items if isinstance(i, float)}))
        return AnchorSchedule(steps, every, fractions, every_fraction)

    @property
    def relative(self) -> bool:
        """True when some anchors are fractions of the run (they need the run's step count)."""
        return bool(self.fractions) or self.every_fraction is not None

    def period(self, total: int | None) -> int:
        """Steps between periodic anchors for a run of ``total`` steps (0: none)."""
        if self.every_fraction is not None and total:
            return max(1, math.floor(self.every_fraction * total + 0.5))
        return self.every

    def resolved(self, total: int | None) -> frozenset[int]:
        """The explicit anchor steps of a run of ``total`` steps (fractions resolved; none when unknown)."""
        out = set(self.steps)
        if total:
            out.update(resolve_fraction(f, total) for f in self.fractions)
        return frozenset(out)

    def is_anchor(self, step: int, warmup_steps: int, total: int | None = None) -> bool:
        """Whether ``step`` (of a run of ``total`` steps) recomputes the selection."""
        if step in self.resolved(total):
            return True
        every = self.period(total)
        return every > 0 and step >= warmup_steps and (step - warmup_steps) % every == 0

    def anchor_between(self, last: int, step: int, warmup_steps: int, total: int | None = None) -> bool:
        """Whether an anchor step lies in (last, step]: the selection anchored at ``last`` is due for renewal at
        ``step`` even when the anchor step itself never ran (a step cache such as EasyCache skipped the model
        call), so the next computed step anchors instead."""
        if step <= last:
            return False
        if any(last < s <= step for s in self.resolved(total)):
            return True
        every = self.period(total)
        if every <= 0:
            return False
        lo = max(last + 1, warmup_steps)
        if lo > step:
            return False
        first = warmup_steps + -(-(lo - warmup_steps) // every) * every  # first periodic anchor at or after lo
        return first <= step

    def span_index(self, step: int, warmup_steps: int, total: int | None = None) -> int:
        """Which anchor span of the run ``step`` lies in: 0 from the first sparse step (``warmup_steps``, always an
        anchor) up to the next anchor step, 1 from there to the one after, ...; -1 during the warm-up. It depends on
        the schedule alone, so every call of a step agrees whichever batch chunk it serves, whichever sampler of a
        split run makes it, and whether the step anchors on the schedule or off it (a stand-in, or a new anchor
        after a dropped entry: it takes the span of the step it runs at)."""
        if step < warmup_steps:
            return -1
        points = {s for s in self.resolved(total) if warmup_steps < s <= step}
        every = self.period(total)
        if every > 0:
            points.update(range(warmup_steps + every, step + 1, every))
        return len(points)

    def stand_in_steps(self, total: int | None) -> int:
        """How many steps after a stand-in anchor (``due``) its selection serves the schedule's own anchors: 5 % of
        the run, at least 1 (1 when the run's length is unknown)."""
        return max(1, int(STAND_IN_SHARE * total)) if total else 1

    def due(self, last: int, step: int, warmup_steps: int, total: int | None = None, stand_in: bool = False) -> bool:
        """Whether the selection anchored at ``last`` is renewed at ``step`` (``anchor_between``). ``stand_in``: the
        anchor at ``last`` was the first sparse step, off the schedule, of a sampler that starts mid-run (a split
        run's later sampler, or denoise < 1): it stands in for the listed anchors (steps and fractions) up to
        ``stand_in_steps`` after it, whose selection would be hardly fresher; periodic anchors keep their period."""
        if not stand_in:
            return self.anchor_between(last, step, warmup_steps, total)
        listed, periodic = self._parts
        return listed.anchor_between(last + self.stand_in_steps(total), step, warmup_steps, total) \
            or periodic.anchor_between(last, step, warmup_steps, total)

    @cached_property
    def _parts(self) -> tuple["AnchorSchedule", "AnchorSchedule"]:
        """(the listed steps and fractions, the periodic anchors) as two schedules, built once per schedule."""
        return (AnchorSchedule(self.steps, 0, self.fractions, None),
                AnchorSchedule((), self.every, (), self.every_fraction))

    def text(self) -> str:
        """The widget form, e.g. "10,26", "20%,50%", "every 5", "0 + every 25%" or "" (parse round-trips)."""
        items = [str(s) for s in self.steps] + [f"{f * 100:g}%" for f in self.fractions]
        parts = [",".join(items)] if items else []
        if self.every:
            parts.append(f"every {self.every}")
        if self.every_fraction is not None:
            parts.append(f"every {self.every_fraction * 100:g}%")
        return " + ".join(parts)

    def describe(self) -> str:
        return self.text() or "first sparse step only"


@dataclass(frozen=True)
class RunClock:
    """Where a sampler's steps sit in the whole denoising run. offset: the run step of the sampler's step 0;
    total: the run's steps, or None when unknown; source: how this was found (shown in the report)."""

    offset: int = 0
    total: int | None = None
    source: str = "step counting (no sigma schedule)"

    @property
    def exact(self) -> bool:
        return self.source == OWN_SCHEDULE


OWN_SCHEDULE = "the sampler's sigma schedule"
SPLIT_SCHEDULE = "the sampler's sigmas, placed in a longer run (split sampling)"
UNPLACED = "the sampler's own steps (its sigmas could not be placed in a longer run)"


@dataclass(frozen=True)
class Coordinate:
    """A monotone map from sigma to a coordinate in which some schedulers space their steps evenly.

    of(sigma) -> coordinate (larger for larger sigma); top: the coordinate of the model's largest sigma;
    bottom(spacing): the coordinate of the smallest non-zero sigma of a whole schedule with that spacing.
    ComfyUI's "simple" scheduler is even in the index of the model's sigma table (bottom = spacing - 1);
    "normal" and "sgm_uniform" are even in the model's timestep (bottom = timestep of the smallest sigma).
    unit: one step of the model's sigma table in this coordinate, the scale of the tolerances: 1 for the index and
    for timesteps in [0, 1000]; for flow models whose timestep is sigma itself, in [0, 1], 1e-3 (1 000-entry tables:
    Qwen-Image, Chroma, Lumina 2) or 1e-4 (Flux and LTX, 10 000 entries), where a tolerance of one unit would take
    every sigma for the top."""

    name: str
    of: Callable[[float], float]
    top: float
    bottom: Callable[[float], float]
    unit: float = 1.0


def locate_run(sigmas: Sequence[float], coordinates: Sequence[Coordinate]) -> RunClock:
    """Place one sampler's sigma schedule (descending; its L steps are L+1 sigmas) in the whole trajectory.

    A schedule that starts at the model's largest sigma and ends at sigma 0 is the whole run. Otherwise
    (KSamplerAdvanced start/end steps, denoise < 1) it is a part of a longer run: in the first coordinate
    where its steps are evenly spaced, the spacing gives how many steps came before and come after. If no
    coordinate spaces them evenly (karras, exponential, custom sigmas), the sampler's own steps are the run.
    """
    sig = [float(x) for x in sigmas]
    steps = len(sig) - 1
    if steps < 1:
        return RunClock(0, max(1, steps), OWN_SCHEDULE)
    ends = sig[-1] <= 0.0
    live = sig[:-1] if ends else sig  # the last step down to sigma 0 is not evenly spaced in any coordinate
    best = None  # (spread, coordinate, values, spacing): the coordinate that spaces the steps most evenly
    for coord in coordinates:
        c = [float(coord.of(x)) for x in live]
        starts = abs(c[0] - coord.top) <= max(1.01 * coord.unit, 5e-3 * abs(coord.top))
        if starts and ends:
            return RunClock(0, steps, OWN_SCHEDULE)
        diffs = [a - b for a, b in zip(c, c[1:])]
        if not diffs or min(diffs) <= 0:
            continue
        mean = sum(diffs) / len(diffs)
        spread = (max(diffs) - min(diffs)) / mean
        even = max(diffs) - min(diffs) <= 0.1 * mean + 1.01 * coord.unit
        if (len(diffs) == 1 or even) and (best is None or spread < best[0]):
            best = (spread, coord, c, mean, starts)
    if best is not None:
        _, coord, c, mean, starts = best
        before = 0 if starts else max(0, math.floor((coord.top - c[0]) / mean + 0.5))
        after = 0 if ends else max(1, math.floor((c[-1] - coord.bottom(mean)) / mean + 0.5) + 1)
        return RunClock(before, before + steps + after, SPLIT_SCHEDULE)
    return RunClock(0, steps, UNPLACED)
