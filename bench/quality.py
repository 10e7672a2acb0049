"""Quality benchmark: sample the quality testbed (a small trained video DiT) with the pack's engine over a grid of
method x density x schedule, and with ComfyUI's Sol-Attn under the same schedules; PSNR / SSIM against the
dense run and the projected end-to-end speed-up at Wan 2.1 14B 720p.

    python bench/quality.py --testbed DIR --out OUT [--steps 30,8,4] [--grid quick|full|FILE.yaml]
        [--seeds 0,1,..,7] [--budget-s 540] [--device cuda] [--skip-from EARLIER/quality.json ...]
    python bench/quality.py --testbed DIR --out OUT --random-init-small --steps 4 --limit 2   # CPU smoke run
    python bench/quality.py --estimate-only [--grid quick]           # settings, order and estimated seconds
    python bench/quality.py --report OUT/quality.json [more.json ...]  # docs/quality.md + frontier plot
    python bench/quality.py --choose OUT/quality.json [...]           # chosen settings as preset snippets
    python bench/quality.py --write-costs FILE [--costs RUN/e2e.json ...]  # the merged step-cost table as JSON

DIR holds the testbed's model.py, evaluate.py and weights.safetensors; they are imported by path. The dense
reference is sampled once per step count and every setting is compared with it (the testbed's ``sample``,
``psnr`` and ``ssim``). OUT/quality.json is rewritten after every setting, so a run stopped by a time limit
keeps what it measured; settings that would not finish within --budget-s are skipped (listed in the JSON).
Settings and schedules: bench/quality_grid.py; projection: bench/quality_costs.py; report:
bench/quality_report.py; the engine adapter: bench/quality_engine.py.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import quality_report
from quality_costs import StepCosts
from quality_grid import (ANCHOR, DENSE, REUSE, count_kinds, estimate_grid, estimate_seconds, kernel_signature,
                          load_grid, step_kinds)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DENSE_STEP_S = 0.05  # one dense step of the testbed (8 videos) on an H200, before it is measured


def say(msg: str) -> None:
    print(f"[quality] {msg}", flush=True)


def load_testbed(folder: str, need_weights: bool):
    """The testbed's evaluate module (which imports its model.py) from ``folder``."""
    folder = Path(folder)
    need = ["model.py", "evaluate.py"] + (["weights.safetensors"] if need_weights else [])
    missing = [n for n in need if not (folder / n).is_file()]
    if missing:
        raise SystemExit(f"--testbed {folder}: missing {', '.join(missing)}")
    spec = importlib.util.spec_from_file_location("quality_testbed_evaluate", folder / "evaluate.py")
    ev = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ev)  # evaluate.py puts its folder first on sys.path and imports model from it
    return ev


def build_model(ev, folder: str, random_small: bool, device):
    M = ev.M
    if random_small:  # evaluate.py's --random-init --small
        import torch
        torch.manual_seed(0)
        net = M.DiT(M.small_config())
        torch.nn.init.normal_(net.head.weight, std=0.02)
        torch.nn.init.normal_(net.time_projection[1].weight, std=0.02)
        net = net.to(device)
    else:
        net = M.load_model(str(Path(folder) / "weights.safetensors"), device)
    return net.eval()


class SolOnSteps:
    """Sol-Attn on every call of the steps not in ``dense_steps``, the testbed's dense attention at those."""

    def __init__(self, density: float, dense_steps, context: dict, dense_fn):
        from sol_attention import sol_attention
        self.sol, self.density, self.dense_steps = sol_attention, density, set(dense_steps)
        self.context, self.dense_fn = context, dense_fn
        self.stats = {"calls": 0, "dense": 0, "sol": 0}

    def __call__(self, q, k, v):
        """q, k, v: (B, H, N, D); returns (B, H, N, D)."""
        self.stats["calls"] += 1
        if self.context["step"] in self.dense_steps:
            self.stats["dense"] += 1
            return self.dense_fn(q, k, v)
        self.stats["sol"] += 1
        return self.sol(q, k, v, self.density)


def expected_calls(setting: dict, layers: int, chunks: int) -> dict:
    """Attention calls per kind a run makes under the setting's schedule (warm-up layers always dense)."""
    n = count_kinds(step_kinds(setting))
    if setting["kind"] == "sol":
        return {"dense": n[DENSE] * layers * chunks, "sol": n[REUSE] * layers * chunks}
    cfg = setting["config"]
    if cfg.get("method") == "dense":
        return {"dense": setting["steps"] * layers * chunks, "anchor": 0, "reuse": 0}
    wl = min(cfg.get("warmup_layers", 0), layers)
    return {"dense": (n[DENSE] * layers + (n[ANCHOR] + n[REUSE]) * wl) * chunks,
            "anchor": n[ANCHOR] * (layers - wl) * chunks, "reuse": n[REUSE] * (layers - wl) * chunks}


def versions() -> dict:
    import torch
    v = {"torch": torch.__version__, "python": platform.python_version()}
    for name in ("triton", "comfy_kitchen"):
        try:
            from importlib.metadata import version
            v[name] = version(name.replace("_", "-"))
        except Exception:  # not installed (or no metadata: unpacked wheel without dist-info on the path)
            try:
                v[name] = getattr(__import__(name), "__version__", "?")
            except ImportError:
                v[name] = None
    return v


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_json(path: Path, doc: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)


def summary(doc: dict, costs: StepCosts | None, per_steps: int = 25) -> str:
    """Targets, frontier and the fastest rows per step count, compact (the device tool keeps the last 12 000
    characters of output)."""
    results = {"metas": [dict(doc["meta"], file="quality.json")], "rows": doc["rows"], "skipped": doc["skipped"]}
    if costs is None:
        return "no step costs: projection left out"
    rows = quality_report.project_rows(results["rows"], costs)
    out = []
    for steps in sorted({r["steps"] for r in rows}, reverse=True):
        sr = sorted(quality_report.measured([r for r in rows if r["steps"] == steps]),
                    key=lambda r: -r["proj"]["speedup"])
        out.append(f"--- {steps} steps ({len(sr)} measured; the {min(per_steps, len(sr))} fastest) ---")
        out.append(f"{'setting':<34} {'schedule':<22} {'PSNR':>6} {'min':>6} {'SSIM':>6} {'x14B':>5} d/a/r")
        for r in sr[:per_steps]:
            n = r["proj"]["n"]
            out.append(f"{r['label'][:34]:<34} {r['schedule'][:22]:<22} {r['psnr_mean']:6.2f} {r['psnr_min']:6.2f} "
                       f"{r['ssim_mean']:6.4f} {r['proj']['speedup']:5.2f} {n[DENSE]}/{n[ANCHOR]}/{n[REUSE]}")
    out.append("--- targets ---")
    for t in quality_report.targets(rows):
        verdict = {True: "MET", False: "MISSED", None: "not measured"}[t["met"]]
        out.append(f"({t['name']}) {verdict}: " + ("\n    ".join(t["lines"]) if t.get("lines") else t["text"]))
    return "\n".join(out)


def run(args) -> dict:
    import torch

    clock0 = time.perf_counter()
    left = lambda: args.budget_s - (time.perf_counter() - clock0)  # noqa: E731
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    step_counts = [int(s) for s in args.steps.split(",") if s.strip()]
    settings = load_grid(args.grid, step_counts)
    done = set()
    for p in args.skip_from or []:
        done |= {r["id"] for r in json.loads(Path(p).read_text())["rows"] if "error" not in r}
    settings = [s for s in settings if s["id"] not in done]
    if args.limit:
        settings = settings[:args.limit]
    est, per_tier = estimate_grid(settings, DEFAULT_DENSE_STEP_S)
    say(f"{len(settings)} settings ({args.grid}, steps {step_counts}); estimate at {DEFAULT_DENSE_STEP_S} s per "
        f"dense step: {est:.0f} s of settings (" + ", ".join(f"tier {t}: {s:.0f} s" for t, s in
                                                             sorted(per_tier.items())) + ")")

    t = time.perf_counter()
    ev = load_testbed(args.testbed, need_weights=not args.random_init_small)
    M = ev.M
    net = build_model(ev, args.testbed, args.random_init_small, device)
    cfg = net.cfg
    seeds = [int(s) for s in args.seeds.split(",")]
    noise = ev.make_noise(cfg, seeds)
    labels = torch.tensor([s % cfg.num_classes for s in seeds], dtype=torch.long)
    chunks = math.ceil(len(seeds) / args.batch)
    say(f"testbed loaded in {time.perf_counter() - t:.1f} s: grid {cfg.grid}, {math.prod(cfg.grid)} tokens, "
        f"{cfg.num_layers} layers, {cfg.num_heads} heads, device {device}")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    weights = Path(args.testbed) / "weights.safetensors"
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "versions": versions(), "date": time.strftime("%Y-%m-%d %H:%M"),
            "command": "python bench/quality.py " + " ".join(sys.argv[1:]), "grid": args.grid, "steps": step_counts,
            "seeds": seeds, "batch": args.batch, "shift": args.shift,
            "budget_s": None if math.isinf(args.budget_s) else args.budget_s,
            "testbed": {"config": cfg.to_dict(), "grid": list(cfg.grid), "tokens": math.prod(cfg.grid),
                        "random_init": bool(args.random_init_small),
                        "weights_sha256": None if args.random_init_small else sha256(weights)},
            "references": {}}
    doc = {"meta": meta, "rows": [], "skipped": []}

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def sample(steps, attn):
        return ev.sample(net, noise, labels, steps=steps, shift=args.shift, batch=args.batch, attn=attn,
                         device=device).to(device)

    refs, dense_step_s = {}, DEFAULT_DENSE_STEP_S
    # shortest first: the first sampling run also initialises the device's kernels; the longest run, last,
    # gives the dense step time the estimates use
    for steps in sorted({s["steps"] for s in settings}):
        sync()
        t = time.perf_counter()
        refs[steps] = sample(steps, None)
        sync()
        dt = time.perf_counter() - t
        meta["references"][str(steps)] = {"time_s": round(dt, 3)}
        dense_step_s = dt / steps
        say(f"dense reference, {steps} steps: {dt:.2f} s")
    est, _ = estimate_grid(settings, dense_step_s)
    say(f"estimate at the measured {dense_step_s:.3f} s per dense step: {est:.0f} s for {len(settings)} settings; "
        f"{left():.0f} s of budget left")

    try:
        costs = StepCosts.load(args.costs, ROOT)
    except ValueError as exc:
        say(f"projection unavailable: {exc}")
        costs = None
    compiled: set = set()
    spent_est = spent = 0.0  # measured and estimated seconds of the settings run so far without a first use
    for i, s in enumerate(settings):
        factor = min(4.0, max(0.5, spent / spent_est)) if spent_est > 0 else 1.0
        first_use = kernel_signature(s) not in compiled
        raw = estimate_seconds(s, dense_step_s, compiled)
        need = raw * factor
        tag = f"{i + 1}/{len(settings)} {s['steps']} steps {s['label']}, {s['schedule']}"
        if need > left():
            doc["skipped"].append({"id": s["id"], "reason": "time budget",
                                   "detail": f"{need:.0f} s needed, {left():.0f} s left"})
            say(f"{tag}: skipped, needs ~{need:.0f} s, {left():.0f} s left")
            continue
        if s["kind"] == "sol":
            from sol_attention import sol_unavailable
            why = sol_unavailable()
            if why:
                doc["skipped"].append({"id": s["id"], "reason": "Sol-Attn unavailable", "detail": why})
                say(f"{tag}: skipped, {why}")
                continue
        row = {k: s[k] for k in ("id", "steps", "kind", "family", "label", "schedule", "tier")}
        row.update({k: s[k] for k in ("config", "sol") if k in s})
        kinds = step_kinds(s)
        row["step_kinds"] = "".join(k[0] for k in kinds)  # d(ense) a(nchor) r(euse) s(parse, Sol-Attn)
        row["counts"] = count_kinds(kinds)
        sync()
        t = time.perf_counter()
        try:
            if s["kind"] == "engine":
                from quality_engine import EngineAttention
                attn = EngineAttention(s["config"], s["steps"], M.CONTEXT, dense_fn=M.sdpa_attention)
                with attn.run():
                    video = sample(s["steps"], attn)
            else:
                attn = SolOnSteps(s["sol"]["density"], s["sol"]["dense_steps"], M.CONTEXT, M.sdpa_attention)
                video = sample(s["steps"], attn)
            sync()
        except Exception as exc:  # keep going with the other settings (as evaluate.py does)
            row["error"] = f"{type(exc).__name__}: {exc}"
            row["time_s"] = round(time.perf_counter() - t, 2)
            doc["rows"].append(row)
            write_json(out / "quality.json", doc)
            say(f"{tag}: FAILED {row['error'][:300]}")
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        finally:
            compiled.add(kernel_signature(s))
        dt = time.perf_counter() - t
        if not first_use:  # compilation times say nothing about the other settings' speed
            spent += dt
            spent_est += raw
        p, q = ev.psnr(video, refs[s["steps"]]), ev.ssim(video, refs[s["steps"]])
        row.update(psnr=[round(x, 3) for x in p], ssim=[round(x, 5) for x in q], psnr_mean=round(sum(p) / len(p), 3),
                   psnr_min=round(min(p), 3), ssim_mean=round(sum(q) / len(q), 5), ssim_min=round(min(q), 5),
                   time_s=round(dt, 2), stats=attn.stats)
        want = expected_calls(s, cfg.num_layers, chunks)
        got = {k: attn.stats.get(k) for k in want}
        row["schedule_check"] = "ok" if got == want else f"expected {want}, got {got}"
        try:
            proj = costs.project(s) if costs else None
        except ValueError:  # a method without measured step costs: the report says so
            proj = None
        doc["rows"].append(row)
        meta.update(n_measured=sum("error" not in r for r in doc["rows"]), n_skipped=len(doc["skipped"]),
                    wall_s=round(time.perf_counter() - clock0, 1))
        write_json(out / "quality.json", doc)
        fid = attn.stats.get("fidelity_mean")
        say(f"{tag}: PSNR {row['psnr_mean']:.2f} dB (min {row['psnr_min']:.2f}), SSIM {row['ssim_mean']:.4f}, "
            + (f"anchor rel-L2 {fid:.4f}, " if fid is not None else "")
            + (f"{proj['speedup']:.2f}x projected, " if proj else "")
            + f"{dt:.1f} s (est {need:.1f} s)" + ("" if row["schedule_check"] == "ok"
                                                  else f"; SCHEDULE MISMATCH {row['schedule_check']}"))
        del attn, video
        if device.type == "cuda":
            torch.cuda.empty_cache()
    meta.update(n_measured=sum("error" not in r for r in doc["rows"]), n_skipped=len(doc["skipped"]),
                wall_s=round(time.perf_counter() - clock0, 1))
    write_json(out / "quality.json", doc)
    say(f"wrote {out / 'quality.json'}: {meta['n_measured']} measured, {meta['n_skipped']} skipped, "
        f"{sum('error' in r for r in doc['rows'])} failed, {meta['wall_s']} s")
    print(summary(doc, costs), flush=True)
    return doc


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--testbed", help="folder with the testbed's model.py, evaluate.py, weights.safetensors")
    ap.add_argument("--out", help="output folder (quality.json)")
    ap.add_argument("--steps", default="30,8,4", help="step counts to run, comma separated")
    ap.add_argument("--seeds", default="0,1,2,3,4,5,6,7")
    ap.add_argument("--batch", type=int, default=8, help="videos per sampling call")
    ap.add_argument("--shift", type=float, default=3.0)
    ap.add_argument("--grid", default="quick", help="quick | full | FILE.yaml (bench/quality_grid.py)")
    ap.add_argument("--budget-s", type=float, default=float("inf"),
                    help="skip settings that would not finish within this many seconds of the whole run")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--random-init-small", action="store_true",
                    help="the testbed's --random-init --small: a tiny random model (CPU smoke run, no weights)")
    ap.add_argument("--limit", type=int, default=0, help="run only the first N settings of the grid")
    ap.add_argument("--skip-from", nargs="+", default=None, help="quality.json files: skip their measured settings")
    ap.add_argument("--costs", nargs="+", default=None,
                    help=f"e2e.json files (or one step-cost JSON) for the projection; default {ROOT.name}/"
                         "docs/bench-runs/e2e-wan14b*/e2e.json")
    ap.add_argument("--write-costs", default=None,
                    help="write the merged step-cost table (from --costs or the default runs) to this JSON file")
    ap.add_argument("--estimate-only", action="store_true", help="print the settings and estimate; run nothing")
    ap.add_argument("--report", nargs="+", default=None, help="quality.json files -> docs/quality.md and the plot")
    ap.add_argument("--report-out", default=str(ROOT / "docs" / "quality.md"))
    ap.add_argument("--plot-out", default=str(ROOT / "docs" / "images" / "quality-frontier.png"))
    ap.add_argument("--choose", nargs="+", default=None, help="quality.json files -> preset snippets on stdout")
    args = ap.parse_args(argv)

    if args.write_costs:
        costs = StepCosts.load(args.costs, ROOT)
        costs.to_json(args.write_costs)
        print(f"wrote {args.write_costs}: {costs.model}, dense {costs.dense_s:.2f} s, from {', '.join(costs.sources)}")
        return
    if args.report or args.choose:
        costs = StepCosts.load(args.costs, ROOT)
        if args.report:
            results = quality_report.load_results(args.report)
            md_path, png = Path(args.report_out), Path(args.plot_out)
            drew = quality_report.plot(results, costs, png)
            rel = os.path.relpath(png, md_path.parent) if drew else None
            cmd = "python bench/quality.py --report " + " ".join(args.report)
            md_path.parent.mkdir(parents=True, exist_ok=True)
            md_path.write_text(quality_report.render(results, costs, rel, cmd))
            print(f"wrote {md_path}" + (f" and {png}" if drew else " (no plot: matplotlib is not importable)"))
        if args.choose:
            print(quality_report.choose(quality_report.load_results(args.choose), costs))
        return
    if args.estimate_only:
        step_counts = [int(s) for s in args.steps.split(",") if s.strip()]
        settings = load_grid(args.grid, step_counts)[:args.limit or None]
        compiled: set = set()
        for i, s in enumerate(settings):
            e = estimate_seconds(s, DEFAULT_DENSE_STEP_S, compiled)
            compiled.add(kernel_signature(s))
            print(f"{i + 1:4d} tier {s['tier']} {s['steps']:3d} steps  {s['label']:<34} {s['schedule']:<24} {e:6.1f} s")
        est, per_tier = estimate_grid(settings, DEFAULT_DENSE_STEP_S)
        tiers = ", ".join(f"tier {t} {v:.0f} s" for t, v in sorted(per_tier.items()))
        print(f"{len(settings)} settings, ~{est:.0f} s at {DEFAULT_DENSE_STEP_S} s per dense step (model load and "
              f"dense references not included): {tiers}")
        return
    if not args.testbed or not args.out:
        ap.error("--testbed and --out are required to run (or use --report / --choose / --estimate-only)")
    run(args)


if __name__ == "__main__":
    main()
