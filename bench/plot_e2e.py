"""Plot end-to-end results of bench/e2e.py (one or more e2e.json files) as a PNG.

    python bench/plot_e2e.py OUT.png RUN1/e2e.json [RUN2/e2e.json ...]
    python bench/plot_e2e.py --table RUN1/e2e.json [RUN2/e2e.json ...]   # merged rows as markdown (no matplotlib)

A (model, mode) measured in several runs is taken from the first file that has it (list newest first).
Left: projected speedup of the preset's full schedule per model and mode, with the schedule's Amdahl
ceiling as a tick; right: the speedup of one reuse step (the steady state). Needs matplotlib.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(paths):
    rows, seen = [], set()
    for p in paths:
        for r in json.loads(Path(p).read_text())["rows"]:
            key = (r["model"], r["mode"])
            if "skipped" in r or r["mode"] == "dense" or key in seen:
                continue
            seen.add(key)
            rows.append(dict(r, run=Path(p).parent.name))
    return rows


def table(rows) -> str:
    """Markdown rows: model, mode, anchor s, reuse s, steady, projected s, speedup, ceiling, of ceiling,
    peak GB, cache GPU / CPU MB, fallbacks, run (the folder under docs/bench-runs)."""
    def f(r, k, fmt):
        v = r.get(k)
        return "–" if v is None else format(v, fmt)
    order = {m: i for i, m in enumerate(["mc_sparse", "block_topk", "sol"])}
    def key(r):
        method, dens = r["mode"].split("@")
        return r["model"], -float(dens), order.get(method, 9)
    rows = sorted(rows, key=key)
    out = ["| model | mode | anchor s | reuse s | steady | projected s | speedup | ceiling | of ceiling | peak GB "
           "| cache GPU / CPU MB | fallback calls | run |", "|" + "---|" * 13]
    for r in rows:
        fb = r.get("cache_fallbacks")
        cache = "–" if "cache_gpu_mb" not in r else f"{r['cache_gpu_mb']:,.0f} / {r['cache_cpu_mb']:,.0f}"
        out.append(f"| {r['model']} | {r['mode']} | {f(r, 'anchor_s', '.1f')} | {f(r, 'step_s', '.2f')} | "
                   f"{f(r, 'steady_speedup', '.2f')}× | {f(r, 'projected_s', '.0f')} | **{r['speedup']:.2f}×** | "
                   f"{f(r, 'ceiling_speedup', '.2f')} | {f(r, 'of_ceiling', '.2f')} | {f(r, 'peak_gb', '.1f')} | "
                   f"{cache} | {'–' if fb is None else fb} | {r['run']} |")
    return "\n".join(out)


def main():
    if sys.argv[1] == "--table":  # no matplotlib needed
        sys.stdout.write(table(load(sys.argv[2:])) + "\n")
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, paths = sys.argv[1], sys.argv[2:]
    rows = load(paths)
    models = list(dict.fromkeys(r["model"] for r in rows))
    modes = sorted({r["mode"] for r in rows}, key=lambda m: (float(m.split("@")[1]), m))
    colors = {"mc_sparse": "#1f77b4", "block_topk": "#2ca02c", "sol": "#d62728"}
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.8), sharey=False)
    width = 0.8 / max(1, len(modes))
    for ax, field, title in ((axes[0], "speedup", "projected full run (preset schedule) vs dense"),
                             (axes[1], "steady_speedup", "one reuse step vs one dense step")):
        for j, mode in enumerate(modes):
            method = mode.split("@")[0]
            xs, ys, ceil = [], [], []
            for i, m in enumerate(models):
                r = next((r for r in rows if r["model"] == m and r["mode"] == mode), None)
                if r is None:
                    continue
                xs.append(i + (j - len(modes) / 2 + 0.5) * width)
                ys.append(r[field])
                ceil.append(r.get("ceiling_speedup"))
            alpha = {0.1: 1.0, 0.15: 0.75, 0.25: 0.5}.get(float(mode.split("@")[1]), 0.6)
            ax.bar(xs, ys, width, color=colors.get(method, "gray"), alpha=alpha, label=mode)
            if field == "speedup":
                for x, c in zip(xs, ceil):
                    if c:
                        ax.plot([x - width / 2, x + width / 2], [c, c], color="black", lw=1.5)
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xticks(range(len(models)))
        ax.set_xticklabels(models)
        ax.set_title(title)
        ax.set_ylabel("speedup (x)")
    axes[0].legend(fontsize=7, ncol=3)
    fig.suptitle("End to end on an H200 (random bf16 weights at real dimensions); black ticks: Amdahl ceiling")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
