"""Report of the quality benchmark: docs/quality.md (tables, frontier, targets), the frontier plot and the chosen
settings as preset snippets, from one or more quality.json files written by bench/quality.py."""

from __future__ import annotations

import json
from pathlib import Path

from quality_costs import FLAG_TEXT, MEASURED_CONFIG, StepCosts
from quality_grid import ANCHOR, DENSE, REUSE, SCHEDULES, schedule_label, sol_dense_steps

FAMILIES = ("mc_sparse", "block_topk", "block_topk_mass", "block_topk_fixed", "block_topk+select", "sol")
FAMILY_TEXT = {"mc_sparse": "mc_sparse", "block_topk": "block_topk (residual as cached)",
               "block_topk_mass": "block_topk, residual weighted by the mass",
               "block_topk_fixed": "block_topk, residual as cached (the mass runs' control)",
               "block_topk+select": "block_topk, selection every step", "sol": "Sol-Attn", "dense": "dense"}
FLAG_MARK = {"interpolated": "†", "nearest": "‡", "method costs": "§", "first-anchor price": "¶", "layers": "°"}
THRESHOLDS = (30.0, 35.0)
TARGET_A = (30, 30.0, 2.0)        # steps, PSNR dB, projected speed-up
TARGET_B_RATIO = 1.5               # ours / Sol-Attn at a PSNR at least Sol's
TARGET_C = (30.0, 0.75, (4, 8))    # PSNR dB, share of reuse steps, step counts


def load_results(paths) -> dict:
    """Merge quality.json files: rows by setting id (the first file holding an id wins), metas in order."""
    metas, rows, seen, skipped = [], [], set(), []
    for p in paths:
        try:
            doc = json.loads(Path(p).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{p}: cannot read quality results ({exc})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
            raise ValueError(f"{p}: not a quality.json (no 'rows' list)")
        metas.append(dict(doc.get("meta", {}), file=str(p)))
        for r in doc["rows"]:
            if r["id"] not in seen:
                seen.add(r["id"])
                rows.append(r)
        skipped.extend(doc.get("skipped", []))
    left, ids = [], set()
    for s in skipped:  # a setting skipped in one run and measured in another is measured
        if s.get("id") not in seen and s.get("id") not in ids:
            ids.add(s.get("id"))
            left.append(s)
    return {"metas": metas, "rows": rows, "skipped": left}


def project_rows(rows: list[dict], costs: StepCosts) -> list[dict]:
    """Rows with "proj" (bench/quality_costs.py ``project``) added; rows with an error keep proj None."""
    out = []
    for r in rows:
        try:
            proj = None if "error" in r else costs.project(r)
        except ValueError as exc:  # e.g. a method without measured end-to-end costs
            r = dict(r, no_projection=str(exc))
            proj = None
        out.append(dict(r, proj=proj))
    return out


def measured(rows):
    return [r for r in rows if "error" not in r and r.get("proj") is not None]


def fastest(rows, steps: int, psnr_min: float, family: str | None = None, engine_only: bool = False):
    """The row of ``steps`` with the largest projected speed-up among those with mean PSNR >= psnr_min."""
    cands = [r for r in measured(rows) if r["steps"] == steps and r["psnr_mean"] >= psnr_min
             and r["family"] != "dense" and (family is None or r["family"] == family)
             and (not engine_only or r["kind"] == "engine")]
    return max(cands, key=lambda r: (r["proj"]["speedup"], r["psnr_mean"]), default=None)


def _name(r) -> str:
    return f"{r['label']}, {r['schedule']}"


def _x(v) -> str:
    return f"{v:.2f}×"


def targets(rows: list[dict]) -> list[dict]:
    """Each target: {"name", "met" (bool or None when nothing was measured), "text"}."""
    out = []
    steps, thr, speed = TARGET_A
    ok = [r for r in measured(rows) if r["steps"] == steps and r["kind"] == "engine" and r["family"] != "dense"]
    best = fastest(ok, steps, thr)
    if not ok:
        out.append(dict(name="a", met=None, text=f"no {steps}-step engine rows measured"))
    elif best and best["proj"]["speedup"] >= speed:
        out.append(dict(name="a", met=True, text=f"{_name(best)}: {best['psnr_mean']:.1f} dB at "
                                                  f"{_x(best['proj']['speedup'])} projected"))
    else:
        top = max(ok, key=lambda r: r["psnr_mean"])
        fast = [r for r in ok if r["proj"]["speedup"] >= speed]
        part = (f"fastest at ≥ {thr:g} dB: {_name(best)}, {best['psnr_mean']:.1f} dB at "
                f"{_x(best['proj']['speedup'])}" if best else f"no setting reaches {thr:g} dB (best "
                f"{top['psnr_mean']:.1f} dB: {_name(top)}, {_x(top['proj']['speedup'])})")
        if fast:
            bf = max(fast, key=lambda r: r["psnr_mean"])
            part += f"; best PSNR at ≥ {speed:g}×: {bf['psnr_mean']:.1f} dB ({_name(bf)}, {_x(bf['proj']['speedup'])})"
        else:
            part += f"; no setting projects ≥ {speed:g}×"
        out.append(dict(name="a", met=False, text=part))

    sols = [r for r in measured(rows) if r["family"] == "sol"]
    lines, all_ok = [], True
    for s in sorted(sols, key=lambda r: (-r["steps"], -r["psnr_mean"])):
        ours = fastest(rows, s["steps"], s["psnr_mean"], engine_only=True)
        if ours is None:
            all_ok = False
            lines.append(f"{s['steps']} steps, {_name(s)}: {s['psnr_mean']:.1f} dB at {_x(s['proj']['speedup'])} — "
                         f"none of ours reaches that PSNR")
            continue
        ratio = ours["proj"]["speedup"] / s["proj"]["speedup"]
        all_ok &= ratio >= TARGET_B_RATIO
        lines.append(f"{s['steps']} steps, {_name(s)}: {s['psnr_mean']:.1f} dB at {_x(s['proj']['speedup'])} — ours "
                     f"{_name(ours)}: {ours['psnr_mean']:.1f} dB at {_x(ours['proj']['speedup'])}, "
                     f"**{ratio:.2f}×** {'✓' if ratio >= TARGET_B_RATIO else '✗'}")
    out.append(dict(name="b", met=(all_ok if sols else None), text="; ".join(lines) if lines else
                    "no Sol-Attn rows measured", lines=lines))

    thr_c, share, counts = TARGET_C
    for steps in counts:
        ok = [r for r in measured(rows) if r["steps"] == steps and r["kind"] == "engine" and r["family"] != "dense"]
        if not ok:
            out.append(dict(name=f"c{steps}", met=None, text=f"no {steps}-step engine rows measured"))
            continue
        good = [r for r in ok if r["proj"]["n"][REUSE] >= share * steps]
        best = max(good, key=lambda r: r["psnr_mean"], default=None)
        if best and best["psnr_mean"] >= thr_c:
            fast = fastest(good, steps, thr_c)
            out.append(dict(name=f"c{steps}", met=True, text=f"{_name(fast)}: {fast['psnr_mean']:.1f} dB with "
                            f"{fast['proj']['n'][REUSE]} of {steps} steps sparse ({_x(fast['proj']['speedup'])})"))
        else:
            part = (f"best with ≥ {share:.0%} of steps sparse: {_name(best)}, {best['psnr_mean']:.1f} dB"
                    if best else f"no schedule measured with ≥ {share:.0%} of steps sparse")
            top = max(ok, key=lambda r: r["psnr_mean"])
            part += (f"; best of any schedule: {_name(top)}, {top['psnr_mean']:.1f} dB with {top['proj']['n'][REUSE]}"
                     f" of {steps} steps sparse")
            out.append(dict(name=f"c{steps}", met=False, text=part))
    return out


def _flags(r) -> str:
    return "".join(FLAG_MARK[f] for f in r["proj"]["flags"]) if r.get("proj") else ""


def _steps_text(r) -> str:
    n = r["proj"]["n"] if r.get("proj") else r.get("counts")
    return f"{n[DENSE]} / {n[ANCHOR]} / {n[REUSE]}" if n else "–"


def _row_md(r) -> str:
    if "error" in r:
        return f"| {r['label']} | {r['schedule']} | error: {r['error'][:120]} ||||||||"
    if r.get("proj") is None:
        return (f"| {r['label']} | {r['schedule']} | {r['psnr_mean']:.2f} ({r['psnr_min']:.2f}) | "
                f"{r['ssim_mean']:.4f} | – (no step costs) | {_steps_text(r)} | | | {r['time_s']:.1f} |")
    st = r.get("stats") or {}
    fid = st.get("fidelity_mean")
    dens = st.get("density_sparse")
    return (f"| {r['label']} | {r['schedule']} | {r['psnr_mean']:.2f} ({r['psnr_min']:.2f}) | {r['ssim_mean']:.4f} | "
            f"{r['proj']['speedup']:.2f}×{_flags(r)} | {_steps_text(r)} | {'–' if fid is None else f'{fid:.4f}'} | "
            f"{'–' if dens is None else f'{dens:.3f}'} | {r['time_s']:.1f} |")


def _order(rows, grid_order):
    fam = {f: i for i, f in enumerate(("dense",) + FAMILIES)}
    return sorted(rows, key=lambda r: (fam.get(r["family"], 9), grid_order.get(r["schedule"], 99),
                                       -(r.get("config", {}).get("density") or r.get("sol", {}).get("density") or 0),
                                       r["label"]))


def _check_text(rows) -> str:
    """Whether each run's own call counts (engine statistics / Sol-Attn calls) matched its schedule."""
    ran = [r for r in rows if "schedule_check" in r]
    bad = [r for r in ran if r["schedule_check"] != "ok"]
    if not bad:
        return (f"each run's own attention-call counts (dense / anchor / reuse calls from the engine's statistics, "
                f"dense / Sol-Attn calls) matched them in all {len(ran)} runs.")
    return (f"**the run's own call counts did not match in {len(bad)} of {len(ran)} runs**: "
            + "; ".join(f"`{r['id']}`: {r['schedule_check']}" for r in bad[:5]) + ".")


def _meta_lines(metas) -> list[str]:
    out = []
    for m in metas:
        v = m.get("versions", {})
        budget = "no time budget" if m.get("budget_s") is None else f"budget {m['budget_s']:g} s"
        out.append(f"- `{m['file']}`: {m.get('device', '?')}, torch {v.get('torch') or '?'}, Triton "
                   f"{v.get('triton') or '–'}, comfy_kitchen {v.get('comfy_kitchen') or '–'}, Python "
                   f"{v.get('python') or '?'}; {m.get('date', '?')}; grid `{m.get('grid', '?')}`, "
                   f"{m.get('n_measured', '?')} settings measured, {m.get('n_skipped', 0)} skipped "
                   f"({budget}), {m.get('wall_s', '?')} s in all")
        if m.get("command"):
            out.append(f"  command: `{m['command']}`")
    return out


def _testbed_text(metas) -> str:
    m = next((m for m in metas if m.get("testbed")), {})
    tb = m.get("testbed", {})
    cfg = tb.get("config", {})
    if not cfg:
        return "(no testbed description in the results)"
    f, h, w = tb.get("grid", ("?", "?", "?"))
    tokens = tb.get("tokens", "?")
    head_dim = cfg.get("dim", 0) // max(1, cfg.get("num_heads", 1))
    weights = "random weights (smoke run, not a quality measurement)" if tb.get("random_init") else \
        f"trained weights `weights.safetensors` (sha256 {str(tb.get('weights_sha256', '?'))[:12]}…)"
    return (f"A small video DiT built like a Wan 2.1 block (3-D RoPE, RMSNorm on q/k, AdaLN, GELU FFN), "
            f"{cfg.get('num_layers')} layers, {cfg.get('num_heads')} heads of {head_dim}, "
            f"width {cfg.get('dim')}, class-conditioned, patch {cfg.get('patch')} on RGB pixels: a "
            f"{cfg.get('frames')}×{cfg.get('height')}×{cfg.get('width')} video is a {f}×{h}×{w} grid = {tokens} "
            f"tokens; {weights}. {len(m.get('seeds', []))} videos (seeds {m.get('seeds')}, class = seed % "
            f"{cfg.get('num_classes')}), batch {m.get('batch')} in one call, Euler on the rectified-flow ODE "
            f"(shift {m.get('shift')}), bf16 autocast on the GPU.")


def _layers_text(costs: StepCosts) -> str:
    if costs.warmup_layers is None:  # a step-cost file written before the runs' dense-layer counts were compared
        return "The e2e rows' dense-layer counts were not compared with the preset's (no ° marks)."
    return (f"The projections price e2e rows run with the Wan 14B preset's `warmup_layers` ({costs.warmup_layers} of "
            "40 layers dense) where measured, other rows marked °.")


def render(results: dict, costs: StepCosts, plot_rel: str | None = None, report_cmd: str = "") -> str:
    rows = project_rows(results["rows"], costs)
    metas = results["metas"]
    step_counts = sorted({r["steps"] for r in rows}, reverse=True)
    L = ["# Quality: sparse attention on a trained video DiT", "",
         f"Generated by `{report_cmd or 'python bench/quality.py --report ...'}` from the files listed under "
         "\"Runs\"; do not edit by hand (re-run the report instead).", "",
         "## Method", "",
         "**Testbed** (`--testbed`, the quality testbed folder: `model.py`, `evaluate.py`, `weights.safetensors`). "
         + _testbed_text(metas), "",
         "**Measure.** The dense reference (PyTorch SDPA, the testbed's own attention) is sampled once per step "
         "count from the same noise; every setting samples the same 8 videos and is compared with it: PSNR in dB "
         "(pixels mapped to [0, 1], whole video; mean of the videos, the worst video in brackets; 100 = identical) "
         "and SSIM (Gaussian 11×11, σ 1.5, per frame and channel). The testbed's own PSNR/SSIM functions are used.",
         "",
         "**Engine rows** (`mc_sparse`, `block_topk`; `+select` = `select_every_step`): the pack's engine through "
         "one adapter (`bench/quality_engine.py`): per attention call a `CallContext` (layer, step, total steps, "
         "batch chunk, `TokenLayout(grid)`), `begin_run()` / `end_run()` around each sampling run. `min_tokens` 0, "
         "`backend` auto, groups / blocks of 64 unless the label says `g128` / `b128`, `wl1` = `warmup_layers` 1, "
         "`nores` = residual off. Dense calls go to the testbed's SDPA, so warm-up steps match the reference "
         "exactly (the `engine dense` row checks the adapter: 100 dB). Rows labelled `mass` / `fixed` set "
         "`residual_weighting` (docs/method.md, \"The residual weighted by the mass\"): `mass` weights a block "
         "selection's cached residual by the mass its left-out blocks have at the reuse step (anchors at step 0 keep "
         "it fixed), `fixed` adds it as cached — as every `block_topk` row without that label was measured (the "
         "built-in grids keep it so).", "",
         "**Schedules.** `w3 a3,12,21` = steps 0–2 dense (warm-up), anchors at steps 3, 12 and 21 (an anchor "
         "computes exact attention, selects, caches the selection and the residual R = O_dense − O_sparse, and "
         "returns the dense output), every other step a reuse step (cached selection + R). `a0` = no warm-up, "
         "anchor at step 0 only. The first sparse step is always an anchor. \"steps d / a / r\" counts dense, "
         "anchor and reuse steps as the engine decides them; " + _check_text(rows), "",
         "**Sol-Attn rows**: ComfyUI's Sol-Attn, `comfy_kitchen.sol_attn` with `topk_ratio` = density, on every "
         "attention call of the steps not in its dense set, through the same call as `bench/e2e.py` "
         "(`bench/sol_attention.py`). Sol-Attn has no anchors, cache or residual: `dense 0,1,2,3,12,21` means "
         "exact SDPA at steps 0, 1, 2, 3, 12 and 21 — exactly the steps where our schedule `w3 a3,12,21` "
         "computes dense attention (warm-up and anchors) — and Sol-Attn, with its own selection, at every other "
         "step. Each of our schedules' dense-step sets is measured with Sol-Attn.", "",
         "**Projected speed-up** at Wan 2.1 14B 720p×81 (50-step e2e runs on an H200, `docs/benchmarks.md`, "
         "\"End to end\"): steps × dense / (n_dense × dense + first anchor + (n_anchor − 1) × later anchor "
         "+ n_reuse × reuse), Sol-Attn: n_dense × dense + n_sparse × Sol step, with the step costs below. Marks: "
         + "; ".join(f"{FLAG_MARK[k]} {v}" for k, v in FLAG_TEXT.items())
         + ". " + _layers_text(costs) + " The testbed's `warmup_layers` does not enter the projection.", "",
         "## Runs", ""]
    L += _meta_lines(metas)
    if results["skipped"]:
        why: dict = {}
        for s in results["skipped"]:
            why.setdefault(s.get("reason", "?"), []).append(s)
        n = len(results["skipped"])
        L += ["", f"Not measured: {n} setting{'s' if n != 1 else ''} of the grid — "
              + "; ".join(f"{len(v)} for {k}" + (f" ({v[0]['detail']})" if v[0].get("detail") else "")
                          + f", e.g. `{v[0]['id']}`" for k, v in why.items()) + "."]
    L += ["", "## Targets", ""]
    names = {"a": f"(a) {TARGET_A[0]} steps: PSNR ≥ {TARGET_A[1]:g} dB with a projected Wan 14B speed-up ≥ "
                  f"{TARGET_A[2]:g}×",
             "b": f"(b) at every PSNR Sol-Attn reaches under some schedule, one of our settings ≥ "
                  f"{TARGET_B_RATIO:g}× faster (same step count, PSNR at least Sol's)",
             "c4": f"(c) 4 steps: PSNR ≥ {TARGET_C[0]:g} dB with ≥ {TARGET_C[1]:.0%} of steps sparse (reuse)",
             "c8": f"(c) 8 steps: PSNR ≥ {TARGET_C[0]:g} dB with ≥ {TARGET_C[1]:.0%} of steps sparse (reuse)"}
    for t in targets(rows):
        verdict = {True: "**met**", False: "**missed**", None: "not measured"}[t["met"]]
        if t["name"] == "b" and t.get("lines"):
            L.append(f"- {names['b']}: {verdict}")
            L += [f"  - {x}" for x in t["lines"]]
        else:
            L.append(f"- {names[t['name']]}: {verdict} — {t['text']}")
    L += ["", "## Frontier: fastest setting per method at ≥ 30 dB and ≥ 35 dB (mean PSNR)", "",
          "| steps | method | fastest ≥ 30 dB | PSNR | speed-up | fastest ≥ 35 dB | PSNR | speed-up |",
          "|---|---|---|---|---|---|---|---|"]
    for steps in step_counts:
        for fam in FAMILIES:
            if not any(r["steps"] == steps and r["family"] == fam for r in measured(rows)):
                continue
            cells = []
            for thr in THRESHOLDS:
                b = fastest(rows, steps, thr, fam)
                cells += ([f"{b['label']}, {b['schedule']}", f"{b['psnr_mean']:.1f}",
                           f"{b['proj']['speedup']:.2f}×{_flags(b)}"] if b else ["–", "–", "–"])
            L.append(f"| {steps} | {FAMILY_TEXT[fam]} | " + " | ".join(cells) + " |")
    if plot_rel:
        L += ["", f"![PSNR against projected speed-up]({plot_rel})"]
    for steps in step_counts:
        grid_order = {}
        for i, (w, a) in enumerate(SCHEDULES.get(steps, [])):  # engine schedules and their Sol-Attn dense sets
            grid_order[schedule_label(w, a)] = i
            grid_order["dense " + ",".join(map(str, sol_dense_steps(steps, (w, a))))] = i
        sr = _order([r for r in rows if r["steps"] == steps], grid_order)
        L += ["", f"## {steps} steps", "",
              "| setting | schedule | PSNR dB mean (min) | SSIM | projected speed-up | steps d / a / r | "
              "anchor rel-L2 | density of sparse calls | s |", "|---|---|---|---|---|---|---|---|---|"]
        L += [_row_md(r) for r in sr]
    L += ["", f"## Step costs used (Wan 2.1 14B 720p, {costs.model}; from {', '.join(costs.sources)})", "",
          f"Dense step {costs.dense_s:.2f} s. Measured configuration: "
          + ", ".join(f"{k} {v}" for k, v in MEASURED_CONFIG.items()) + ".", "",
          "A run's later anchors are priced at the later anchor step where a run timed one (they reuse the memory "
          "of the entries they replace); elsewhere every anchor at the first one's time.", "",
          "| method | density | anchor step s (later anchors) | reuse / Sol step s | run |", "|---|---|---|---|---|"]
    for m, ds in sorted(costs.modes.items()):
        for d, v in sorted(ds.items()):
            a, later = v.get("anchor_s"), v.get("later_anchor_s")
            cell = "–" if a is None else f"{a:.1f}" + ("" if later is None else f" ({later:.1f})")
            L.append(f"| {m} | {d:g} | {cell} | {v['step_s']:.2f} | {v.get('run', '')} |")
    L += ["", "## Per-layer and per-head densities", "",
          "Rows whose label names layers (`layer 2 x3`, `sqrt sensitivity`) set `layer_densities` by hand. The "
          "calibrated allocations of `tools/calibrate.py` against a uniform density, measured on this testbed by "
          "`bench/quality_calibration.py`, and what the hand-made rows say about them: docs/calibration.md, "
          "\"Measured on the quality testbed\"; the best per-head allocation a search on the sampled videos finds "
          "(`bench/quality_search.py`): docs/calibration.md, \"A search on the output\", and on 24 videos no search "
          "saw (+1.27 dB at 0.10): \"Sixteen more held-out videos, a search fitted on sixteen, and density 0.15\"."]
    L += ["", "## Residuals at 4 bits", "",
          "`residual_precision: auto` (the small-VRAM preset's) stores fp8 residuals and packs them to 4 bits only "
          "when room runs short. On this testbed (8 videos, 30 steps) every residual at 4 bits gives 31.35 dB "
          "against fp8's 31.40 dB (`docs/bench-runs/int4-1/quality/`); what it buys on 16 GB cards, and the runs "
          "with room for only some residuals: docs/decisions.md, \"Residuals at 4 bits\"."]
    return "\n".join(L) + "\n"


def plot(results: dict, costs: StepCosts, out_png) -> bool:
    """PSNR against projected speed-up, one panel per step count, one marker set per method. False when
    matplotlib is not importable."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = measured(project_rows(results["rows"], costs))
    step_counts = sorted({r["steps"] for r in rows}, reverse=True)
    if not step_counts:
        return False
    style = {"mc_sparse": ("#1f77b4", "o"), "block_topk": ("#2ca02c", "s"), "block_topk_mass": ("#ff7f0e", "D"),
             "block_topk_fixed": ("#8c564b", "v"), "block_topk+select": ("#17becf", "^"), "sol": ("#d62728", "x")}
    fig, axes = plt.subplots(1, len(step_counts), figsize=(5.2 * len(step_counts), 4.4), squeeze=False)
    for ax, steps in zip(axes[0], step_counts):
        for fam, (color, marker) in style.items():
            pts = [(r["proj"]["speedup"], min(r["psnr_mean"], 60.0)) for r in rows
                   if r["steps"] == steps and r["family"] == fam]
            if pts:
                xs, ys = zip(*pts)
                ax.scatter(xs, ys, c=color, marker=marker, label=FAMILY_TEXT[fam], s=26, alpha=0.85)
                front, best = [], -1.0  # Pareto front: no other point of the method is both faster and better
                for x, y in sorted(pts, key=lambda p: (-p[0], -p[1])):
                    if y > best:
                        front.append((x, y))
                        best = y
                fx, fy = zip(*front)
                ax.plot(fx, fy, color=color, lw=1.2, alpha=0.8)
        for thr in THRESHOLDS:
            ax.axhline(thr, color="gray", lw=0.8, ls="--")
        ax.set_title(f"{steps} steps")
        ax.set_xlabel("projected speed-up, Wan 2.1 14B 720p (×)")
        ax.set_ylabel("PSNR vs dense (dB, mean of 8 videos)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Quality testbed: PSNR against projected end-to-end speed-up")
    fig.tight_layout()
    Path(out_png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return True


PRESET_DROP = ("min_tokens", "backend")  # testbed-only values: presets set their own


def choose(results: dict, costs: StepCosts) -> str:
    """Per step count, the fastest engine setting at >= 30 dB and at >= 35 dB as YAML ``sparse:`` snippets."""
    import yaml

    rows = project_rows(results["rows"], costs)
    out = []
    for steps in sorted({r["steps"] for r in rows}, reverse=True):
        for thr in THRESHOLDS:
            b = fastest(rows, steps, thr, engine_only=True)
            head = f"# {steps} steps, fastest with PSNR >= {thr:g} dB"
            if b is None:
                out.append(f"{head}: none measured\n")
                continue
            cfg = {k: v for k, v in b["config"].items() if k not in PRESET_DROP}
            out.append(f"{head}: {b['label']}, {b['schedule']} ({b['psnr_mean']:.1f} dB, SSIM {b['ssim_mean']:.3f}, "
                       f"projected {b['proj']['speedup']:.2f}x at Wan 2.1 14B 720p)\n"
                       + yaml.safe_dump({"sparse": cfg}, sort_keys=False, default_flow_style=None))
    return "\n".join(out)
