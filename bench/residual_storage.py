"""What storing the cached residual more compactly adds to a reuse step's error, measured on recorded attention inputs
(docs/decisions.md, "Residuals at 4 bits"). For every recorded layer, the engine runs the recorded steps in order
(anchors where the schedule says, reuse calls between) with the residual stored each way, and each reuse call's
output is compared with exact attention of the same inputs.

    python ../shared/quality/evaluate.py --out DIR --seeds 8 --dump DIR/qkv.safetensors --dump-layers 0,1,2,3,4,5,6,7 \\
        --dump-steps 0,3,6,10 --dump-max-mb 1000 --dump-only --batch 1 --device cpu
    python bench/residual_storage.py DIR/qkv.safetensors --grid 16,32,32 --anchors 0,6 --out OUT \\
        [--method block_topk --density 0.08 --size 64 --weighting mass] [--densities 0.07,0.09]

The recording holds ``layerLL.stepSS.q|k|v`` tensors (H, N, D) (the testbed's --dump). Storage variants: ``fp8`` (the
default), ``int4`` (engine/residual.py's packing), ``int4-g32`` (4 bits with a scale per 32 values: what a finer
scale would buy), ``pool-col2`` / ``pool-2x2`` (the residual averaged over 2 neighbouring columns / 2x2 tokens of the
latent grid and spread back: does it vary slowly enough to keep at a lower resolution?) and ``none`` (no residual).
``--densities`` adds fp8 rows at other densities, to read the variants' error as a density change. Writes
OUT/residual_storage.json and prints the table: per variant the mean over layers of the squared relative error of
each reuse step, and per layer at the last one.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from _pack import load

VARIANTS = ("fp8", "int4", "int4-g32", "pool-col2", "pool-2x2", "none")


def say(msg: str) -> None:
    print(f"[residual] {msg}", flush=True)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def quant_groups(x, group: int):
    """x (B, H, N, D) fp32 -> symmetric 4 bits (levels -7..7) with a scale per ``group`` values along D, decoded."""
    import torch
    b, h, n, d = x.shape
    g = x.reshape(b, h, n, d // group, group)
    s = g.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 7
    return (torch.round(g / s).clamp(-7, 7) * s).reshape(b, h, n, d)


def pooled(x, grid, fr: int, rr: int, cr: int):
    """x (B, H, F*Hh*W, D) in raster order -> each (fr x rr x cr) cell of the grid replaced by its mean."""
    b, h, n, d = x.shape
    f, hh, w = grid
    y = x.reshape(b, h, f // fr, fr, hh // rr, rr, w // cr, cr, d)
    return y.mean(dim=(3, 5, 7), keepdim=True).expand_as(y).reshape(b, h, n, d)


def transform(variant: str, grid):
    """None (store as the engine does) or fn(decoded residual fp32 (B, H, N, D)) -> what the variant keeps."""
    return {"fp8": None, "int4": None, "none": None,
            "int4-g32": lambda x: quant_groups(x, 32),
            "pool-col2": lambda x: pooled(x, grid, 1, 1, 2),
            "pool-2x2": lambda x: pooled(x, grid, 1, 2, 2)}[variant]


def recorded(tensors: dict) -> tuple[list[int], list[int]]:
    """(layers, steps) present in a --dump recording, each sorted."""
    found = [re.fullmatch(r"layer(\d+)\.step(\d+)\.q", k) for k in tensors]
    pairs = {(int(m[1]), int(m[2])) for m in found if m}
    return sorted({lay for lay, _ in pairs}), sorted({s for _, s in pairs})


def run_layer(eng_mod, residual_mod, tensors, layer, steps, total, grid, config: dict, variant: str) -> dict:
    """{step: relative L2 error of the reuse output against exact attention} for one layer over the recorded steps."""
    import torch
    cfg = eng_mod.SparseConfig.from_dict({**config, "residual_precision": "int4" if variant == "int4" else "fp8"},
                                         source="residual storage")
    eng = eng_mod.SparseEngine(cfg)
    fn, store = transform(variant, grid), eng.cache_entry
    Residual = residual_mod.Residual

    def cache_entry(key, selection, residual, fidelity, ctx):  # the variant's residual, as the reuse calls read it
        if residual is not None and variant == "none":  # zeros, not None: a layer without residual would run dense
            residual = Residual(torch.zeros(residual.shape, dtype=torch.float32), None, None)
        elif residual is not None and fn is not None:
            residual = Residual(fn(residual.decode(torch.float32)), None, residual.mass)
        return store(key, selection, residual, fidelity, ctx)

    eng.cache_entry = cache_entry
    eng.begin_run()
    errs = {}
    try:
        for s in steps:
            q, k, v = (tensors[f"layer{layer:02d}.step{s:02d}.{n}"].float()[None] for n in "qkv")
            ctx = eng_mod.CallContext(layer=layer, step=s, total_steps=total, chunk=(0,),
                                      layout=eng_mod.TokenLayout(grid=tuple(grid)))
            decision = eng.decide(ctx, q.shape[2])
            out = eng.attend(q, k, v, ctx)
            if decision == "reuse":
                exact = torch.nn.functional.scaled_dot_product_attention(q, k, v)
                errs[s] = float(torch.linalg.vector_norm(out - exact) / torch.linalg.vector_norm(exact))
    finally:
        eng.end_run()
    return errs


def run(args) -> dict:
    from safetensors.torch import load_file
    eng_mod, residual_mod = load("engine"), load("engine.residual")
    tensors = load_file(args.recording)
    layers, steps = recorded(tensors)
    if not layers:
        raise SystemExit(f"{args.recording}: no layerLL.stepSS.q tensors (record with the testbed's --dump)")
    grid = ints(args.grid)
    config = dict(method=args.method, density=args.density, block_q=args.size, block_k=args.size,
                  group_size=args.size, warmup_steps=0, anchor_steps=ints(args.anchors), residual=True, min_tokens=0,
                  residual_weighting=args.weighting, backend="torch")
    rows = [(v, args.density) for v in args.variants.split(",")] + [("fp8", float(d)) for d in
                                                                      args.densities.split(",") if d.strip()]
    unknown = [v for v, _ in rows if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    doc = {"meta": {"recording": str(args.recording), "layers": layers, "steps": steps, "grid": grid,
                    "total_steps": args.total_steps, "config": config,
                    "command": "python bench/residual_storage.py " + " ".join(sys.argv[1:])}, "rows": []}
    for variant, density in rows:
        t = time.perf_counter()
        per_layer = {lay: run_layer(eng_mod, residual_mod, tensors, lay, steps, args.total_steps, grid,
                                    {**config, "density": density}, variant) for lay in layers}
        reuse_steps = sorted({s for e in per_layer.values() for s in e})
        mean_sq = {s: sum(per_layer[lay][s] ** 2 for lay in layers) / len(layers) for s in reuse_steps}
        doc["rows"].append({"variant": variant, "density": density, "mean_sq_rel_err": mean_sq,
                            "per_layer": {lay: per_layer[lay] for lay in layers},
                            "seconds": round(time.perf_counter() - t, 1)})
        say(f"{variant} at {density}: " + ", ".join(f"step {s} {e:.3e}" for s, e in mean_sq.items())
            + f" ({time.perf_counter() - t:.0f} s)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "residual_storage.json").write_text(json.dumps(doc, indent=1))
    say(table(doc))
    return doc


def table(doc: dict) -> str:
    """Markdown: mean squared relative error per reuse step, per variant (and the fp8 row's ratio)."""
    rows = doc["rows"]
    steps = list(rows[0]["mean_sq_rel_err"]) if rows else []
    base = next((r for r in rows if r["variant"] == "fp8" and r["density"] == doc["meta"]["config"]["density"]), None)
    head = "| storage | density | " + " | ".join(f"reuse step {s}: mean sq. rel. error (× fp8)" for s in steps) + " |"
    lines = [head, "|" + "---|" * (2 + len(steps))]
    for r in rows:
        cells = []
        for s in steps:
            e = r["mean_sq_rel_err"][s]
            ratio = f" ({e / base['mean_sq_rel_err'][s]:.2f}×)" if base else ""
            cells.append(f"{e:.3e}{ratio}")
        lines.append(f"| {r['variant']} | {r['density']:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recording", help="safetensors of layerLL.stepSS.q|k|v (H, N, D): the testbed's --dump")
    ap.add_argument("--out", required=True)
    ap.add_argument("--grid", default="16,32,32", help="F,H,W of the recorded tokens (raster order)")
    ap.add_argument("--anchors", default="0,6", help="anchor steps (the presets' 0, 20 %% of 30 steps)")
    ap.add_argument("--total-steps", type=int, default=30)
    ap.add_argument("--method", default="block_topk")
    ap.add_argument("--density", type=float, default=0.08)
    ap.add_argument("--size", type=int, default=64, help="blocks (block_topk) and query groups (mc_sparse)")
    ap.add_argument("--weighting", default="mass", help="residual_weighting (the presets' GPU runs weight by mass)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--densities", default="", help="extra fp8 rows at these densities")
    run(ap.parse_args(argv))


if __name__ == "__main__":
    main()
