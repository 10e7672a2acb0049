"""Does the calibration's objective predict what the sampled videos say? (docs/calibration.md, "A search on the
output"). Offline, from two runs already in the repository: the error curves of a calibration run
(`bench/quality_calibration.py`, calibration.json) and the first round of an output search
(`bench/quality_search.py`, search.json: every single-head move from the uniform density, each with its measured
PSNR change). For each move the objective's predicted change (the summed weighted error before minus after the
move, interpolated on the curves as engine/calibrate.py does) is ranked against the measured PSNR change:
Spearman's rank correlation, for the objective the calibration uses (reuse error, energy-weighted, squared) and
eleven variants of it. With ``--testbed DIR`` (the quality testbed's folder) twelve more variants scale each head's
term by what its block does with that head's output: the squared norm of the AdaLN-gated output projection's
slice for the head, averaged over the timesteps of a 30-step run and the classes (``output_map_weights``); with
``--sensitivity`` they scale it by its layer's measured sensitivity instead (the pixel error of a sampling run with
only that layer sparse, from the calibration run's ``sensitivity`` section: ``layer_sensitivity_scale``); with
``--jacobian DIR`` by its gain through the whole network to the model's output, measured along dense sampling runs
(``output_jacobian_weights``; ``--weights-out`` keeps the scales, ``--weights`` reads them back).

    python bench/calibration_vs_search.py docs/bench-runs/calibration-2/calibration.json \\
        docs/bench-runs/search-1/mc_sparse/search.json [--out table.md] \\
        [--testbed ../shared/quality | --sensitivity | --jacobian ../shared/quality | --weights FILE]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import quality_search

OBJECTIVES = ("reuse", "fresh", "reuse_plain")


def interp(xs: list[float], ys: list[float], x: float) -> float:
    """Linear interpolation of ys over increasing xs at x, clamped to the ends (as engine/calibrate.py's)."""
    if x <= xs[0]:
        return ys[0]
    for i in range(len(xs) - 1):
        if xs[i] <= x <= xs[i + 1]:
            t = (x - xs[i]) / (xs[i + 1] - xs[i])
            return ys[i] + t * (ys[i + 1] - ys[i])
    return ys[-1]


def ranks(values: list[float]) -> list[float]:
    """Ranks from 0, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for p in range(i, j + 1):
            out[order[p]] = (i + j) / 2
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (Pearson's on the ranks, so ties are handled); 0 when either side is constant."""
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra)
    vb = sum((y - mb) ** 2 for y in rb)
    return cov / (va * vb) ** 0.5 if va > 0 and vb > 0 else 0.0


def moved(factors: list[float], i: int, delta: float) -> list[float]:
    """bench/quality_search.py's move (head i changed by delta, the others scaled to keep the mean), unbounded: the
    moves being ranked were all within the search's bounds."""
    return quality_search.moved(factors, i, delta, 0.0, float(len(factors)))


def cost(curves: list[dict], factors: list[float], density: float, objective: str, weighted: bool,
         squared: bool, scale: dict | None = None) -> float:
    """Σ over heads of (weight ×) (scale[(layer, head)] ×) error (or error²) at density × factor; curves and factors
    in the same order."""
    total = 0.0
    for c, f in zip(curves, factors):
        e = interp(c["densities"], c[objective], density * f)
        s = 1.0 if scale is None else scale[(c["layer"], c["head"])]
        total += (c["weight"] if weighted else 1.0) * s * (e * e if squared else e)
    return total


def output_map_weights(model, steps: int = 30, shift: float = 3.0) -> dict:
    """{(layer, head): mean over the timesteps of a ``steps``-step run (shifted as the testbed samples) and over the
    classes of ||diag(gate) W_o[:, head's columns]||_F²}: how strongly each head's attention output reaches the
    residual stream. ``model`` is the testbed's DiT (``blocks[i].o``, ``blocks[i].modulation``,
    ``embed_conditions(t, y) -> (e0, e (B, 6, dim))``, ``cfg.num_heads / head_dim / num_classes``); gate = the third
    of the six modulation vectors, as the testbed's Block applies it to o(attention)."""
    import torch
    cfg = model.cfg
    t = torch.linspace(1, 0, steps + 1)[:-1]
    t = shift * t / (1 + (shift - 1) * t)
    classes = torch.arange(cfg.num_classes)
    out = {}
    with torch.no_grad():
        gates = []
        for ti in t:
            _, e = model.embed_conditions(ti.expand(len(classes)), classes)
            gates.append(e)
        for li, blk in enumerate(model.blocks):
            w_o = blk.o.weight.float()  # (dim, dim): out x in
            acc = torch.zeros(cfg.num_heads)
            for e in gates:
                gate = (blk.modulation + e).unbind(1)[2]  # (classes, dim)
                for hi in range(cfg.num_heads):
                    cols = w_o[:, hi * cfg.head_dim:(hi + 1) * cfg.head_dim]
                    acc[hi] += ((gate[:, :, None] * cols[None]) ** 2).sum((1, 2)).mean()
            for hi in range(cfg.num_heads):
                out[(li, hi)] = float(acc[hi]) / len(gates)
    return out


def output_jacobian_weights(ev, model, seeds=(0,), steps: int = 30, shift: float = 3.0, at=(4, 8, 14, 20, 26),
                            samples: int = 2, by_step: bool = True, log=None) -> dict:
    """{(layer, head): the mean squared gain from a head's attention output to the model's output}, measured through
    the whole network (not only the block's own output map, as ``output_map_weights``): along the dense sampling run
    of each seed (the testbed's Euler sampler, ``steps`` steps), at each step of ``at`` a zero tensor z_l (1, H, N, D)
    is added to every layer's attention output and, for ``samples`` random directions u ~ N(0, I) of the predicted
    velocity (1, C, T, H, W), the gradient of <u, v(x)> with respect to every z_l is taken in one backward pass:
    E_u ||∂<u, v>/∂z_{l,h}||² = ||J_{l,h}||_F² (Hutchinson), divided by the head's N × D elements. Each step's term is
    weighted by its |Δt| (the Euler step multiplies the velocity's error by it) when ``by_step``. ``ev``: the
    testbed's evaluate module (its ``M``, ``time_grid``, ``make_noise``); ``model``: its DiT in fp32, whose parameters
    are left with requires_grad off (no backward pass needs them). What it costs:
    len(seeds) dense runs plus len(seeds) × len(at) × (1 forward + ``samples`` backward passes)."""
    import torch
    M = ev.M
    cfg = model.cfg
    ts = ev.time_grid(steps, shift)
    dev = next(model.parameters()).device
    for p in model.parameters():
        p.requires_grad_(False)
    acc = torch.zeros(cfg.num_layers, cfg.num_heads, dtype=torch.float64)
    zs: list = []

    def with_z(q, k, v):
        o = M.sdpa_attention(q, k, v)
        return o + zs[M.CONTEXT["layer"]] if zs else o

    prev = M.set_attention(with_z)
    total_w = 0.0
    try:
        for seed in seeds:
            x = ev.make_noise(cfg, [seed]).to(dev)
            y = torch.tensor([seed % cfg.num_classes], device=dev)
            tokens = x[0, 0].numel() // math.prod(cfg.patch)  # one channel's elements over a patch's
            for i in range(max(at) + 1):
                t = torch.full((1,), float(ts[i]), device=dev)
                if i in at:
                    zs[:] = [torch.zeros(1, cfg.num_heads, tokens, cfg.head_dim, device=dev, requires_grad=True)
                             for _ in range(cfg.num_layers)]
                    with torch.enable_grad():
                        out = model(x, t, y).float()
                        w = abs(float(ts[i + 1] - ts[i])) if by_step else 1.0
                        for r in range(samples):
                            u = torch.randn(out.shape, generator=torch.Generator().manual_seed(1000 * seed + 10 * i
                                                                                                + r)).to(dev)
                            grads = torch.autograd.grad((out * u).sum(), zs, retain_graph=r + 1 < samples)
                            for li, g in enumerate(grads):
                                acc[li] += w * (g[0].double() ** 2).sum((1, 2)).cpu() / (g[0, 0].numel() * samples)
                    total_w += w
                    zs.clear()
                    if log:
                        log(f"seed {seed} step {i}: done")
                    v = out.detach()
                else:
                    with torch.no_grad():
                        v = model(x, t, y).float()
                x = x + float(ts[i + 1] - ts[i]) * v
    finally:
        M.set_attention(prev)
    acc /= max(total_w, 1e-30)
    return {(li, hi): float(acc[li, hi]) for li in range(cfg.num_layers) for hi in range(cfg.num_heads)}


def layer_sensitivity_scale(calibration: dict, method: str, density: float) -> dict:
    """{(layer, head): the layer's measured sensitivity} for every curve of ``method``, from the calibration run's
    ``sensitivity`` entry for that method and target density (bench/quality_calibration.py: ``layer_weights``)."""
    entry = next((e for e in calibration.get("sensitivity", []) if e["method"] == method
                  and abs(e["target"] - density) < 1e-9), None)
    if entry is None:
        raise SystemExit(f"the calibration has no layer sensitivities for {method} at density {density}")
    weights = {int(k): float(v) for k, v in entry["layer_weights"].items()}
    return {(c["layer"], c["head"]): weights[c["layer"]] for c in calibration["curves"] if c["method"] == method}


def compare(calibration: dict, search: dict, head_scale: dict | None = None) -> list[dict]:
    """One row per objective variant: its Spearman correlation with the measured PSNR changes of the search's first
    round. The moves' names are '<layer>.<head><+|->' (bench/quality_search.py). With ``head_scale`` ({(layer,
    head): factor}, e.g. ``output_map_weights``) every variant is also ranked with each head's term scaled."""
    meta = search["meta"]
    method, density, step = meta["method"], meta["density"], meta["step"]
    curves = sorted((c for c in calibration["curves"] if c["method"] == method), key=lambda c: (c["layer"], c["head"]))
    keys = [(c["layer"], c["head"]) for c in curves]
    if not curves:
        raise SystemExit(f"the calibration has no curves for {method}")
    start = meta.get("start")
    if start:
        raise SystemExit("the search started from given factors; its first round is not measured from uniform")
    base_psnr = search["result"]["uniform"]["fit"]["psnr_mean"]
    moves = [m for m in search["moves"] if m["round"] == 1]
    measured, index, sign = [], [], []
    for m in moves:
        layer, rest = m["move"].split(".")
        key = (int(layer), int(rest[:-1]))
        if key not in keys:
            raise SystemExit(f"move {m['move']}: the calibration has no curve for layer {key[0]} head {key[1]}")
        measured.append(m["psnr_mean"] - base_psnr)
        index.append(keys.index(key))
        sign.append(1.0 if rest.endswith("+") else -1.0)
    base = [1.0] * len(curves)
    rows = []
    for scale in (None, head_scale) if head_scale is not None else (None,):
        for objective in OBJECTIVES:
            for weighted in (True, False):
                for squared in (True, False):
                    args = (objective, weighted, squared, scale)
                    before = cost(curves, base, density, *args)
                    predicted = [before - cost(curves, moved(base, i, s * step), density, *args)
                                 for i, s in zip(index, sign)]
                    rows.append(dict(objective=objective, weighted=weighted, squared=squared,
                                     scaled=scale is not None,
                                     used_by_calibration=(objective == "reuse" and weighted and squared
                                                          and scale is None),
                                     spearman=round(spearman(predicted, measured), 3), moves=len(measured)))
    return rows


def table(rows: list[dict], calibration_path: str, search_path: str, scale_name: str = "head scale") -> str:
    lines = [f"Rank correlation of predicted against measured PSNR change, {rows[0]['moves']} single-head moves from "
             f"uniform (`{calibration_path}` against `{search_path}`):", "",
             f"| error | weighted by energy share | × {scale_name} | squared | Spearman ρ |",
             "|---|---|---|---|---|"]
    for r in rows:
        mark = " (the calibration's objective)" if r["used_by_calibration"] else ""
        lines.append(f"| {r['objective']}{mark} | {'yes' if r['weighted'] else 'no'} | "
                     f"{'yes' if r.get('scaled') else 'no'} | {'yes' if r['squared'] else 'no'} | "
                     f"{r['spearman']:+.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("calibration", help="calibration.json of bench/quality_calibration.py")
    ap.add_argument("search", help="search.json of bench/quality_search.py (started from uniform)")
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    scaling = ap.add_mutually_exclusive_group()
    scaling.add_argument("--testbed", default=None, help="the quality testbed's folder: also rank with each head's "
                         "term scaled by its gated output map (output_map_weights)")
    scaling.add_argument("--sensitivity", action="store_true", help="also rank with each head's term scaled by its "
                         "layer's measured sensitivity (layer_sensitivity_scale)")
    scaling.add_argument("--jacobian", default=None, metavar="TESTBED", help="the quality testbed's folder: also "
                         "rank with each head's term scaled by its gain through the whole network to the model's "
                         "output (output_jacobian_weights)")
    scaling.add_argument("--weights", default=None, help="a JSON file of per-head scales as --weights-out writes them")
    ap.add_argument("--jacobian-seeds", default="0", help="--jacobian: the videos whose dense runs it follows")
    ap.add_argument("--jacobian-at", default="4,8,14,20,26", help="--jacobian: the steps it measures at")
    ap.add_argument("--jacobian-samples", type=int, default=2, help="--jacobian: random directions per step")
    ap.add_argument("--jacobian-flat", action="store_true", help="--jacobian: steps weighted equally, not by |Δt|")
    ap.add_argument("--device", default="cpu", help="--jacobian: where the testbed runs")
    ap.add_argument("--weights-out", default=None, help="write the per-head scales used here as JSON")
    args = ap.parse_args(argv)
    calibration, search = json.loads(Path(args.calibration).read_text()), json.loads(Path(args.search).read_text())
    scale = None
    if args.testbed:
        from quality import build_model, load_testbed  # the testbed's DiT with its trained weights, on the CPU
        scale = output_map_weights(build_model(load_testbed(args.testbed, True), args.testbed, False, "cpu"))
    elif args.jacobian:
        from quality import build_model, load_testbed
        ev = load_testbed(args.jacobian, True)
        scale = output_jacobian_weights(
            ev, build_model(ev, args.jacobian, False, args.device).float(),
            seeds=[int(x) for x in args.jacobian_seeds.split(",")], at=[int(x) for x in args.jacobian_at.split(",")],
            samples=args.jacobian_samples, by_step=not args.jacobian_flat, log=lambda m: print(m, flush=True))
    elif args.weights:
        scale = {tuple(int(x) for x in k.split(".")): float(v)
                 for k, v in json.loads(Path(args.weights).read_text()).items()}
    elif args.sensitivity:
        scale = layer_sensitivity_scale(calibration, search["meta"]["method"], search["meta"]["density"])
    if args.weights_out and scale is not None:
        Path(args.weights_out).write_text(json.dumps({f"{k[0]}.{k[1]}": v for k, v in sorted(scale.items())},
                                                     indent=1))
    rows = compare(calibration, search, scale)
    name = ("gated output map" if args.testbed else "layer sensitivity" if args.sensitivity
            else "gain to the output" if args.jacobian or args.weights else "head scale")
    md = table(rows, args.calibration, args.search, name)
    if args.out:
        Path(args.out).write_text(md)
    print(md, end="")


if __name__ == "__main__":
    main()
