"""Where a sampler's steps sit in the whole denoising run, from ComfyUI's own schedulers.

A sampler that runs part of a schedule (KSamplerAdvanced start/end steps, Wan 2.2's two experts, denoise < 1)
receives a slice of a longer sigma schedule. ``clock_for`` finds that schedule: it recomputes ComfyUI's
schedulers at plausible lengths and looks for the slice in them (exact, any scheduler); failing that, the
even spacing of the steps in the model's sigma-table index or timestep places them (engine/schedule.py);
failing that too, the sampler's own steps are the run, and the report says so. The sigmas are first read as the
schedule the sampler runs (nodes/forward.py, ``run_sigmas``: RES4LYF pads them with zeros).
"""

from __future__ import annotations

import logging

import torch

from ..engine import Coordinate, RunClock, locate_run
from ..engine.schedule import OWN_SCHEDULE
from .forward import run_sigmas

log = logging.getLogger(__name__)

MATCH_TOL = 1e-4
MAX_EXTRA = 4  # longest whole run searched: this many times the sampler's steps, plus 16


def sampling_coordinates(ms) -> list[Coordinate]:
    """The coordinates in which ComfyUI's uniform schedulers space steps evenly, for a model sampling object:
    the index in its sigma table ("simple", and "normal" on flow models) and its timestep ("normal" otherwise)."""
    table = ms.sigmas.detach().float().cpu()  # ascending
    log_table = table.clamp(min=1e-12).log()

    def index(s: float) -> float:
        ls = torch.tensor(s).clamp(min=1e-12).log()
        i = int(torch.searchsorted(log_table, ls).clamp(1, len(table) - 1))
        lo, hi = float(log_table[i - 1]), float(log_table[i])
        return (i - 1) + (0.0 if hi == lo else (float(ls) - lo) / (hi - lo))

    def timestep(s: float) -> float:
        return float(ms.timestep(torch.tensor([s], dtype=torch.float32)).reshape(-1)[0])
    t_min, t_max = timestep(float(ms.sigma_min)), timestep(float(ms.sigma_max))
    t_unit = abs(t_max - t_min) / max(1, len(table) - 1)  # one table step: ~1 in [0, 1000], ~1e-3 in [0, 1]
    return [Coordinate("sigma-table index", index, float(len(table) - 1), lambda spacing: spacing - 1),
            Coordinate("timestep", timestep, t_max, lambda spacing: t_min, unit=t_unit)]


def _schedules(ms, steps: int):
    """(name, total, sigmas) of ComfyUI's schedulers at every length that could hold ``steps`` steps."""
    import comfy.samplers as cs

    names = [n for n in getattr(cs, "SCHEDULER_NAMES", ("simple", "normal")) if n in cs.SCHEDULER_HANDLERS]
    for total in range(steps, MAX_EXTRA * steps + 17):
        for name in names:
            try:
                full = cs.calculate_sigmas(ms, name, total).float().cpu()
            except Exception:  # noqa: BLE001 - a scheduler that needs what this model lacks
                continue
            yield name, total, full
            if len(full) > 2:  # samplers that drop the penultimate sigma (uni_pc, dpm_2) run one more step
                yield name + " (penultimate dropped)", total - 1, torch.cat([full[:-2], full[-1:]])


# On a tie, the scheduler users more likely ran (a prefix of sgm_uniform at T steps is one of normal at T + 1).
PRIORITY = ("simple", "normal", "beta", "karras", "exponential", "linear_quadratic", "kl_optimal", "ddim_uniform",
            "sgm_uniform")


def drops_penultimate(sampler) -> bool:
    """Whether ComfyUI's KSampler runs ``sampler`` (a KSAMPLER, the OUTER_SAMPLE wrapper's ``sampler``) on a
    schedule computed one step longer whose penultimate sigma it drops (uni_pc, uni_pc_bh2, dpm_2,
    dpm_2_ancestral: comfy/samplers.py, ``KSampler.DISCARD_PENULTIMATE_SIGMA_SAMPLERS``). Known by the sampler's
    function, as ComfyUI's ``sampler_object`` makes it for those names; False when it cannot tell."""
    fn = getattr(sampler, "sampler_function", None)
    if fn is None:
        return False
    try:
        import comfy.samplers as cs

        names = getattr(cs.KSampler, "DISCARD_PENULTIMATE_SIGMA_SAMPLERS", ())
    except Exception:  # noqa: BLE001 - outside ComfyUI
        return False
    for name in names:
        try:
            if getattr(cs.sampler_object(name), "sampler_function", None) is fn:
                return True
        except Exception:  # noqa: BLE001 - a name this ComfyUI cannot make
            continue
    return False


def called_by_ksampler(max_depth: int = 48) -> bool:
    """Whether ComfyUI's KSampler (the KSampler / KSamplerAdvanced nodes) is sampling: a ``KSampler.sample`` frame
    on the stack. Only KSampler drops the penultimate sigma; SamplerCustom(Advanced) with BasicScheduler and
    SplitSigmas runs the same samplers on plain schedules, so ``drops_penultimate`` alone cannot settle the tie."""
    try:
        import sys

        import comfy.samplers as cs

        frame = sys._getframe(1)
    except Exception:  # noqa: BLE001 - outside ComfyUI, or no frame access
        return False
    for _ in range(max_depth):
        if frame is None:
            return False
        if frame.f_code.co_name == "sample" and isinstance(frame.f_locals.get("self"), cs.KSampler):
            return True
        frame = frame.f_back
    return False


def match_schedule(values: list[float], ms, prefer_dropped: bool = False) -> RunClock | None:
    """The slice ``values`` found in one of ComfyUI's schedules for ``ms``, as a RunClock, or None. A prefix
    can fit several schedules (e.g. sgm_uniform at T steps and normal at T + 1): the most common scheduler
    among those that fit at the two shortest lengths wins.

    ``prefer_dropped``: KSampler runs the sampler with the penultimate sigma dropped (``drops_penultimate`` and
    ``called_by_ksampler``).
    The first part of a split of such a run (KSamplerAdvanced 0-10 of 20 with uni_pc) is a prefix of the
    (T + 1)-step schedule both as it is and with its penultimate sigma dropped (T steps); the dropped one is the
    run KSampler made, and the one the second part (which ends at 0) is placed in, so it wins the tie and both
    parts count their steps in the same T-step run (docs/method.md, "Schedule")."""
    part = torch.tensor(values, dtype=torch.float32)
    n = len(values)
    ends = values[-1] == 0.0
    found: list[tuple[int, str, int]] = []  # (start, name, total)
    first_total = None
    for name, total, full in _schedules(ms, n - 1):
        if first_total is not None and total > first_total + 1:
            break
        if len(full) < n:
            continue
        starts = range(len(full) - n, len(full) - n + 1) if ends else range(0, len(full) - n + 1)
        for start in starts:
            if torch.allclose(full[start:start + n], part, atol=MATCH_TOL, rtol=MATCH_TOL):
                if start == 0 and ends:
                    return RunClock(0, n - 1, OWN_SCHEDULE)
                found.append((start, name, total))
                first_total = total if first_total is None else first_total
                break
    if not found:
        return None

    def rank(item):
        base = item[1].split(" ")[0]
        dropped = item[1].endswith(" (penultimate dropped)")
        return (PRIORITY.index(base) if base in PRIORITY else len(PRIORITY), dropped != prefer_dropped, item[2])
    start, name, total = min(found, key=rank)
    return RunClock(start, total, f"the {total}-step '{name}' schedule this sampler is part of")


def _without_inserted_sigma_min(raw: list[float], values: list[float], ms) -> list[float]:
    """``values`` (``run_sigmas`` of ``raw``) without the sigma_min RES4LYF inserts before the final 0 of a chained
    sampler's padded schedule (``run_sigmas``), unless the schedule with it is one of ComfyUI's (karras and
    exponential end at sigma_min themselves, and RES4LYF inserts nothing there): a 20-step run handed on as
    ``[0, s0 .. s19, sigma_min, 0, 0]`` is that 20-step run, not a 21- or 23-step one (docs/method.md,
    "Schedule")."""
    trimmed = run_sigmas(raw, float(ms.sigma_min))
    if trimmed == values or match_schedule(values, ms) is not None:
        return values
    return trimmed


def clock_for(sigmas, ms, sampler=None) -> RunClock:
    """RunClock of a sampler running ``sigmas`` (1-D tensor, descending; rising for inversion; as the sampler hands
    them to ComfyUI, padded or not: ``run_sigmas``) with model sampling object ``ms``.
    ``sampler``: the KSAMPLER that runs them, when known (it settles a tie of split schedules,
    ``match_schedule``'s ``prefer_dropped``)."""
    if not isinstance(sigmas, torch.Tensor) or sigmas.numel() < 2:
        return RunClock()
    raw = sigmas.reshape(-1).tolist()
    values = run_sigmas(raw)  # without the zeros RES4LYF pads its sigmas with (nodes/forward.py)
    if ms is None:
        return RunClock(0, len(values) - 1, "the sampler's own steps (no model sampling object)")
    try:
        values = _without_inserted_sigma_min(raw, values, ms)
        coords = sampling_coordinates(ms)
        whole = locate_run(values, coords)
        if whole.exact:
            return whole
        found = match_schedule(values, ms, prefer_dropped=drops_penultimate(sampler))
        return found if found is not None else whole
    except Exception as exc:  # noqa: BLE001 - an unusual sampling object: the sampler's own steps
        log.debug("sparse attention: cannot place the sampler in its run (%s)", exc)
        return RunClock(0, len(values) - 1, "the sampler's own steps (its sigmas could not be placed)")
