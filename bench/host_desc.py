"""In-kernel against host-made TMA descriptors, per tiling, for the Hopper kernel's block-sparse and dense modes.

Each program of kernels/attention_hopper.py makes its two K/V descriptors in-kernel (128-byte writes and a proxy fence
each) and loads its query tile with pointer loads; at low density a program walks only ~50-100 KV tiles, so such
fixed costs are a larger share of it (block-sparse 0.90/d at d 0.5, 0.84/d at 0.08 at Wan 14B; docs/benchmarks.md).
HOST_DESC 1 passes the host's 4-D descriptors of K and V instead, 2 the query's too (docs/kernel_notes.md, "v15").
Every variant runs the same tilings, given explicitly (no autotuning), on the same random balanced block lists;
outputs are checked equal to the in-kernel variant's.

    python3 bench/host_desc.py --out DIR [--shapes wan14b,wan13b,hyv] [--densities 0.5,0.25,0.1,0.08]
Writes DIR/host_desc.json and DIR/host_desc.md (also printed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if "--dry" in sys.argv:  # the interpreter is chosen when Triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from _pack import load  # noqa: E402

import kernels as kb  # noqa: E402  (bench/kernels.py: SHAPES, block_lists)
import hopper  # noqa: E402  (timeit: median of event-timed calls; perf_counter where its DEV is the CPU)

DEV = "cpu" if "--dry" in sys.argv else "cuda"  # --dry: the script's logic under the interpreter, tiny shapes
hopper.DEV = DEV
timeit = hopper.timeit
DRY_SHAPES = {"wan14b": (2, 300, 64), "wan13b": (2, 200, 64), "hyv": (1, 260, 64)}

AH = load("kernels.attention_hopper")
TC = load("kernels._triton_common")  # head_dim_pad, cdiv
HOPPER = load("kernels._hopper")
CUDNN = load("kernels.dense_cudnn")

TILINGS = {  # name: (BLOCK_N, warps, stages, maxnreg)
    "sparse": [(64, 8, 5, None), (64, 8, 3, 128), (64, 8, 3, None), (128, 8, 3, None)],
    "dense": [(64, 8, 2, None), (64, 8, 2, 128), (64, 8, 3, None), (128, 8, 2, None)],
}


def run(q, k, v, out, mode, tiling, host, idx=None, cnt=None, lse=None):
    """One launch with an explicit tiling (kernels/attention_hopper.py ``launch_tiling``)."""
    return AH.launch_tiling(q, k, v, out, scale=q.shape[-1] ** -0.5, mode=mode, tiling=tiling, host_desc=host,
                            idx=idx, cnt=cnt, lse=lse)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="wan14b,wan13b,hyv")
    ap.add_argument("--densities", default="0.5,0.25,0.1,0.08")
    ap.add_argument("--dense", action="store_true", help="also the dense mode (+LSE) against cuDNN's")
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--tilings", type=int, default=0, help="only the first N tilings of each kind (0: all)")
    ap.add_argument("--dry", action="store_true", help="tiny shapes on the CPU under the Triton interpreter")
    a = ap.parse_args()
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    HOPPER.set_allocator(torch.device(DEV))
    t0 = time.time()
    rows, problems = [], []
    gen = torch.Generator(device=DEV).manual_seed(0)
    for shape in a.shapes.split(","):
        H, N, D = DRY_SHAPES[shape] if a.dry else kb.SHAPES[shape]
        dt = torch.float32 if a.dry else torch.bfloat16
        q, k, v = (torch.randn(1, H, N, D, device=DEV, dtype=dt, generator=gen) for _ in range(3))
        cudnn = timeit(lambda: CUDNN.attention_dense(q, k, v, scale=D ** -0.5, return_lse=False) if not a.dry
                       else torch.nn.functional.scaled_dot_product_attention(q, k, v))
        rows.append({"shape": shape, "kernel": "cuDNN dense", "d": 1.0, "ms": cudnn})
        print(f"{shape}: cuDNN dense {cudnn:.3f} ms", flush=True)
        nqb = nkb = TC.cdiv(N, 128)
        modes = [("sparse", float(x)) for x in a.densities.split(",")] + ([("dense", 1.0)] if a.dense else [])
        for kind, dens in modes:
            idx = cnt = lse = None
            if kind == "sparse":
                idx, cnt = kb.block_lists(H, nqb, nkb, dens, False, gen)
                kept = kb.kept_fraction(cnt, N, 128, 128)
            else:
                lse = torch.empty(1, H, N, device=DEV, dtype=torch.float32)
                kept = 1.0
            for tiling in TILINGS[kind][:a.tilings or None]:
                ref = None
                for host in (0, 1, 2):
                    if time.time() - t0 > a.budget_s:
                        problems.append(f"budget: skipped {shape} {kind} {dens} {tiling} host {host}")
                        continue
                    o = torch.empty_like(q)
                    mode = AH.MODE_BLOCKS if kind == "sparse" else AH.MODE_DENSE
                    if a.dry and tiling != TILINGS[kind][0]:
                        continue
                    try:
                        ms = timeit(lambda: run(q, k, v, o, mode, tiling, host, idx, cnt, lse))
                    except Exception as exc:  # a tiling or variant that does not compile is a result too
                        problems.append(f"{shape} {kind} {dens} {tiling} host {host}: {type(exc).__name__}: "
                                        f"{str(exc).splitlines()[0][:200] if str(exc) else ''}")
                        print(problems[-1], flush=True)
                        continue
                    if ref is None:
                        ref = o.clone()
                        same = True
                    else:
                        same = bool(torch.equal(o, ref))
                        if not same:
                            problems.append(f"{shape} {kind} {dens} {tiling} host {host}: output differs from "
                                            f"host 0 by {(o.float() - ref.float()).abs().max().item():.3g}")
                    per_d = cudnn / ms * kept
                    rows.append({"shape": shape, "kernel": kind, "d": dens, "kept": kept, "tiling": list(tiling),
                                 "host_desc": host, "ms": ms, "per_d": per_d, "same_as_host0": same})
                    print(f"{shape} {kind} d={dens} {tiling} host={host}: {ms:.3f} ms, {per_d:.3f}/d"
                          f"{'' if same else ' DIFFERS'}", flush=True)
        if DEV == "cuda":
            torch.cuda.empty_cache()
    meta = {"gpu": torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter)", "torch": torch.__version__,
            "triton": __import__("triton").__version__, "seconds": round(time.time() - t0, 1)}
    (out_dir / "host_desc.json").write_text(json.dumps({"meta": meta, "rows": rows, "problems": problems}, indent=1))
    lines = [f"{meta}", "", "| shape | kernel | d | tiling (BN, warps, stages, maxnreg) | in-kernel ms (/d) | "
             "host K/V ms (/d) | host Q/K/V ms (/d) |", "|---|---|---|---|---|---|---|"]
    by = {}
    for r in rows:
        if "tiling" in r:
            by.setdefault((r["shape"], r["kernel"], r["d"], tuple(r["tiling"])), {})[r["host_desc"]] = r
    for (shape, kind, dens, tiling), v in by.items():
        cells = [f"{v[x]['ms']:.2f} ({v[x]['per_d']:.3f})" if x in v else "–" for x in (0, 1, 2)]
        lines.append(f"| {shape} | {kind} | {dens} | {tiling} | " + " | ".join(cells) + " |")
    lines += ["", *problems]
    (out_dir / "host_desc.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
