"""PyTorch-backend benchmark: every primitive with ``backend="torch"`` against dense SDPA on one device.

Usage:
    python bench/torch_backend.py [--out DIR]                  # CPU: 4 heads x 8 192 tokens, D 64 and 128
    python bench/torch_backend.py --device cuda --out DIR      # CUDA: against cuDNN's fused attention
Options: --tokens N, --heads H, --head-dims 64,128, --densities 0.15,0.25,0.1, --dtype fp32|bf16|fp16,
--reps R, --threads T, --sweep-gather 26,27,28. Prints a table and writes DIR/torch_backend_<device>.json and .md.

Times: the minimum over ``--reps`` runs after one warm-up (CPU: the machine may be shared, the minimum is
the uncontended time), CUDA events on GPU; dense SDPA runs again after every primitive and the minimum
over all its runs is the reference. ``speedup`` = dense SDPA time / primitive time; ``x d`` =
speedup times the density kept (1.00 = the ideal 1/d). Sparse lists: random distinct sorted KV blocks
(or tokens) per query block (or group of 128 queries), equal counts per row ("balanced"), or 10 % of the
query blocks dense and the rest sized to keep the density ("skew").
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _pack import load

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# targets of the PyTorch backend (benchmarks, not tests): speedup x density at d = 0.15
TARGETS = {("cpu", "block"): 0.6, ("cpu", "token"): 0.4, ("cuda", "block"): 0.5, ("cuda", "token"): 0.5}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def timer(dev: torch.device, reps: int, warm: bool = True):
    def run(fn) -> float:
        if warm:
            fn()  # warm-up (and CUDA lazy init)
        times = []
        for _ in range(reps):
            if dev.type == "cuda":
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return min(times)
    return run


def dense_reference(dev: torch.device, q):
    """Dense SDPA as the device runs it best: cuDNN's fused attention on CUDA (else the default SDPA)."""
    if dev.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def run(q, k, v):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(q, k, v)
        try:
            run(q, q, q)
            return run, "cuDNN SDPA"
        except RuntimeError as exc:
            logging.warning("cuDNN attention refused (%s); the reference is the default SDPA", exc)
    return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v)), "SDPA"


def block_lists(h, nqb, nkb, density, skewed, gen, dev):
    """int32 (1, H, nqb, max_k) sorted distinct random blocks and counts (1, H, nqb), built on ``dev``."""
    count = max(1, round(density * nkb))
    k = torch.full((1, h, nqb), count, dtype=torch.long, device=dev)
    if skewed:
        dense_rows = torch.rand(1, h, nqb, generator=gen, device=dev) < 0.1
        rest = max(1, round((density - 0.1) / 0.9 * nkb)) if density > 0.1 else 1
        k = torch.where(dense_rows, torch.full_like(k, nkb), torch.full_like(k, rest))
    order = torch.argsort(torch.rand(1, h, nqb, nkb, generator=gen, device=dev), dim=-1)
    chosen = torch.where(torch.arange(nkb, device=dev) < k.unsqueeze(-1), order, torch.full_like(order, nkb))
    idx = torch.sort(chosen, dim=-1).values[..., :int(k.max())]
    idx = torch.where(idx == nkb, torch.full_like(idx, -1), idx)
    return idx.to(torch.int32).contiguous(), k.to(torch.int32).contiguous()


def token_lists(h, g, n, density, gen, dev):
    """int32 (1, H, G, count) sorted distinct random tokens per group and counts (1, H, G), built on ``dev``."""
    count = max(1, round(density * n))
    toks = torch.empty((1, h, g, count), dtype=torch.int32, device=dev)
    for hi in range(h):  # one head at a time: the random keys of all heads at once would take H*G*N floats
        keys = torch.rand(g, n, generator=gen, device=dev)
        toks[0, hi] = torch.sort(torch.topk(keys, count, dim=-1, sorted=False).indices, dim=-1).values.to(torch.int32)
    return toks, torch.full((1, h, g), count, dtype=torch.int32, device=dev)


def run_shape(K, dev, dtype, h, n, d, densities, reps, rows, log, sweep=()):
    gen = torch.Generator(device=dev).manual_seed(n + d)
    q, k, v = (torch.randn(1, h, n, d, generator=gen, device=dev).to(dtype) for _ in range(3))
    t = timer(dev, reps)
    ref, ref_name = dense_reference(dev, q)
    dense = [t(lambda: ref(q, k, v))]
    mine: list[dict] = []

    def add(prim, density, ms, kind=None):
        # one more dense run after each primitive: on a shared machine the minimum over all of them is
        # the uncontended dense time the speedups are taken against
        dense.append(timer(dev, 1, warm=False)(lambda: ref(q, k, v)))
        row = dict(device=dev.type, dtype=str(dtype).replace("torch.", ""), heads=h, tokens=n, head_dim=d,
                   primitive=prim, density=density, ms=ms, dense=ref_name,
                   target_x_d=TARGETS.get((dev.type, kind)) if kind and abs(density - 0.15) < 0.02 else None)
        mine.append(row)
        log(row)

    add("dense (ours, torch)", 1.0, t(lambda: K.attention_dense(q, k, v, backend="torch")))
    add("dense + LSE (ours, torch)", 1.0, t(lambda: K.attention_dense(q, k, v, return_lse=True, backend="torch")))
    bs = 128
    nb = -(-n // bs)
    for dens in densities:
        for skew in (False, True) if abs(dens - 0.15) < 0.02 else (False,):
            idx, cnt = block_lists(h, nb, nb, dens, skew, gen, dev)
            kept = float(cnt.double().sum()) / (h * nb * nb)
            add(f"block-sparse 128{' skew' if skew else ''}", kept,
                t(lambda: K.block_sparse_attention(q, k, v, idx, cnt, block_q=bs, block_k=bs, backend="torch",
                                                   validate=False)), "block")
    if sweep:  # the gathered K+V per chunk (GATHER_ELEMS), tried for block-sparse at the first density
        core = load("kernels._torch_softmax")
        default = core.GATHER_ELEMS.get(dev.type)
        idx, cnt = block_lists(h, nb, nb, densities[0], False, gen, dev)
        kept = float(cnt.double().sum()) / (h * nb * nb)
        for e in sweep:
            core.GATHER_ELEMS[dev.type] = 1 << e
            add(f"block-sparse 128 gather 2^{e}", kept,
                t(lambda: K.block_sparse_attention(q, k, v, idx, cnt, block_q=bs, block_k=bs, backend="torch",
                                                   validate=False)), "block")
        if default is None:
            core.GATHER_ELEMS.pop(dev.type, None)
        else:
            core.GATHER_ELEMS[dev.type] = default
    c = 128
    g = -(-n // c)
    groups = torch.cat([torch.randperm(n, generator=gen, device=dev),
                        torch.full((g * c - n,), -1, dtype=torch.long, device=dev)])
    groups = groups.view(1, 1, g, c).expand(1, h, g, c).to(torch.int32).contiguous()
    for dens in densities:
        toks, tcnt = token_lists(h, g, n, dens, gen, dev)
        add("token-sparse C=128", float(tcnt[0, 0, 0]) / n,
            t(lambda: K.token_sparse_attention(q, k, v, groups, toks, tcnt, backend="torch", validate=False)),
            "token")
    _, lse = K.attention_dense(q, k, v, return_lse=True, backend="torch")
    add("group KV mass C=128", 1.0, t(lambda: K.group_kv_mass(q, k, lse, groups, backend="torch", validate=False)))
    sub = groups[..., ::8].contiguous()  # mc_sparse's mass_queries 16: pass 2 on 16 of each group's 128 queries
    add("group KV mass, 16 of C=128", 1.0, t(lambda: K.group_kv_mass(q, k, lse, sub, backend="torch",
                                                                      validate=False)))
    mc = load("engine.policy_mc_sparse")
    eng = load("engine")
    # the whole mc_sparse selection (grouping, pass 2, top-k, compaction) at d 0.15: pass 2 on every query or on 16,
    # the grouping on every coordinate or on 16 leading directions (the defaults: 16 and 16)
    for mq, dims in ((0, 0), (16, 0), (16, 16)):
        cfg = eng.SparseConfig(method="mc_sparse", density=0.15, group_size=c, mass_queries=mq, grouping_dims=dims,
                               backend="torch")
        add(f"mc_sparse selection C=128, mass_queries {mq}, grouping_dims {dims}", 0.15,
            t(lambda: mc.build_mc_sparse(q, k, lse, eng.TokenLayout(), cfg, backend="torch")))
    add("pooled block scores 128", 1.0, t(lambda: K.pooled_block_scores(q, k, block_q=bs, block_k=bs,
                                                                         backend="torch")))
    add("group queries C=128", 1.0, t(lambda: K.group_queries(q, c, backend="torch")))
    add("group queries C=128, 16 directions", 1.0, t(lambda: K.group_queries(q, c, dims=16, backend="torch")))
    for row in mine:
        row["dense_ms"] = min(dense)
        row["speedup"] = row["dense_ms"] / row["ms"]
        row["x_d"] = row["speedup"] * row["density"]
    rows += mine


def table(rows) -> str:
    lines = ["| dtype | H x N | D | primitive | density | ms | dense ms | speedup | x d | target x d |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sparse = r["primitive"].startswith(("block", "token"))
        xd = f"{r['x_d']:.2f}" if sparse else ""
        tgt = f"{r['target_x_d']:.1f}" if r["target_x_d"] else ""
        lines.append(f"| {r['dtype']} | {r['heads']} x {r['tokens']} | {r['head_dim']} | {r['primitive']} | "
                     f"{r['density']:.3f} | {r['ms']:.1f} | {r['dense_ms']:.1f} | {r['speedup']:.2f}x | {xd} | {tgt} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--tokens", type=int, default=None, help="default: 8192 on CPU, 32760 on CUDA")
    ap.add_argument("--heads", type=int, default=None, help="default: 4 on CPU, 12 on CUDA (24 at D = 64)")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--densities", default="0.15,0.25,0.1")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: fp32 on CPU, bf16 on CUDA")
    ap.add_argument("--reps", type=int, default=None, help="default: 3 on CPU, 10 on CUDA")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own)")
    ap.add_argument("--sweep-gather", default=None,
                    help="log2 of gathered K+V elements per chunk to try for block-sparse at the first density "
                         "(default: 26,27,28,29 on CUDA, none on CPU)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    dtype = DTYPES[args.dtype or ("bf16" if cuda else "fp32")]
    n = args.tokens or (32760 if cuda else 8192)
    reps = args.reps or (10 if cuda else 3)
    K = load("kernels")
    rows: list[dict] = []

    def log(r):
        print(f"{r['dtype']} H={r['heads']} N={r['tokens']} D={r['head_dim']} {r['primitive']:<26} "
              f"d={r['density']:.3f} {r['ms']:9.2f} ms", flush=True)

    t0 = time.perf_counter()
    for d in (int(x) for x in args.head_dims.split(",")):
        h = args.heads or ((24 if d == 64 else 12) if cuda else 4)
        sweep = args.sweep_gather if args.sweep_gather is not None else ("26,27,28,29" if cuda else "")
        run_shape(K, dev, dtype, h, n, d, [float(x) for x in args.densities.split(",")], reps, rows, log,
                  [int(x) for x in sweep.split(",") if x])
    env = dict(torch=torch.__version__, device=(torch.cuda.get_device_name(dev) if cuda else cpu_model()),
               threads=torch.get_num_threads(), seconds=time.perf_counter() - t0,
               command="python bench/torch_backend.py " + " ".join(f"--{k.replace('_', '-')} {v}"
                                                                  for k, v in vars(args).items() if v is not None))
    text = table(rows)
    print(text)
    print(json.dumps(env))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"torch_backend_{dev.type}.json").write_text(json.dumps(dict(env=env, rows=rows), indent=1))
        (args.out / f"torch_backend_{dev.type}.md").write_text(f"{json.dumps(env)}\n\n{text}\n")


if __name__ == "__main__":
    main()
