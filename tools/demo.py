"""Demo: every sparse-attention method of the engine on a synthetic video-DiT attention problem.

    python tools/demo.py            # CPU: a small problem on the PyTorch backend (about a minute)
    python tools/demo.py --size wan # CUDA: a Wan-1.3B-sized problem (32k tokens) on the Triton kernels

Runs dense attention and each method through the engine over ~20 denoising steps (2 layers) and prints,
per method: achieved density, time (of the engine calls alone, not of the synthetic Q/K/V generation),
relative L2 error versus dense at every step and overall.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def load_pack():
    """The pack's engine and synthetic-problem modules, through bench/_pack.py's loader (the repository
    imported as the package ``comfyui_sparse_attention``, as ComfyUI would)."""
    sys.path.insert(0, str(ROOT / "bench"))  # a script beside the pack, not pack code
    from _pack import load
    return load("engine"), load("engine.synthetic")


METHODS = [
    ("static", dict(method="static")),
    ("block_topk", dict(method="block_topk")),
    ("block_topk+residual", dict(method="block_topk", residual=True)),
    ("hybrid", dict(method="hybrid")),
    ("mc_sparse (no residual)", dict(method="mc_sparse", residual=False)),
    ("mc_sparse", dict(method="mc_sparse", residual=True)),
]


def run(args) -> list[dict]:
    eng, syn = load_pack()
    cuda = torch.cuda.is_available() and not args.cpu
    dev = "cuda" if cuda else "cpu"
    if args.size == "wan" and cuda:
        f, h, w = 21, 30, 52
        problem = dict(frames=f, height=h, width=w, text=256, heads=12, head_dim=128, dtype=torch.bfloat16)
    else:
        problem = dict(frames=8, height=16, width=16, text=64, heads=4, head_dim=64, dtype=torch.float32)
    layers = [syn.SyntheticVideoAttention(steps=args.steps, seed=s, device=dev, **problem) for s in range(args.layers)]
    n = layers[0].n
    logging.info("problem: %d layers x %d heads, %d tokens (%d text + %s grid), D=%d, %d steps, device %s",
                 args.layers, problem["heads"], n, problem["text"], (problem["frames"], problem["height"],
                                                                     problem["width"]), problem["head_dim"],
                 args.steps, dev)
    backend = "auto" if cuda else "torch"

    def timed(engine, q, k, v, ctx):
        """engine.attend and its wall time (the synthetic problem's own q/k/v generation is not timed)."""
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = engine.attend(q, k, v, ctx)
        if cuda:
            torch.cuda.synchronize()
        return out, time.perf_counter() - t

    dense = {}
    dense_secs = 0.0
    for li, lay in enumerate(layers):
        for s in range(args.steps):
            q, k, v = lay.qkv(s)
            dense[li, s], secs = timed(eng.SparseEngine(eng.SparseConfig(method="dense", backend=backend)), q, k, v,
                                       eng.CallContext(layer=li, step=s, layout=lay.layout))
            dense_secs += secs
    rows = [dict(method="dense", density=1.0, seconds=dense_secs, per_step=[0.0] * args.steps,
                 overall=0.0, anchor=None)]
    base = dict(density=args.density, warmup_steps=args.warmup, anchor_steps=args.anchors, min_tokens=0,
                residual=False, backend=backend, block_q=128, block_k=128 if n >= 8192 else 64,
                group_size=128 if n >= 8192 else 64)
    for label, extra in METHODS:
        cfg = eng.SparseConfig.from_dict({**base, **extra}, source=label)
        engine = eng.SparseEngine(cfg)
        if cuda:  # compile and autotune the kernels outside the timed run
            engine.begin_run()
            for s in range(min(args.steps, args.warmup + 2)):
                q, k, v = layers[0].qkv(s)
                engine.attend(q, k, v, eng.CallContext(layer=0, step=s, layout=layers[0].layout))
            engine.end_run()
        engine.begin_run()
        errs = [[] for _ in range(args.steps)]
        num = [0.0] * args.steps
        den = [0.0] * args.steps
        secs = 0.0
        for s in range(args.steps):
            for li, lay in enumerate(layers):
                q, k, v = lay.qkv(s)
                out, call_secs = timed(engine, q, k, v, eng.CallContext(layer=li, step=s, layout=lay.layout))
                secs += call_secs
                ref = dense[li, s]
                num[s] += float((out.double() - ref.double()).pow(2).sum())
                den[s] += float(ref.double().pow(2).sum())
                errs[s].append(syn.rel_l2(out, ref))
        stats = engine.end_run()
        tot = stats.totals()
        per_step = [(a / b) ** 0.5 for a, b in zip(num, den)]
        overall = (sum(num) / sum(den)) ** 0.5
        rows.append(dict(method=label, density=tot["density"], seconds=secs, per_step=per_step, overall=overall,
                         anchor=tot["fidelity_mean"], summary=stats.summary_line()))
    return rows


def table(rows, steps) -> str:
    head = "| method | density | time s | rel-L2 overall | rel-L2 per step (0..%d) |" % (steps - 1)
    lines = [head, "|---|---|---|---|---|"]
    for r in rows:
        per = " ".join(f"{e:.3f}" for e in r["per_step"])
        lines.append(f"| {r['method']} | {r['density']:.3f} | {r['seconds']:.2f} | {r['overall']:.4f} | {per} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=["small", "wan"], default="wan", help="wan: Wan 1.3B-sized (CUDA only)")
    ap.add_argument("--cpu", action="store_true", help="force the CPU / PyTorch backend")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--density", type=float, default=0.15)
    ap.add_argument("--warmup", type=int, default=3, help="dense warm-up steps")
    ap.add_argument("--anchors", default="10", help="anchor steps besides the first sparse step ('10', 'every 5')")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = run(args)
    sys.stdout.write(table(rows, args.steps) + "\n")
    for r in rows[1:]:
        sys.stdout.write(f"{r['method']}: {r['summary']}\n")


if __name__ == "__main__":
    main()
