"""The cost of keep_top's cap on long rows (docs/kernel_notes.md, "v27": long key segments capped at keep_bound, a row
over it raising its threshold by bisection inside the threshold kernel), at Wan 2.1 14B's size.

    python bench/threshold_cap.py --out DIR                       # CUDA: 40 heads x 75 600 tokens, D 128, bf16
    python bench/threshold_cap.py --out DIR --dry                 # CPU, small (20 480 tokens): the same code path

For each kind of q/k (``random``: N(0, 1); ``local``: N(0, 1) plus a smooth 3-D positional signal, random Fourier
features of (frame, row, column) with a length scale per head between 2 and 16 latent cells, so nearby tokens attend
to each other with a logit of about ``--locality`` at distance 0) and each density, mc_sparse's selection is made
as the engine makes it (engine/policy_mc_sparse.py: the dense call's LSE, "pca" query groups of 128, pass 2 over the
engine's chunks of heads, keep_top per group, compact_keep) and reports:

(a) over the groups of every head: the share of rows whose uncapped count (keep_top's sampled threshold) exceeds
    keep_bound(k, L), the largest count / k, percentiles of count / k, and the capped rows' largest count;
(b) per anchor (the sum over the chunks of heads of each one's median): ``keep_at_threshold`` at the sampled threshold
    without and with the cap, ``keep_top`` without and with it, and ``keep_at_threshold`` with the cap and a
    threshold of 0 (every row over its cap: the bisection's worst case);
(c) the whole selection after the grouping (``build_mc_sparse(..., groups=...)``, with the cap: the engine's way,
    the lists keep_bound wide; ``cap=False``: main's way before it, the width read back once per chunk of heads),
    alternated, and the lists' widths.

Times: CUDA events, the median of ``--reps`` calls after a warm-up call (on the CPU: wall time). Output:
DIR/threshold_cap.json and DIR/threshold_cap.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from pathlib import Path

import torch
from _pack import load
from engine import timed

log = logging.getLogger("bench.threshold_cap")

WAN14B = dict(heads=40, grid=(21, 45, 80), dim=128)  # Wan 2.1 14B 720p: 21 x 45 x 80 = 75 600 latent tokens
DRY = dict(heads=1, grid=(5, 64, 64), dim=32)  # 20 480 tokens: above 4 x SAMPLE, so keep_top's long-row path


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def median_ms(fn, reps: int, device) -> float:
    """Median ms of ``reps`` calls of ``fn`` after one warm-up call: CUDA events on CUDA (bench/engine.py's
    ``timed``), wall time elsewhere."""
    if torch.device(device).type == "cuda":
        return timed(fn, reps)
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def positional_signal(grid, heads: int, dim: int, strength: float, gen, device) -> torch.Tensor:
    """fp32 (heads, N, dim), N = frames * rows * cols in raster order: random Fourier features of each token's
    (frame, row, col), unit norm, times sqrt(strength * sqrt(dim)), so that the signal's share of q.k / sqrt(dim)
    between two tokens is about ``strength`` times a Gaussian kernel of their distance (length scale per head,
    log-uniform in [2, 16] latent cells)."""
    f, h, w = grid
    axes = [torch.arange(x, device=device, dtype=torch.float32) for x in (f, h, w)]
    coords = torch.stack(torch.meshgrid(*axes, indexing="ij"), -1).view(-1, 3)  # (N, 3)
    scale = torch.exp(torch.empty(heads, device=device).uniform_(math.log(2.0), math.log(16.0), generator=gen))
    freqs = torch.randn(heads, 3, dim // 2, device=device, generator=gen) / scale.view(heads, 1, 1)
    phase = coords @ freqs  # (heads, N, dim / 2)
    feat = torch.cat([torch.cos(phase), torch.sin(phase)], -1) * math.sqrt(2.0 / dim)
    return feat * math.sqrt(strength * math.sqrt(dim))


def make_qk(kind: str, grid, heads: int, dim: int, locality: float, dtype, device, seed: int = 0):
    """q, k, v of ``dtype`` (1, heads, N, dim): N(0, 1), plus for ``local`` the same positional signal in q and k."""
    gen = torch.Generator(device=device).manual_seed(seed)
    n = grid[0] * grid[1] * grid[2]
    q, k, v = (torch.randn(1, heads, n, dim, device=device, generator=gen) for _ in range(3))
    if kind == "local":
        sig = positional_signal(grid, heads, dim, locality, gen, device).unsqueeze(0)
        q, k = q + sig, k + sig
        del sig
    elif kind != "random":
        raise ValueError(f"unknown q/k kind {kind!r} (random, local)")
    return q.to(dtype), k.to(dtype), v.to(dtype)


def quantiles(x: torch.Tensor, ps=(0.01, 0.5, 0.99, 0.999)) -> dict:
    x = x.double().flatten().cpu()
    return {f"p{100 * p:g}": float(torch.quantile(x, p)) for p in ps}


def kernel_calls(mass: torch.Tensor, budget: int, bound: int, backend: str) -> dict:
    """The calls (b) times on one chunk's group mass, fp32 (B, h, G, L): {name: fn()}. The threshold is keep_top's own
    (block_geometry.keep_top: the ``_sample_rank``-th largest of SAMPLE strided columns)."""
    kernels = load("kernels")
    geo = load("engine.block_geometry")
    length = mass.shape[-1]
    step = length / geo.SAMPLE
    cols = (torch.arange(geo.SAMPLE, device=mass.device, dtype=torch.float64) * step + step / 2).long()
    thresh = torch.topk(mass[..., cols], geo._sample_rank(budget, length), dim=-1).values[..., -1:]
    zero = torch.zeros_like(thresh)  # every row over its cap: the bisection's worst case
    return {
        "keep_at_threshold": lambda: kernels.keep_at_threshold(mass, thresh, budget, backend=backend),
        "keep_at_threshold_capped": lambda: kernels.keep_at_threshold(mass, thresh, budget, cap=bound,
                                                                      backend=backend),
        "keep_top": lambda: geo.keep_top(mass, budget, backend=backend, cap=False),
        "keep_top_capped": lambda: geo.keep_top(mass, budget, backend=backend),
        "keep_at_threshold_capped_all_over": lambda: kernels.keep_at_threshold(mass, zero, budget, cap=bound,
                                                                               backend=backend),
    }


def measure(kind: str, q, k, v, layout, densities, reps: int, backend: str) -> list[dict]:
    """The rows of one kind of q/k: one per density (see the module's docstring)."""
    engine = load("engine")
    kernels = load("kernels")
    geo = load("engine.block_geometry")
    mc = load("engine.policy_mc_sparse")
    dev = q.device
    b, h, n, _ = q.shape
    lse = kernels.attention_dense(q, k, v, return_lse=True, backend=backend)[1]
    # the query groups (the same at every density): McSparsePolicy.prepare's, as the engine makes them
    cfg = engine.SparseConfig(method="mc_sparse", density=densities[0], min_tokens=0, backend=backend)
    t0 = time.perf_counter()
    groups = mc.McSparsePolicy().prepare(q, layout, cfg, backend=backend).groups()
    sync(dev)
    grouping_s = time.perf_counter() - t0  # the first call: Triton compiles and tunes included
    g_all = next(iter(groups.values())).expand(b, h, -1, -1).contiguous()
    g = g_all.shape[2]
    rows = []
    for density in densities:
        cfg = engine.SparseConfig(method="mc_sparse", density=density, min_tokens=0, backend=backend)
        spans, dens, sparse = mc.sparse_spans(n, layout, cfg)
        if len(spans) != 1 or sparse != [0] or len(groups) != 1:
            raise ValueError("the bench takes one video segment (no text tokens)")
        length = spans[0].length
        budget = max(1, round(dens[0][0] * length))
        bound = geo.keep_bound(budget, length)
        ranking = mc.ranking_queries(g_all, cfg)
        step = max(1, mc.MASS_CHUNK_BYTES // max(1, g * n * 4))  # build_mc_sparse's chunks of heads
        counts, capped_max, times = [], 0, {}
        for h0 in range(0, h, step):
            sl = slice(h0, h0 + step)
            mass = kernels.group_kv_mass(q[:, sl], k[:, sl], lse[:, sl], ranking[:, sl], scale=None,
                                         backend=backend, validate=False)
            counts.append(geo.keep_top(mass, budget, backend=backend, cap=False).sum(-1).flatten())
            capped_max = max(capped_max, int(geo.keep_top(mass, budget, backend=backend).sum(-1).max()))
            for name, fn in kernel_calls(mass, budget, bound, backend).items():
                times[name] = times.get(name, 0.0) + median_ms(fn, reps, dev)
            del mass
        counts = torch.cat(counts).double()
        ratio = counts / budget
        sel_ms: dict[str, list[float]] = {"capped": [], "uncapped": []}
        widths = {}
        for r in range(reps + 1):  # alternated (the first round is the warm-up), the order swapped each round
            order = ("capped", "uncapped") if r % 2 else ("uncapped", "capped")
            for name in order:
                sync(dev)
                t0 = time.perf_counter()
                sel = mc.build_mc_sparse(q, k, lse, layout, cfg, backend=backend, groups=groups,
                                         cap=name == "capped")
                sync(dev)
                if r:
                    sel_ms[name].append((time.perf_counter() - t0) * 1e3)
                widths[name] = int(sel.kv_low.shape[-1])
                if name == "capped":
                    assert int(sel.kv_counts.max()) <= bound, "a capped list is wider than keep_bound"
                del sel
        row = dict(data=kind, density=density, tokens=n, heads=h, groups=g, k=budget, bound=bound,
                   bound_over_k=bound / budget, rows=int(counts.numel()), chunks=-(-h // step),
                   over_cap_share=float((counts > bound).double().mean()), max_count_over_k=float(ratio.max()),
                   min_count_over_k=float(ratio.min()), count_over_k=quantiles(ratio),
                   under_k_share=float((counts < budget).double().mean()), capped_max_count=capped_max,
                   ms=times, grouping_s=grouping_s,
                   selection_ms={name: sorted(v)[len(v) // 2] for name, v in sel_ms.items()},
                   list_width=widths)
        assert capped_max <= bound, "keep_top kept more than keep_bound"
        log.info("%s d %.2f: k %d bound %d (%.3f k); %.4f %% of %d rows over it, largest %.3f k; "
                 "keep_at_threshold %.2f / capped %.2f ms, keep_top %.2f / %.2f ms, all over %.2f ms; "
                 "selection %.1f / capped %.1f ms", kind, density, budget, bound, bound / budget,
                 100 * row["over_cap_share"], row["rows"], row["max_count_over_k"], times["keep_at_threshold"],
                 times["keep_at_threshold_capped"], times["keep_top"], times["keep_top_capped"],
                 times["keep_at_threshold_capped_all_over"], row["selection_ms"]["uncapped"],
                 row["selection_ms"]["capped"])
        rows.append(row)
    return rows


def markdown(doc: dict) -> str:
    head = (f"# keep_top's cap at {doc['config']['heads']} heads x {doc['config']['tokens']} tokens, D "
            f"{doc['config']['dim']}, {doc['config']['dtype']}, groups of 128 ({doc['device']}, torch "
            f"{doc['torch']})\n\nms per anchor (each kernel: the sum over the chunks of heads of its median); "
            "selection: build_mc_sparse after the grouping, uncapped (width read back) / capped.\n\n")
    cols = ["data", "d", "k", "bound / k", "rows over cap", "max count / k", "p99.9 count / k",
            "keep_at_threshold ms", "capped ms", "keep_top ms", "capped ms", "all rows over cap ms",
            "selection ms", "capped ms", "width", "capped width"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in doc["rows"]:
        ms = r["ms"]
        lines.append("| " + " | ".join([
            r["data"], f"{r['density']:g}", str(r["k"]), f"{r['bound_over_k']:.3f}",
            f"{100 * r['over_cap_share']:.3f} %",
            f"{r['max_count_over_k']:.3f}", f"{r['count_over_k']['p99.9']:.3f}", f"{ms['keep_at_threshold']:.2f}",
            f"{ms['keep_at_threshold_capped']:.2f}", f"{ms['keep_top']:.2f}", f"{ms['keep_top_capped']:.2f}",
            f"{ms['keep_at_threshold_capped_all_over']:.2f}", f"{r['selection_ms']['uncapped']:.1f}",
            f"{r['selection_ms']['capped']:.1f}", str(r["list_width"]["uncapped"]),
            str(r["list_width"]["capped"])]) + " |")
    return head + "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for threshold_cap.json and threshold_cap.md")
    ap.add_argument("--dry", action="store_true", help="CPU, 1 head x 20 480 tokens, D 32, fp32, 1 rep")
    ap.add_argument("--densities", default="0.1,0.05,0.15")
    ap.add_argument("--data", default="random,local", help="q/k kinds: random, local")
    ap.add_argument("--locality", type=float, default=6.0, help="the positional signal's logit at distance 0")
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--grid", default=None, help="frames,rows,cols (default 21,45,80; --dry 5,64,64)")
    ap.add_argument("--dim", type=int, default=None)
    ap.add_argument("--reps", type=int, default=None, help="timed calls per median (default 10; --dry 1)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    shape = dict(DRY if args.dry else WAN14B)
    if args.heads:
        shape["heads"] = args.heads
    if args.grid:
        shape["grid"] = tuple(int(x) for x in args.grid.split(","))
    if args.dim:
        shape["dim"] = args.dim
    if args.dry:
        device, dtype, backend = "cpu", torch.float32, "torch"
    else:
        if not torch.cuda.is_available():
            raise SystemExit("CUDA is not available: run with --dry for the CPU path")
        device, dtype, backend = "cuda", torch.bfloat16, "auto"
    reps = args.reps or (1 if args.dry else 10)
    engine = load("engine")
    layout = engine.TokenLayout(grid=shape["grid"])
    n = shape["grid"][0] * shape["grid"][1] * shape["grid"][2]
    densities = [float(x) for x in args.densities.split(",")]
    doc = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu", torch=torch.__version__,
               config=dict(shape, tokens=n, dtype=str(dtype).replace("torch.", ""), backend=backend, reps=reps,
                           locality=args.locality, densities=densities), rows=[])
    with torch.inference_mode():
        for kind in args.data.split(","):
            q, k, v = make_qk(kind, shape["grid"], shape["heads"], shape["dim"], args.locality, dtype, device)
            doc["rows"] += measure(kind, q, k, v, layout, densities, reps, backend)
            del q, k, v
            if device == "cuda":
                torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "threshold_cap.json").write_text(json.dumps(doc, indent=1))
    (out / "threshold_cap.md").write_text(markdown(doc))
    log.info("wrote %s and %s", out / "threshold_cap.json", out / "threshold_cap.md")
    return doc


if __name__ == "__main__":
    main()
