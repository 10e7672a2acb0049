"""Settings of the quality benchmark (bench/quality.py): schedules, step counting, the quick / full grids, YAML
grids and the run-time estimate.

A setting is a plain JSON-able dict:

    id        stable identity ("30|block_topk|b64|d0.15|w3 a3,12,21"), used to merge and resume runs
    steps     sampler steps of the run (30, 8, 4, ...)
    kind      "engine" (the pack's engine, ``config`` = SparseConfig fields) or "sol" (ComfyUI's Sol-Attn:
              ``sol`` = {"density", "dense_steps"}: dense attention at those steps, Sol-Attn at the others)
    family    mc_sparse | block_topk | block_topk+select (select_every_step) | sol | dense
    label     the method part in words ("mc_sparse g64 d0.15"); schedule: the schedule part ("w3 a3,12,21")
    tier      priority (1 first); a grid is run in list order, so a time budget cuts the last tiers

Step kinds follow the engine's decisions at step granularity (engine/engine.py ``decide``): steps before
``warmup_steps`` are dense, the first sparse step is always an anchor, later steps listed in
``anchor_steps`` are anchors, every other step is a reuse step. ``warmup_layers`` keeps that many layers
dense at every step; it does not change a step's kind.
"""

from __future__ import annotations

import itertools
from pathlib import Path

DENSE, ANCHOR, REUSE, SPARSE = "dense", "anchor", "reuse", "sparse"  # SPARSE: a Sol-Attn step

# (warm-up steps, anchor steps) per step count, in priority order within each count
SCHEDULES = {
    30: [(3, (3, 12, 21)), (0, (0,)), (0, (0, 15)), (1, (1,)), (2, (2, 10))],
    8: [(0, (0,)), (1, (1,)), (0, (0, 4)), (2, (2,))],
    4: [(0, (0,)), (1, (1,)), (0, (0, 2))],
}
REFERENCE_SCHEDULE = (3, (3, 12, 21))  # the testbed README's rows: steps 0-2 dense, anchors 3, 12, 21

# engine fields every testbed setting fixes (the testbed has 16 384 tokens; no call may stay dense by size)
BASE_CONFIG = {"min_tokens": 0, "backend": "auto", "residual": True, "select_every_step": False,
               "warmup_layers": 0}


def anchor_list(value, field: str = "anchor_steps") -> tuple[int, ...]:
    """Explicit anchor steps: a list of non-negative ints or a comma string ("3,12,21"); "" / None: none."""
    if value is None or value == "" or value == []:
        return ()
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",") if p.strip()]
        if not all(p.isdigit() for p in parts):
            raise ValueError(f"{field}: expected a list of step indices such as '3,12,21', got {value!r}")
        return tuple(sorted(int(p) for p in parts))
    if isinstance(value, (list, tuple)) and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                for s in value):
        return tuple(sorted(value))
    raise ValueError(f"{field}: expected a list of non-negative step indices, got {value!r}")


def engine_step_kinds(config: dict, steps: int) -> list[str]:
    """Kind of each of ``steps`` sampler steps under an engine configuration (dict of SparseConfig fields).

    Returns a list of "dense" | "anchor" | "reuse", one per step (see the module docstring)."""
    if config.get("method", "mc_sparse") == "dense":
        return [DENSE] * steps
    warm = config.get("warmup_steps", 0)
    if not isinstance(warm, int) or isinstance(warm, bool) or warm < 0:
        raise ValueError(f"warmup_steps: must be a non-negative integer, got {warm!r}")
    anchors = set(anchor_list(config.get("anchor_steps")))
    kinds, anchored = [], False
    for s in range(steps):
        if s < warm:
            kinds.append(DENSE)
        elif not anchored or s in anchors:
            kinds.append(ANCHOR)
            anchored = True
        else:
            kinds.append(REUSE)
    return kinds


def sol_step_kinds(dense_steps, steps: int) -> list[str]:
    """Sol-Attn has no anchors: "dense" at ``dense_steps``, "sparse" at every other step."""
    dense = set(dense_steps)
    return [DENSE if s in dense else SPARSE for s in range(steps)]


def step_kinds(setting: dict) -> list[str]:
    """Per-step kinds of a setting (engine or Sol)."""
    if setting["kind"] == "sol":
        return sol_step_kinds(setting["sol"]["dense_steps"], setting["steps"])
    return engine_step_kinds(setting["config"], setting["steps"])


def count_kinds(kinds: list[str]) -> dict:
    """{"dense": n, "anchor": n, "reuse": n} (a Sol-Attn step counts as reuse: it runs sparse)."""
    return {DENSE: kinds.count(DENSE), ANCHOR: kinds.count(ANCHOR), REUSE: kinds.count(REUSE) + kinds.count(SPARSE)}


def schedule_label(warmup: int, anchors) -> str:
    """"w3 a3,12,21": 3 dense warm-up steps, anchors at steps 3, 12 and 21; "a0": anchor at step 0 only."""
    return (f"w{warmup} " if warmup else "") + "a" + ",".join(map(str, anchors))


def kinds_label(kinds: list[str]) -> str:
    """The schedule label of the steps as the engine decides them (leading dense steps, anchor steps)."""
    warm = next((i for i, k in enumerate(kinds) if k != DENSE), len(kinds))
    return schedule_label(warm, [i for i, k in enumerate(kinds) if k == ANCHOR])


def _fmt(x: float) -> str:
    return format(x, "g")


def engine_setting(steps: int, family: str, density: float, size: int, schedule: tuple, tier: int,
                   warmup_layers: int = 0, residual: bool = True) -> dict:
    """One engine setting. family: mc_sparse (size = group_size) | block_topk | block_topk+select (size =
    block_q = block_k); schedule: (warm-up steps, anchor steps)."""
    warm, anchors = schedule
    method = "mc_sparse" if family == "mc_sparse" else "block_topk"
    cfg = dict(method=method, density=density, warmup_steps=warm, anchor_steps=list(anchors),
               warmup_layers=warmup_layers, residual=residual, select_every_step=family == "block_topk+select")
    if method == "mc_sparse":
        cfg.update(group_size=size, block_q=128, block_k=128)
        size_tag = f"g{size}"
    else:
        cfg.update(block_q=size, block_k=size, group_size=128)
        size_tag = f"b{size}"
    # the built-in grids keep measuring the residual as cached, as every run before the weighting did (their rows
    # stay comparable); the weighting has its own grids (bench/grids/residual_mass*.yaml)
    cfg.update(min_tokens=BASE_CONFIG["min_tokens"], backend=BASE_CONFIG["backend"], residual_weighting="fixed")
    extra = (f" wl{warmup_layers}" if warmup_layers else "") + ("" if residual else " nores")
    label = f"{family} {size_tag} d{_fmt(density)}{extra}"
    sched = kinds_label(engine_step_kinds(cfg, steps))
    return dict(id=f"{steps}|{family}|{size_tag}|d{_fmt(density)}{extra.replace(' ', '|')}|{sched}", steps=steps,
                kind="engine", family=family, label=label, schedule=sched, tier=tier, config=cfg)


def sol_setting(steps: int, density: float, dense_steps, tier: int) -> dict:
    dense_steps = sorted(set(dense_steps))
    sched = "dense " + ",".join(map(str, dense_steps))
    return dict(id=f"{steps}|sol|d{_fmt(density)}|{sched}", steps=steps, kind="sol", family="sol",
                label=f"sol d{_fmt(density)}", schedule=sched, tier=tier,
                sol={"density": density, "dense_steps": dense_steps})


def dense_check_setting(steps: int) -> dict:
    """Every call through the adapter with method dense: must reproduce the reference exactly."""
    return dict(id=f"{steps}|dense|adapter", steps=steps, kind="engine", family="dense", label="engine dense",
                schedule="all dense", tier=1, config=dict(method="dense", **BASE_CONFIG))


def sol_dense_steps(steps: int, schedule: tuple) -> list[int]:
    """The steps an engine schedule computes densely (warm-up and anchors): Sol-Attn is dense there."""
    warm, anchors = schedule
    kinds = engine_step_kinds({"warmup_steps": warm, "anchor_steps": list(anchors)}, steps)
    return [s for s, k in enumerate(kinds) if k != REUSE]


def quick_grid(step_counts=(30, 8, 4)) -> list[dict]:
    """The quick grid in priority order (about 6 minutes of H200 time with model load and references; see
    ``estimate_seconds``)."""
    out: list[dict] = []
    main = (("mc_sparse", 64), ("block_topk", 64))
    sel = ("block_topk+select", 64)

    def add(steps, fam_size, densities, schedules, tier, **kw):
        if steps not in step_counts:
            return
        for (fam, size), d, sch in itertools.product(fam_size, densities, schedules):
            out.append(engine_setting(steps, fam, d, size, sch, tier, **kw))

    def add_sol(steps, densities, schedules, tier):
        if steps not in step_counts:
            return
        for d, sch in itertools.product(densities, schedules):
            out.append(sol_setting(steps, d, sol_dense_steps(steps, sch), tier))

    s30, s8, s4 = SCHEDULES[30], SCHEDULES[8], SCHEDULES[4]
    # tier 1: the adapter check, the README's reference rows, the fastest schedules at 0.15 / 0.1
    if 30 in step_counts:
        out.append(dense_check_setting(30))
    add(30, main, (0.15,), s30[:4], 1)
    add(30, main, (0.1,), s30[1:4], 1)
    add(30, (sel,), (0.15, 0.1), s30[1:2], 1)
    add_sol(30, (0.15,), s30[:1], 1)
    add(8, main + (sel,), (0.15,), s8[:2], 1)
    add(4, main + (sel,), (0.15,), s4[:2], 1)
    # tier 2: the rest of the main schedules and densities, Sol-Attn on every distinct dense-step set
    add(30, main, (0.1,), s30[:1], 2)
    add(30, main, (0.15, 0.1), s30[4:], 2)
    add(30, main, (0.25,), (s30[0], s30[1], s30[3]), 2)
    add(30, (sel,), (0.15, 0.1), (s30[2], s30[3]), 2)
    add(30, (sel,), (0.25,), s30[1:2], 2)
    add_sol(30, (0.25, 0.15, 0.1), s30, 2)
    add(8, main + (sel,), (0.15,), s8[2:], 2)
    add(8, main + (sel,), (0.1,), s8, 2)
    add(8, main, (0.25,), s8, 2)
    add_sol(8, (0.25, 0.15, 0.1), s8, 2)
    add(4, main + (sel,), (0.15,), s4[2:], 2)
    add(4, main + (sel,), (0.1,), s4, 2)
    add(4, main, (0.25,), s4, 2)
    add_sol(4, (0.25, 0.15, 0.1), s4, 2)
    # tier 3: group / block size 128, warm-up layers, residual off, density 0.05, selection every step at 0.25
    big = (("mc_sparse", 128), ("block_topk", 128))
    add(30, big, (0.15, 0.1), (s30[0], s30[1], s30[3]), 3)
    add(8, big, (0.15,), s8[:2], 3)
    add(4, big, (0.15,), s4[:2], 3)
    add(30, main, (0.15,), s30[1:2], 3, warmup_layers=1)
    add(30, main[1:], (0.1,), s30[2:3], 3, warmup_layers=1)
    add(30, main[:1], (0.15,), s30[:1], 3, residual=False)
    add(30, main, (0.05,), s30[:2], 3)
    add(8, main, (0.05,), s8[:1], 3)
    add(4, main, (0.05,), s4[:1], 3)
    add(8, (sel,), (0.25,), s8[:2], 3)
    add(4, (sel,), (0.25,), s4[:2], 3)
    return _dedupe(out)


def full_grid(step_counts=(30, 8, 4)) -> list[dict]:
    """The quick grid first, then every family x size x density x schedule, warm-up layers 1 and residual off
    on the main families, Sol-Attn at 0.05 too (several device calls: resume with --skip-from)."""
    out = quick_grid(step_counts)
    fams = (("mc_sparse", 64), ("block_topk", 64), ("block_topk+select", 64), ("mc_sparse", 128),
            ("block_topk", 128))
    for steps in step_counts:
        for sch in SCHEDULES.get(steps, ()):
            for (fam, size), d in itertools.product(fams, (0.25, 0.15, 0.1, 0.05)):
                out.append(engine_setting(steps, fam, d, size, sch, 4))
            for (fam, size), d in itertools.product(fams[:2], (0.15, 0.1)):
                out.append(engine_setting(steps, fam, d, size, sch, 5, warmup_layers=1))
                out.append(engine_setting(steps, fam, d, size, sch, 5, residual=False))
            for d in (0.25, 0.15, 0.1, 0.05):
                out.append(sol_setting(steps, d, sol_dense_steps(steps, sch), 5))
    return _dedupe(out)


def _dedupe(settings: list[dict]) -> list[dict]:
    seen, out = set(), []
    for s in settings:
        if s["id"] not in seen:
            seen.add(s["id"])
            out.append(s)
    return out


def grid_from_yaml(path: str | Path) -> list[dict]:
    """A YAML grid: ``settings:`` list (or a bare list) of entries, in priority order, each either

        {steps: 30, sparse: {SparseConfig fields}, label: optional, family: optional}
        {steps: 30, sol: {density: 0.15, dense_steps: [0, 1, 2]}}

    Engine entries get the testbed's fixed fields (min_tokens 0, backend auto) unless they set them."""
    import yaml

    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"{path.name}: cannot read the grid ({exc})") from None
    items = doc.get("settings") if isinstance(doc, dict) else doc
    if not isinstance(items, list) or not items:
        raise ValueError(f"{path.name}: expected a non-empty list under 'settings'")
    out = []
    for i, item in enumerate(items):
        where = f"{path.name}: settings[{i}]"
        if not isinstance(item, dict) or not isinstance(item.get("steps"), int) or item["steps"] < 1:
            raise ValueError(f"{where}: needs 'steps' (a positive integer)")
        steps = item["steps"]
        if "sol" in item:
            sol = item["sol"]
            if not isinstance(sol, dict) or "density" not in sol:
                raise ValueError(f"{where}.sol: needs 'density' and 'dense_steps'")
            out.append(sol_setting(steps, float(sol["density"]), anchor_list(sol.get("dense_steps"),
                                                                               f"{where}.sol.dense_steps"), i + 1))
            continue
        cfg = item.get("sparse")
        if not isinstance(cfg, dict):
            raise ValueError(f"{where}: needs a 'sparse' mapping of SparseConfig fields or a 'sol' mapping")
        cfg = {**cfg, **{k: v for k, v in BASE_CONFIG.items() if k not in cfg}}
        cfg["anchor_steps"] = list(anchor_list(cfg.get("anchor_steps"), f"{where}.sparse.anchor_steps"))
        method = cfg.get("method", "mc_sparse")
        family = item.get("family") or ("block_topk+select" if method == "block_topk" and cfg["select_every_step"]
                                        else method)
        sched = kinds_label(engine_step_kinds(cfg, steps)) if method != "dense" else "all dense"
        label = item.get("label") or f"{family} d{_fmt(cfg.get('density', 0.15))}"
        key = ",".join(f"{k}={cfg[k]}" for k in sorted(cfg))
        out.append(dict(id=f"{steps}|yaml|{key}", steps=steps, kind="engine", family=family, label=label,
                        schedule=sched, tier=i + 1, config=cfg))
    return _dedupe(out)


def load_grid(name: str, step_counts) -> list[dict]:
    """quick | full | a YAML file; only settings whose step count is in ``step_counts``."""
    if name == "quick":
        grid = quick_grid(tuple(step_counts))
    elif name == "full":
        grid = full_grid(tuple(step_counts))
    elif name.endswith((".yaml", ".yml")):
        grid = grid_from_yaml(name)
    else:
        raise ValueError(f"--grid: expected quick, full or a .yaml file, got {name!r}")
    return [s for s in grid if s["steps"] in set(step_counts)]


# ---- run-time estimate ---------------------------------------------------------------------------------

# Seconds of one step of the testbed (8 videos of 16 384 tokens, 8 layers) in multiples of a dense step;
# compile: first use of a kernel family in the process (Triton compilation and autotuning).
ANCHOR_X = {"mc_sparse": 5.0, "block_topk": 2.0}
REUSE_X = {"mc_sparse": 1.0, "block_topk": 0.9, "block_topk+select": 1.3, "sol": 1.0, "dense": 1.0}
COMPILE_S = {"mc_sparse": 25.0, "block_topk": 15.0, "sol": 5.0, "dense": 5.0}  # dense: importing the engine
ROW_OVERHEAD_S = 0.3  # engine set-up, PSNR / SSIM, writing the JSON


def kernel_signature(setting: dict) -> tuple:
    """What a first use compiles: the method and its tile sizes."""
    if setting["kind"] == "sol":
        return ("sol",)
    c = setting["config"]
    if c.get("method") == "dense":
        return ("dense",)
    size = c.get("group_size") if c.get("method") == "mc_sparse" else c.get("block_q")
    return (c.get("method"), size)


def estimate_seconds(setting: dict, dense_step_s: float, compiled: set | None = None) -> float:
    """Estimated seconds of one setting (compilation counted when its signature is not in ``compiled``)."""
    n = count_kinds(step_kinds(setting))
    fam = setting["family"]
    method = "block_topk" if fam.startswith("block_topk") else fam
    t = dense_step_s * (n[DENSE] + ANCHOR_X.get(method, 1.0) * n[ANCHOR] + REUSE_X.get(fam, 1.0) * n[REUSE])
    sig = kernel_signature(setting)
    if compiled is not None and sig not in compiled:
        t += COMPILE_S.get(sig[0], 15.0)
    return t + ROW_OVERHEAD_S


def estimate_grid(settings: list[dict], dense_step_s: float) -> tuple[float, dict]:
    """(total seconds, seconds per tier) of running ``settings`` in order in one process."""
    compiled: set = set()
    total, per_tier = 0.0, {}
    for s in settings:
        t = estimate_seconds(s, dense_step_s, compiled)
        compiled.add(kernel_signature(s))
        total += t
        per_tier[s["tier"]] = per_tier.get(s["tier"], 0.0) + t
    return total, per_tier
