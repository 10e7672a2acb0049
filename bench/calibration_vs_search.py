"""Does the calibration's objective predict what the sampled videos say? (docs/calibration.md, "A search on the
output"). Offline, from two runs already in the repository: the error curves of a calibration run
(`bench/quality_calibration.py`, calibration.json) and the first round of an output search
(`bench/quality_search.py`, search.json: every single-head move from the uniform density, each with its measured
PSNR change). For each move the objective's predicted change (the summed weighted error before minus after the
move, interpolated on the curves as engine/calibrate.py does) is ranked against the measured PSNR change:
Spearman's rank correlation, for the objective the calibration uses (reuse error, energy-weighted, squared) and
eleven variants of it.

    python bench/calibration_vs_search.py docs/bench-runs/calibration-2/calibration.json \\
        docs/bench-runs/search-1/mc_sparse/search.json [--out table.md]
"""

from __future__ import annotations

import argparse
import json
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
         squared: bool) -> float:
    """Σ over heads of (weight ×) error (or error²) at density × factor; curves and factors in the same order."""
    total = 0.0
    for c, f in zip(curves, factors):
        e = interp(c["densities"], c[objective], density * f)
        total += (c["weight"] if weighted else 1.0) * (e * e if squared else e)
    return total


def compare(calibration: dict, search: dict) -> list[dict]:
    """One row per objective variant: its Spearman correlation with the measured PSNR changes of the search's first
    round. The moves' names are '<layer>.<head><+|->' (bench/quality_search.py)."""
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
    for objective in OBJECTIVES:
        for weighted in (True, False):
            for squared in (True, False):
                before = cost(curves, base, density, objective, weighted, squared)
                predicted = [before - cost(curves, moved(base, i, s * step), density, objective, weighted, squared)
                             for i, s in zip(index, sign)]
                rows.append(dict(objective=objective, weighted=weighted, squared=squared,
                                 used_by_calibration=(objective == "reuse" and weighted and squared),
                                 spearman=round(spearman(predicted, measured), 3), moves=len(measured)))
    return rows


def table(rows: list[dict], calibration_path: str, search_path: str) -> str:
    lines = [f"Rank correlation of predicted against measured PSNR change, {rows[0]['moves']} single-head moves from "
             f"uniform (`{calibration_path}` against `{search_path}`):", "",
             "| error | weighted by energy share | squared | Spearman ρ |", "|---|---|---|---|"]
    for r in rows:
        mark = " (the calibration's objective)" if r["used_by_calibration"] else ""
        lines.append(f"| {r['objective']}{mark} | {'yes' if r['weighted'] else 'no'} | "
                     f"{'yes' if r['squared'] else 'no'} | {r['spearman']:+.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("calibration", help="calibration.json of bench/quality_calibration.py")
    ap.add_argument("search", help="search.json of bench/quality_search.py (started from uniform)")
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    args = ap.parse_args(argv)
    rows = compare(json.loads(Path(args.calibration).read_text()), json.loads(Path(args.search).read_text()))
    md = table(rows, args.calibration, args.search)
    if args.out:
        Path(args.out).write_text(md)
    print(md, end="")


if __name__ == "__main__":
    main()
