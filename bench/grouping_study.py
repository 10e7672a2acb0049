"""mc_sparse query groupings compared on recorded attention inputs (any device; docs/kernel_notes.md, "v20").

First record q/k/v of the quality testbed (one video, every layer, three steps; ~14 min on 2 CPU threads):
    python ../shared/quality/evaluate.py --out DIR --seeds 0 --batch 1 --alts dense --png-alts "" \
        --dump DIR/qkv.safetensors --dump-layers 0,1,2,3,4,5,6,7 --dump-steps 2,10,20 --dump-max-mb 700
    python bench/grouping_study.py DIR/qkv.safetensors [--variants pca,pca_r32,pca_r16,cuboid] [--density 0.1]
        [--group-size 64] [--grid 16,32,32] [--anchor 10 --later 20] [--threads 2] [--out FILE.json]

For each variant and recorded layer: the mc_sparse selection (the engine's own policy, PyTorch backend, pass 2 on
``mass_queries`` of each group as configured) at every recorded step, and

- fresh: relative L2 error of the sparse output against dense attention at that step (no residual);
- reuse: the selection and residual (dense − sparse) of step ``--anchor`` applied at step ``--later``, what a reuse
  step returns, against dense attention there (cuboid groups lose 3–4 dB on the testbed's videos and show it
  here: docs/kernel_notes.md, "v20");
- the grouping's own time on one layer's queries (best of 5).

Variants: "pca" (the product's grouping), "pca_rR" (the same median splits on each head's queries projected on
their R leading directions, eigenvectors of a subsample's covariance: the first experiment), "dimsR" (the engine's
``grouping_dims`` R: the same with the directions from subspace iteration), "cuboid".
Recording format: the testbed's ``--dump`` file (fp16, keys "layerLL.stepSS.q|k|v", each (H, N, D)).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import time
from pathlib import Path

import torch
from _pack import load
from safetensors.torch import load_file

log = logging.getLogger("bench.grouping_study")


def leading_direction_grouping(group_queries, r: int):
    """group_queries on each head's queries projected on their r leading principal directions: q (B, H, N, D) ->
    int32 (B, H, ceil(N / c), c) as ``group_queries``. The directions come from the eigenvectors of the covariance
    of an even subsample of about 4 096 queries per head; every later level of the partition then reads r values
    per query instead of D."""
    def grouped(q, c, dims=0, backend="auto"):  # the policy passes its grouping_dims (0 for these variants)
        x = q.float()
        sub = x[:, :, ::max(1, x.shape[2] // 4096)]
        mean = sub.mean(2, keepdim=True)
        centred = sub - mean
        basis = torch.linalg.eigh(centred.transpose(-1, -2) @ centred)[1][..., -r:]  # (B, H, D, r), ascending
        return group_queries(((x - mean) @ basis).contiguous(), c, backend="torch")
    return grouped


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recording")
    ap.add_argument("--variants", default="pca,pca_r32,pca_r16,cuboid")
    ap.add_argument("--density", type=float, default=0.1)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--grid", default="16,32,32", help="frames,rows,cols of the recorded tokens")
    ap.add_argument("--anchor", type=int, default=10)
    ap.add_argument("--later", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = load("kernels")
    eng = load("engine")
    policy = load("engine.policy_mc_sparse")
    tensors = load_file(args.recording)
    layers = sorted({int(k[5:7]) for k in tensors})
    steps = sorted({int(k[12:14]) for k in tensors})
    if args.anchor not in steps or args.later not in steps:
        ap.error(f"--anchor {args.anchor} and --later {args.later} must be recorded steps ({steps})")
    layout = eng.TokenLayout(grid=tuple(int(x) for x in args.grid.split(",")))
    product = kernels.group_queries
    results = {}
    for name in args.variants.split(","):
        if name.startswith("dims") and name[4:].isdigit():  # the engine's own grouping_dims (cfg below)
            grouping = functools.partial(product, dims=int(name[4:]))
        elif name.startswith("pca_r") and name[5:].isdigit():
            grouping = leading_direction_grouping(product, int(name[5:]))
        elif name in ("pca", "cuboid"):
            grouping = product
        else:
            ap.error(f"unknown variant {name!r}")
        cfg = eng.SparseConfig(method="mc_sparse", density=args.density, group_size=args.group_size, backend="torch",
                               grouping="cuboid" if name == "cuboid" else "pca",
                               grouping_dims=int(name[4:]) if name.startswith("dims") else 0)
        kernels.group_queries = grouping  # the policy calls kernels.group_queries
        try:
            fresh, reuse = [], []
            for layer in layers:
                qkv = {s: [tensors[f"layer{layer:02d}.step{s:02d}.{x}"].float()[None] for x in "qkv"] for s in steps}
                dense = {s: kernels.attention_dense(*qkv[s], return_lse=True, backend="torch") for s in steps}
                for s in steps:
                    sel = policy.build_mc_sparse(qkv[s][0], qkv[s][1], dense[s][1], layout, cfg, backend="torch")
                    out = sel.run(*qkv[s])
                    fresh.append(float((out - dense[s][0]).norm() / dense[s][0].norm()))
                    if s == args.anchor:
                        later = sel.run(*qkv[args.later]) + (dense[s][0] - out)
                        ref = dense[args.later][0]
                        reuse.append(float((later - ref).norm() / ref.norm()))
        finally:
            kernels.group_queries = product
        q = tensors[f"layer{layers[0]:02d}.step{args.anchor:02d}.q"].float()[None]
        ms = None
        if name != "cuboid":
            grouping(q, args.group_size, backend="torch")
            ms = 1e9
            for _ in range(5):
                t0 = time.perf_counter()
                grouping(q, args.group_size, backend="torch")
                ms = min(ms, (time.perf_counter() - t0) * 1000)
        results[name] = dict(fresh=sum(fresh) / len(fresh), reuse=sum(reuse) / len(reuse), grouping_ms=ms,
                             reuse_per_layer=reuse)
        log.info("%-8s fresh %.4f  reuse %.4f  grouping %s", name, results[name]["fresh"], results[name]["reuse"],
                 "-" if ms is None else f"{ms:.1f} ms")
    if args.out:
        args.out.write_text(json.dumps(dict(recording=args.recording, density=args.density,
                                            group_size=args.group_size, layers=layers, steps=steps,
                                            anchor=args.anchor, later=args.later, threads=torch.get_num_threads(),
                                            torch=torch.__version__, results=results), indent=1))


if __name__ == "__main__":
    main()
