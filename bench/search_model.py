"""A quadratic model of how the sampled videos answer per-head densities (docs/calibration.md, "A model of the
output"): from one round of single-head moves around an allocation (bench/quality_search.py: each head's factor
raised and lowered by a step, the other heads rescaled so the mean stays 1), fit for every head

    gain(delta) = a * delta + b * delta**2        (mean PSNR change in dB for a change delta of that head's factor)

through the two measured moves and the allocation itself, then choose the changes (summing to 0, so the average
density stays; each within +-radius and the factor bounds) that maximise the summed gain. The model assumes the heads'
gains add; offline on a search.json this script checks that assumption on the later rounds (how well each round's
single-move gains repeat in the next), what the model predicts for the allocations the searches found (measured
there), and the model's own optimum for each radius:

    python bench/search_model.py docs/bench-runs/search-1/mc_sparse/search.json \\
        [--evaluate docs/bench-runs/search-2/search.json] [--radius 0.5,0.75] [--out table.md]

bench/quality_search.py --mode quadratic uses ``fit`` and ``solve`` to search this way on the testbed.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

MIN_CURVATURE = 0.05  # dB per unit factor squared: a head measured flat or convex is taken as slightly concave, so
# the model never extrapolates a straight line to the radius (two points and the centre cannot show a maximum there)


def moved(factors: list[float], i: int, delta: float, lo: float, hi: float) -> list[float] | None:
    """``factors`` with head i changed by ``delta`` and every other head scaled so the mean stays 1; None when a
    factor would leave [lo, hi]."""
    n = len(factors)
    fi = factors[i] + delta
    rest = sum(factors) - factors[i]
    if not (lo <= fi <= hi) or rest <= 0:
        return None
    scale = (n - fi) / rest
    out = [fi if j == i else f * scale for j, f in enumerate(factors)]
    if any(not (lo - 1e-9 <= f <= hi + 1e-9) for f in out):
        return None
    return out


def start_factors(text: str, layers: int, heads: int, parse) -> list[float]:
    """Flat per-head factors (layer-major, mean 1) from a ``layer_densities`` text (unlisted layers and heads keep
    1), e.g. the factors an earlier search printed; ``parse``: engine/layer_density.parse_layer_densities."""
    flat = [1.0] * (layers * heads)
    for layer, f in parse(text):
        if not 0 <= layer < layers:
            raise SystemExit(f"--start: layer {layer} is not among the testbed's {layers} layers")
        per_head = f if isinstance(f, tuple) else (f,) * heads
        if len(per_head) != heads:
            raise SystemExit(f"--start: layer {layer} lists {len(per_head)} factors for {heads} heads")
        flat[layer * heads:(layer + 1) * heads] = [float(x) for x in per_head]
    mean = sum(flat) / len(flat)
    if mean <= 0:
        raise SystemExit("--start: the factors must average more than 0")
    return [x / mean for x in flat]


def head_of(move: str) -> str:
    """'3.1+' -> '3.1' (bench/quality_search.py names moves '<layer>.<head><+|->')."""
    return move[:-1]


def round_gains(doc: dict, rnd: int, base: float) -> dict[str, float]:
    """{move: mean PSNR change against ``base``} for the single-head moves scored in round ``rnd`` of a search.json
    (not the model's allocations of ``--mode quadratic``)."""
    return {m["move"]: m["psnr_mean"] - base for m in doc["moves"] if m["round"] == rnd and m["move"][-1] in "+-"}


def round_bases(doc: dict) -> dict[int, float | None]:
    """The fit PSNR each round's moves start from: the start allocation's for round 1 (None where a search from
    another allocation recorded neither it nor a first round without a move: the files of before 'start_fit'), then
    the previous round's best (search.json's 'rounds')."""
    start = doc["result"].get("start_fit", {}).get("psnr_mean")
    if start is None:
        if not doc["meta"].get("start"):
            start = doc["result"]["uniform"]["fit"]["psnr_mean"]
        elif doc["rounds"] and doc["rounds"][0]["taken"] is None:
            start = doc["rounds"][0]["best_psnr"]
    bases = {1: start}
    for rd in doc["rounds"]:
        bases[rd["round"] + 1] = rd["best_psnr"]
    return bases


def fit(gains: dict[str, float], step: float, heads: list[str],
        factors: list[float] | None = None) -> dict[str, tuple[float, float]]:
    """{head: (a, b)} through gain(0) = 0, gain(+step) and gain(-step) (``gains``: {move: dB}); a head with one move
    measured (the other left the factor bounds) gets curvature -MIN_CURVATURE and the slope through that move, one
    with neither (a, b) = (0, -MIN_CURVATURE). b is capped at -MIN_CURVATURE (module docstring).

    ``factors`` (the allocation the moves started from, one per head in ``heads`` order, mean 1): the moves were
    bench/quality_search.py's, which rescale every other head to keep the mean, so each measured gain is the sum of
    every head's term at that move's changes; the 2 x heads coefficients are solved from all the moves at once (least
    squares, minimum norm) instead of crediting each gain to the moved head alone. Moves that keep the mean cannot
    see a constant added to every slope: the fit takes the slopes of least norm, and every prediction the model is
    used for (changes that keep the mean) is unaffected."""
    if factors is not None:
        return _fit_rescaled(gains, step, heads, factors)
    out = {}
    for h in heads:
        up, down = gains.get(h + "+"), gains.get(h + "-")
        if up is not None and down is not None:
            a = (up - down) / (2 * step)
            b = (up + down) / (2 * step * step)
        elif up is not None or down is not None:
            b = -MIN_CURVATURE
            g, s = (up, step) if up is not None else (down, -step)
            a = (g - b * s * s) / s
        else:
            a, b = 0.0, -MIN_CURVATURE
        out[h] = (a, min(b, -MIN_CURVATURE))
    return out


def _fit_rescaled(gains, step, heads, factors) -> dict[str, tuple[float, float]]:
    import torch

    rows, rhs = [], []
    for move, g in gains.items():
        if move[-1] not in "+-" or head_of(move) not in heads:
            continue
        i = heads.index(head_of(move))
        f = moved(factors, i, step if move[-1] == "+" else -step, 0.0, float(len(factors)))
        if f is None:
            continue
        d = [x - y for x, y in zip(f, factors)]
        rows.append(d + [x * x for x in d])
        rhs.append(g)
    n = len(heads)
    if not rows:
        return {h: (0.0, -MIN_CURVATURE) for h in heads}
    sol = torch.linalg.lstsq(torch.tensor(rows, dtype=torch.float64),
                             torch.tensor(rhs, dtype=torch.float64).unsqueeze(1), driver="gelsd").solution[:, 0]
    return {h: (float(sol[j]), min(float(sol[n + j]), -MIN_CURVATURE)) for j, h in enumerate(heads)}


def predict(model: dict[str, tuple[float, float]], deltas: dict[str, float]) -> float:
    """Summed modelled gain (dB) of the factor changes ``deltas`` ({head: delta}; heads not listed: 0)."""
    return sum(a * deltas.get(h, 0.0) + b * deltas.get(h, 0.0) ** 2 for h, (a, b) in model.items())


def solve(model: dict[str, tuple[float, float]], radius: float, factors: dict[str, float] | None = None,
          lo: float = 0.25, hi: float = 4.0) -> dict[str, float]:
    """The changes {head: delta} maximising ``predict`` with sum(delta) = 0, |delta| <= radius and every factor
    (``factors``: {head: current factor}, default 1) kept in [lo, hi]. Every head's gain is concave (``fit``), so
    the optimum sets each derivative a + 2 b delta to one multiplier, clipped to the head's interval: found by
    bisection on the multiplier (sum of deltas falls as it rises)."""
    factors = factors or {}
    box = {h: (max(-radius, lo - factors.get(h, 1.0)), min(radius, hi - factors.get(h, 1.0))) for h in model}
    if any(low > high for low, high in box.values()):
        raise ValueError("a factor lies outside the bounds; no change keeps it inside")
    if sum(low for low, _ in box.values()) > 0 or sum(high for _, high in box.values()) < 0:
        raise ValueError("no changes within the radius keep the mean")

    def deltas(lam: float) -> dict[str, float]:
        return {h: min(max((lam - a) / (2 * b), box[h][0]), box[h][1]) for h, (a, b) in model.items()}

    # at lam_lo every head sits at its upper end, at lam_hi at its lower end
    lam_lo = min(a + 2 * b * box[h][1] for h, (a, b) in model.items())
    lam_hi = max(a + 2 * b * box[h][0] for h, (a, b) in model.items())
    for _ in range(200):
        mid = (lam_lo + lam_hi) / 2
        if sum(deltas(mid).values()) > 0:
            lam_lo = mid
        else:
            lam_hi = mid
    out = deltas((lam_lo + lam_hi) / 2)
    # the bisection leaves a residue of ~1e-12 in the sum; put it on the head with the most room
    rest = sum(out.values())
    h = max(out, key=lambda k: box[k][1] - out[k] if rest < 0 else out[k] - box[k][0])
    out[h] -= rest
    return out


def heads_of(doc: dict) -> list[str]:
    t = doc["meta"]["testbed"]
    return [f"{layer}.{head}" for layer in range(t["layers"]) for head in range(t["heads"])]


def spearman(x: list[float], y: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for k, i in enumerate(order):
            r[i] = float(k)
        return r
    return pearson(ranks(x), ranks(y))


def pearson(x: list[float], y: list[float]) -> float:
    n = len(x)
    mx, my = sum(x) / n, sum(y) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx, syy = sum((a - mx) ** 2 for a in x), sum((b - my) ** 2 for b in y)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else 0.0


def neighbour_check(model: dict, doc: dict, heads: list[str], parse) -> dict:
    """The model against a search that started from another allocation (its meta 'start'): the modelled and the
    measured gain of each of its round-1 moves (from that allocation), their rank correlation, and how many of the
    moves the model expects to gain gained. ``parse``: engine/layer_density.parse_layer_densities."""
    layers, per = doc["meta"]["testbed"]["layers"], doc["meta"]["testbed"]["heads"]
    start = start_factors(doc["meta"]["start"], layers, per, parse)
    base = round_bases(doc)[1]
    p0 = predict(model, {h: f - 1.0 for h, f in zip(heads, start)})
    step, rows = doc["meta"]["step"], []
    # without the start's own PSNR the gains' signs are unknown, their ranks are not: measured against round 1's best
    for move, measured in round_gains(doc, 1, doc["rounds"][0]["best_psnr"] if base is None else base).items():
        i = heads.index(head_of(move))
        f = moved(start, i, step if move[-1] == "+" else -step, 0.0, float(len(start)))
        rows.append((move, predict(model, {h: x - 1.0 for h, x in zip(heads, f)}) - p0, measured))
    up = [r for r in rows if r[1] > 0]
    known = base is not None and bool(rows)
    return dict(moves=len(rows), step=step, spearman=round(spearman([r[1] for r in rows], [r[2] for r in rows]), 3),
                predicted_up=len(up), measured_up=sum(1 for r in up if r[2] > 0) if known else None,
                predicted_best=round(max((r[1] for r in rows), default=0.0), 3),
                measured_range=(round(min(r[2] for r in rows), 3), round(max(r[2] for r in rows), 3)) if known
                else None)


def analyse(doc: dict, others: list[tuple[str, dict]], radii: list[float], name: str = "search",
            parse=None) -> dict:
    """The report's numbers: round-to-round stability, the model's predictions for the searched allocations (of
    ``doc``, called ``name``, and of ``others``: (name, search.json) pairs), for the single moves of the ``others``
    that started from another allocation (``neighbour_check``; ``parse`` reads their start), and its optimum per
    radius (the model fitted on round 1 of ``doc``, which must start from uniform)."""
    if doc["meta"].get("start"):
        raise SystemExit("the model's search must start from the uniform allocation (its meta 'start' is set)")
    heads, step = heads_of(doc), doc["meta"]["step"]
    bases = round_bases(doc)
    gains = {r: round_gains(doc, r, bases[r]) for r in sorted({m["round"] for m in doc["moves"]})}
    stability = []
    for r in sorted(gains):
        if r - 1 in gains:
            common = sorted(set(gains[r]) & set(gains[r - 1]))
            if len(common) >= 3:
                x, y = [gains[r - 1][m] for m in common], [gains[r][m] for m in common]
                stability.append(dict(rounds=(r - 1, r), moves=len(common), spearman=round(spearman(x, y), 3),
                                      pearson=round(pearson(x, y), 3)))
    model = fit(gains[1], step, heads, factors=[1.0] * len(heads))  # round 1 starts from uniform
    uniform = doc["result"]["uniform"]["fit"]["psnr_mean"]
    checks = []
    for label, d in [(name, doc)] + list(others):
        deltas = {h: f - 1.0 for h, f in zip(heads, d["result"]["factors"])}
        base = d["result"]["uniform"]["fit"]["psnr_mean"]
        checks.append(dict(name=label, command=d["meta"]["command"], predicted=round(predict(model, deltas), 3),
                           measured=round(d["result"]["searched"]["fit"]["psnr_mean"] - base, 3),
                           max_change=round(max(abs(v) for v in deltas.values()), 3)))
    neighbours = []
    for label, d in others:
        if d["meta"].get("start") and parse is not None:
            neighbours.append(dict(name=label, **neighbour_check(model, d, heads, parse)))
    optima = []
    for r in radii:
        deltas = solve(model, r)
        optima.append(dict(radius=r, predicted=round(predict(model, deltas), 3),
                           factors={h: round(1.0 + deltas[h], 4) for h in heads}))
    return dict(source=doc["meta"]["command"], method=doc["meta"]["method"], density=doc["meta"]["density"],
                step=step, uniform_fit=uniform, stability=stability,
                model={h: [round(a, 4), round(b, 4)] for h, (a, b) in model.items()}, checks=checks,
                neighbours=neighbours, optima=optima)


def layer_densities_text(factors: dict[str, float], layers: int, heads: int) -> str:
    parts = []
    for layer in range(layers):
        f = [factors[f"{layer}.{h}"] for h in range(heads)]
        parts.append(f"{layer}: " + (f"{f[0]:g}" if len(set(f)) == 1 else "[" + ", ".join(f"{x:g}" for x in f) + "]"))
    return "{" + ", ".join(parts) + "}"


def table(result: dict, layers: int, heads: int) -> str:
    lines = [f"Model fitted on round 1 of {result['checks'][0]['name']} ({result['method']} at "
             f"{result['density']:g}, moves of ±{result['step']:g}; uniform fit PSNR {result['uniform_fit']:.2f} dB).",
             "",
             "| rounds | single moves in both | Spearman ρ of their gains | Pearson r |", "|---|---|---|---|"]
    for s in result["stability"]:
        lines.append(f"| {s['rounds'][0]} → {s['rounds'][1]} | {s['moves']} | {s['spearman']:+.2f} | "
                     f"{s['pearson']:+.2f} |")
    lines += ["", "| allocation | largest factor change | modelled gain dB | measured fit gain dB |",
              "|---|---|---|---|"]
    for c in result["checks"]:
        lines.append(f"| the allocation {c['name']} found | {c['max_change']:.2f} | {c['predicted']:+.2f} | "
                     f"{c['measured']:+.2f} |")
    for o in result["optima"]:
        lines.append(f"| model optimum, radius {o['radius']:g} | {o['radius']:g} | {o['predicted']:+.2f} | "
                     f"not measured |")
    if result["neighbours"]:
        lines += ["", "| single moves from where another search started | moves | Spearman ρ, modelled vs measured "
                  "gain | the model expects a gain from | of which gained | measured gains dB |",
                  "|---|---|---|---|---|---|"]
        for n in result["neighbours"]:
            rng = "start's PSNR not recorded" if n["measured_range"] is None else (
                f"{n['measured_range'][0]:+.3f} to {n['measured_range'][1]:+.3f}")
            up = "–" if n["measured_up"] is None else n["measured_up"]
            lines.append(f"| {n['name']} (±{n['step']:g}) | {n['moves']} | {n['spearman']:+.2f} | "
                         f"{n['predicted_up']} (best modelled {n['predicted_best']:+.3f} dB) | {up} | {rng} |")
    lines.append("")
    for o in result["optima"]:
        lines.append(f"- radius {o['radius']:g}: `{layer_densities_text(o['factors'], layers, heads)}`")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("search", help="search.json of bench/quality_search.py that started from uniform")
    ap.add_argument("--evaluate", nargs="*", default=[], help="further search.json files (e.g. a continued "
                    "search) whose searched allocation the model predicts")
    ap.add_argument("--radius", default="0.5,0.75", help="largest factor change of one head, comma list")
    ap.add_argument("--out", default=None, help="write the markdown table here (default: print it)")
    ap.add_argument("--factors", type=float, default=None, metavar="RADIUS",
                    help="print only the model optimum's layer_densities for this radius (for --start of "
                    "bench/quality_search.py) and exit")
    args = ap.parse_args(argv)
    doc = json.loads(Path(args.search).read_text())
    others = [(f"`{p}`", json.loads(Path(p).read_text())) for p in args.evaluate]
    radii = [args.factors] if args.factors is not None else [float(x) for x in args.radius.split(",") if x.strip()]
    parse = None
    if any(d["meta"].get("start") for _, d in others):
        from _pack import load  # the pack's own reader of layer_densities texts (bench/ is on the path)
        parse = load("engine.layer_density").parse_layer_densities
    result = analyse(doc, others, radii, name=f"`{args.search}`", parse=parse)
    t = doc["meta"]["testbed"]
    if args.factors is not None:
        print(layer_densities_text(result["optima"][0]["factors"], t["layers"], t["heads"]))
        return
    text = table(result, t["layers"], t["heads"])
    if args.out:
        Path(args.out).write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
