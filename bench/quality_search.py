"""Per-head densities searched directly on the quality testbed's output (docs/calibration.md, "A search on the
output"): is there any allocation of the same average density that gains what issue 18 asks (+1.5 dB at 0.10)?
The calibration (engine/calibrate.py) predicts from the attention error; this asks the sampled videos instead.

    python bench/quality_search.py --testbed DIR --out OUT [--method mc_sparse] [--density 0.1] [--step 0.5]
        [--fit-seeds 0,..,7] [--check-seeds 8,..,15] [--budget-s 240] [--steps 30] [--warmup 2] [--anchors 2,10]
    python bench/quality_search.py --testbed DIR --out OUT --random-init-small --steps 3 --warmup 0 --anchors 0 \\
        --fit-seeds 0,1 --check-seeds 2 --rounds 1      # CPU check of the whole path

Greedy search over factors f (one per layer and head, mean 1, each in [--min-factor, --max-factor], so the heads
together compute the uniform density's pairs): a move raises one head's factor by ``--step`` and scales every other
head down to keep the mean, or lowers it and scales the others up. Each round scores every move by the mean PSNR
of the fit videos against the dense reference and takes the best one if it gains more than ``--min-gain-db``;
rounds stop when none does, after ``--rounds`` or when ``--budget-s`` runs out (a round the budget cuts takes the
best of the moves it scored, and is marked so in the report). With ``--mode quadratic`` a complete round also fits
bench/search_model.py's per-head quadratic model to its moves' gains and samples the model's optimum (every head
changed at once, each by at most ``--radius``; the mean stays 1): the round takes whichever of that allocation and
the best single move scores higher. The uniform density and the best
factors found are then sampled on the check videos (other seeds, never seen by the search): the gain there is what
a search on the output delivers, not fitted noise.

Writes OUT/search.json (settings, every move scored, the rounds, fit and check PSNR) and OUT/search.md (the table
for docs/calibration.md). The testbed loader and the engine adapter are bench/quality.py's and
bench/quality_engine.py's.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from _pack import load
from quality import build_model, load_testbed, sha256, versions, write_json
from quality_engine import EngineAttention
from search_model import fit, moved, predict, solve, start_factors


def say(msg: str) -> None:
    print(f"[search] {msg}", flush=True)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def as_layer_densities(factors: list[float], heads: int) -> dict:
    """{layer: [factor per head]} from the flat list (layer-major), rounded for the config and the report."""
    return {layer: [round(f, 4) for f in factors[layer * heads:(layer + 1) * heads]]
            for layer in range(len(factors) // heads)}


def _model_note(doc: dict, rd: dict) -> str:
    """' (model: predicted +x, measured +y dB)' for a round that sampled the quadratic model's allocation."""
    if rd.get("model_predicted") is None:
        return ""
    got = [m for m in doc["moves"] if m["round"] == rd["round"] and "predicted_gain" in m]
    start = doc["rounds"][rd["round"] - 2]["best_psnr"] if rd["round"] > 1 else (
        doc["result"].get("start_fit") or doc["result"]["uniform"]["fit"])["psnr_mean"]
    return "".join(f" (model: predicted {m['predicted_gain']:+.2f}, measured {m['psnr_mean'] - start:+.2f} dB)"
                   for m in got)


def section(doc: dict) -> str:
    m, r = doc["meta"], doc["result"]
    lines = ["### A search on the output", "",
             f"{m['device']}, torch {m['versions'].get('torch')}, Triton {m['versions'].get('triton')}; {m['date']}; "
             f"`{m['command']}` ({m['wall_s']:.0f} s).", "",
             f"{m['method']} at average density {m['density']:g}; {m['steps']} steps, warm-up {m['warmup']}, anchors "
             f"{m['anchors']}" + (f" (anchor density factors {m['anchor_factors']}, in every row, uniform's too)"
                                   if m.get("anchor_factors") else "")
             + f", blocks / groups of {m['size']}, residual on. Factors per {m.get('scope') or 'head'} (mean 1: the "
             f"computed density is the uniform one), moves of ±{m['step']:g} with the others rescaled"
             + (f", and each complete round also the optimum of the per-head quadratic model fitted to its moves "
                f"(bench/search_model.py; every head changed by at most {m['radius']:g})"
                if m.get("mode") == "quadratic" else "") + ", starting from "
             f"{'`' + m['start'] + '`' if m.get('start') else 'uniform'}; "
             f"{len(doc['moves'])} allocations sampled in {len(doc['rounds'])} round(s) on the fit videos (seeds "
             f"{m['fit_seeds']}); the result checked on videos the search never saw (seeds {m['check_seeds']}).", "",
             "| allocation | fit PSNR dB (min) | check PSNR dB (min) | check gain dB | density of sparse calls "
             "(check) |",
             "|---|---|---|---|---|"]
    for name in ("uniform", "searched"):
        f, c = r[name]["fit"], r[name]["check"]
        gain = "" if name == "uniform" else f"{c['psnr_mean'] - r['uniform']['check']['psnr_mean']:+.2f}"
        lines.append(f"| {name} | {f['psnr_mean']:.2f} ({f['psnr_min']:.2f}) | {c['psnr_mean']:.2f} "
                     f"({c['psnr_min']:.2f}) | {gain} | {c['density_sparse']:.3f} |")
    if doc["rounds"]:
        lines += ["", "Rounds (move taken, fit PSNR after it; a round the time budget cut takes the best of the moves "
                  "it scored): " + "; ".join(
                      f"{i + 1}: {rd['taken'] or 'none'} {rd['best_psnr']:.2f} dB"
                      + ("" if rd["complete"] else f" (cut: {rd['scored']} of {rd['candidates']} moves scored)")
                      + _model_note(doc, rd)
                      for i, rd in enumerate(doc["rounds"])) + "."]
    else:
        lines += ["", "No rounds: the allocation given with --start, sampled as it is." if m.get("start") else
                  "No rounds: the uniform allocation only."]
    lines += ["", f"Searched factors: `{r['layer_densities']}`", ""]
    return "\n".join(lines)


def testbed_setup(args, source: str):
    """What the scripts sampling per-head allocations share (this one, bench/quality_allocations.py): (engine module,
    engine.layer_density module, torch device, the testbed's evaluate module, the model, the SparseConfig fields of
    every allocation). ``args``: --testbed, --device, --random-init-small, --method, --density, --size, --warmup,
    --anchors; bad settings fail here, before any sampling."""
    import torch
    eng = load("engine")
    layer_density = load("engine.layer_density")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    ev = load_testbed(args.testbed, need_weights=not args.random_init_small)
    net = build_model(ev, args.testbed, args.random_init_small, device)
    base_fields = dict(method=args.method, density=args.density, block_q=args.size, block_k=args.size,
                       group_size=args.size, warmup_steps=args.warmup, anchor_steps=ints(args.anchors), residual=True,
                       min_tokens=0, backend="auto")
    eng.SparseConfig.from_dict(base_fields, source=source)
    return eng, layer_density, device, ev, net, base_fields


def run(args) -> dict:
    import torch

    clock0 = time.perf_counter()
    eng, layer_density, device, ev, net, base_fields = testbed_setup(args, "search base")
    if args.anchor_factors:  # every allocation sampled, uniform's too, moves density between the anchors alike
        base_fields["anchor_density_factors"] = layer_density.parse_anchor_factors(args.anchor_factors)
    M, cfg = ev.M, net.cfg
    fit_seeds, check_seeds = ints(args.fit_seeds), ints(args.check_seeds)
    if set(fit_seeds) & set(check_seeds):
        raise SystemExit(f"--fit-seeds {fit_seeds} and --check-seeds {check_seeds} must not share a seed")
    anchors = ints(args.anchors)
    layers, heads = cfg.num_layers, cfg.num_heads
    # the search's units: every head, or every layer (one factor for all its heads: 2 x layers sampling runs a round
    # instead of 2 x layers x heads, the cost a large model can afford)
    per_unit = heads if args.scope == "layer" else 1
    units = layers * heads // per_unit

    def expand(factors):  # per-unit factors -> per-head (layer-major); every unit has as many heads, so the mean stays
        return [f for f in factors for _ in range(per_unit)]

    def unit_name(i):
        return f"{i}" if per_unit > 1 else f"{i // heads}.{i % heads}"

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def inputs(seeds):
        return ev.make_noise(cfg, seeds), torch.tensor([s % cfg.num_classes for s in seeds], dtype=torch.long)

    def sample(seeds, attn):
        noise, labels = inputs(seeds)
        return ev.sample(net, noise, labels, steps=args.steps, shift=args.shift, batch=args.batch, attn=attn,
                         device=device).to(device)

    t = time.perf_counter()
    refs = {"fit": sample(fit_seeds, M.sdpa_attention), "check": sample(check_seeds, M.sdpa_attention)}
    sync()
    say(f"testbed: {layers} layers x {heads} heads, {math.prod(cfg.grid)} tokens, device {device}; dense references "
        f"in {time.perf_counter() - t:.1f} s")

    def score(factors, which="fit"):
        config = dict(base_fields)
        if factors is not None:
            config["layer_densities"] = layer_density.layer_densities_dict(
                as_layer_densities(expand(factors), heads))
        attn = EngineAttention(config, args.steps, M.CONTEXT, dense_fn=M.sdpa_attention)
        with attn.run():
            video = sample(fit_seeds if which == "fit" else check_seeds, attn)
        sync()
        p = ev.psnr(video, refs[which])
        return dict(psnr=[round(x, 3) for x in p], psnr_mean=round(sum(p) / len(p), 3), psnr_min=round(min(p), 3),
                    density_sparse=attn.stats["density_sparse"])

    deadline = clock0 + args.budget_s
    uniform = [1.0] * units
    uniform_fit = score(None)
    best, best_fit = uniform, uniform_fit
    say(f"uniform: fit PSNR {best_fit['psnr_mean']:.2f} dB (min {best_fit['psnr_min']:.2f})")
    if args.start:
        best = start_factors(args.start, layers, heads, layer_density.parse_layer_densities)
        best = [sum(best[u * per_unit:(u + 1) * per_unit]) / per_unit for u in range(units)]  # a layer's mean
        outside = [f for f in best if not args.min_factor - 1e-6 <= f <= args.max_factor + 1e-6]
        if outside:
            raise SystemExit(f"--start: factors {outside} (after scaling to mean 1) lie outside [--min-factor "
                             f"{args.min_factor}, --max-factor {args.max_factor}]")
        best_fit = score(best)
        say(f"start {layer_density.layer_densities_text(as_layer_densities(expand(best), heads))}: fit PSNR "
            f"{best_fit['psnr_mean']:.2f} dB")
    start_fit = best_fit if args.start else None  # what round 1's moves are measured against
    moves, rounds = [], []
    per_eval = None
    for rnd in range(args.rounds):
        cands = []
        for i in range(len(best)):
            for delta in (args.step, -args.step):
                f = moved(best, i, delta, args.min_factor, args.max_factor)
                if f is not None:
                    cands.append((f"{unit_name(i)}{'+' if delta > 0 else '-'}", f))
        scored = []
        for name, f in cands:
            if per_eval is not None and time.perf_counter() + per_eval > deadline:
                break
            t = time.perf_counter()
            s = score(f)
            per_eval = time.perf_counter() - t
            scored.append((s["psnr_mean"], name, f, s))
            moves.append(dict(round=rnd + 1, move=name, psnr_mean=s["psnr_mean"], psnr_min=s["psnr_min"],
                              density_sparse=s["density_sparse"]))
        n_single = len(scored)
        complete = n_single == len(cands)
        predicted = None
        if args.mode == "quadratic" and complete and time.perf_counter() + (per_eval or 0) <= deadline:
            names = [unit_name(i) for i in range(len(best))]
            model = fit({name: s["psnr_mean"] - best_fit["psnr_mean"] for _, name, _, s in scored}, args.step, names,
                        factors=best)
            deltas = solve(model, args.radius, dict(zip(names, best)), args.min_factor, args.max_factor)
            predicted = predict(model, deltas)
            f = [x + deltas[n] for x, n in zip(best, names)]
            mean = sum(f) / len(f)
            f = [x / mean for x in f]  # the deltas sum to 0; this only removes rounding
            s = score(f)
            name = f"model r{args.radius:g}"
            scored.append((s["psnr_mean"], name, f, s))
            moves.append(dict(round=rnd + 1, move=name, psnr_mean=s["psnr_mean"], psnr_min=s["psnr_min"],
                              density_sparse=s["density_sparse"], predicted_gain=round(predicted, 3)))
            say(f"round {rnd + 1}: the model's allocation (predicted {predicted:+.2f} dB) scores "
                f"{s['psnr_mean'] - best_fit['psnr_mean']:+.2f} dB")
        top = max(scored, key=lambda x: x[0], default=None)
        gain = top[0] - best_fit["psnr_mean"] if top else float("-inf")
        taken = top is not None and gain > args.min_gain_db
        if taken:
            best, best_fit = top[2], top[3]
        rounds.append(dict(round=rnd + 1, scored=n_single, candidates=len(cands), complete=complete,
                           taken=top[1] if taken else None, best_psnr=best_fit["psnr_mean"],
                           model_predicted=None if predicted is None else round(predicted, 3)))
        say(f"round {rnd + 1}: {n_single}/{len(cands)} moves scored; "
            + (f"took {top[1]} ({gain:+.2f} dB): fit PSNR {best_fit['psnr_mean']:.2f}" if taken else
               f"no move gains more than {args.min_gain_db} dB (best {gain:+.2f})"))
        if not taken or not complete:
            break
    result = {"uniform": {"fit": uniform_fit, "check": score(None, "check")},
              "searched": {"fit": best_fit, "check": score(best, "check")},
              **({"start_fit": start_fit} if start_fit is not None else {}),
              "factors": [round(f, 4) for f in expand(best)],
              "layer_densities": layer_density.layer_densities_text(as_layer_densities(expand(best), heads))}
    u, s = result["uniform"]["check"], result["searched"]["check"]
    say(f"check videos: uniform {u['psnr_mean']:.2f} dB, searched {s['psnr_mean']:.2f} dB "
        f"({s['psnr_mean'] - u['psnr_mean']:+.2f}); factors {result['layer_densities']}")
    weights = Path(args.testbed) / "weights.safetensors"
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "versions": versions(), "date": time.strftime("%Y-%m-%d %H:%M"),
            "command": "python bench/quality_search.py " + " ".join(sys.argv[1:]), "method": args.method,
            "density": args.density, "steps": args.steps, "warmup": args.warmup, "anchors": anchors,
            "anchor_factors": args.anchor_factors,
            "size": args.size, "step": args.step, "mode": args.mode, "scope": args.scope,
            "radius": args.radius if args.mode == "quadratic" else None,
            "fit_seeds": fit_seeds, "check_seeds": check_seeds,
            "start": args.start or None,
            "wall_s": round(time.perf_counter() - clock0, 1),
            "testbed": {"layers": layers, "heads": heads, "tokens": math.prod(cfg.grid),
                        "random_init": bool(args.random_init_small),
                        "weights_sha256": None if args.random_init_small else sha256(weights)}}
    doc = {"meta": meta, "moves": moves, "rounds": rounds, "result": result}
    write_json(out / "search.json", doc)
    (out / "search.md").write_text(section(doc))
    say(f"wrote {out / 'search.json'} and {out / 'search.md'} ({meta['wall_s']:.0f} s)")
    return doc


def testbed_arguments(ap: argparse.ArgumentParser) -> None:
    """The testbed, the output folder, the method and its average density: the options this script and
    bench/quality_allocations.py share first (sampling_arguments gives the rest)."""
    ap.add_argument("--testbed", required=True, help="folder with the testbed's model.py, evaluate.py, weights")
    ap.add_argument("--out", required=True)
    ap.add_argument("--method", default="mc_sparse")
    ap.add_argument("--density", type=float, default=0.1)


def sampling_arguments(ap: argparse.ArgumentParser) -> None:
    """How the testbed samples (steps, schedule, block size, shift, device, or a tiny random model): testbed_setup's
    options, shared with bench/quality_allocations.py."""
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--anchors", default="2,10")
    ap.add_argument("--size", type=int, default=64, help="blocks (block_topk) and query groups (mc_sparse)")
    ap.add_argument("--shift", type=float, default=3.0)
    ap.add_argument("--device", default=None)
    ap.add_argument("--random-init-small", action="store_true",
                    help="the testbed's --random-init --small: a tiny random model (CPU check, no weights)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    testbed_arguments(ap)
    ap.add_argument("--step", type=float, default=0.5, help="factor change of one move")
    ap.add_argument("--mode", choices=("greedy", "quadratic"), default="greedy",
                    help="greedy: take the best single move per round; quadratic: also sample the optimum of a "
                    "per-head quadratic model fitted to the round's moves (bench/search_model.py)")
    ap.add_argument("--radius", type=float, default=0.5,
                    help="--mode quadratic: the largest change of one head's factor in the model's allocation")
    ap.add_argument("--scope", choices=("head", "layer"), default="head",
                    help="what one move changes: one head's factor, or one layer's (all its heads alike)")
    ap.add_argument("--min-factor", type=float, default=0.25)
    ap.add_argument("--max-factor", type=float, default=4.0)
    ap.add_argument("--min-gain-db", type=float, default=0.05, help="a move must gain more than this on the fit set")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--start", default="", help="layer_densities to start from (default: uniform), e.g. the "
                    "factors an earlier search printed, to continue it")
    ap.add_argument("--anchor-factors", default="", help="SparseConfig.anchor_density_factors of every allocation "
                    "(uniform's too), e.g. '1.3,0.8895': the per-head search under that split between the anchors")
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop searching (then check) after this long")
    ap.add_argument("--fit-seeds", default="0,1,2,3,4,5,6,7")
    ap.add_argument("--check-seeds", default="8,9,10,11,12,13,14,15")
    ap.add_argument("--batch", type=int, default=8)
    sampling_arguments(ap)
    run(ap.parse_args(argv))


if __name__ == "__main__":
    main()
