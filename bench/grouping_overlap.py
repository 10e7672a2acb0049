"""Can the mc_sparse anchor's query grouping run beside its dense call? (docs/kernel_notes.md, "v23")

    python bench/grouping_overlap.py [--heads 40] [--tokens 75600] [--batch 1] [--out FILE.json]

The grouping reads only the queries, so it need not wait for the dense pass whose row LSE pass 2 needs. This times,
at Wan 2.1 14B by default (bf16, D 128, the engine's grouping: groups of 128 on 16 projected dimensions):
the dense call with its LSE alone (``kernels.attention_dense(return_lse=True)``), the grouping alone
(``kernels.group_queries``), both in order on one stream, and both at once: the grouping on a side stream of high
or of normal priority, launched after the dense call or before it, the main stream waiting for the side stream at
the end; and ``kernels.beside`` as the engine uses it (kernels/side_stream.py). Each number is bench/engine.py's
``timed``: the median of CUDA events around each call after a warm-up.
Also whether the groups made beside the dense call equal those made alone.
"""

from __future__ import annotations

import argparse
import json
import logging

import torch
from _pack import load
from engine import timed

log = logging.getLogger("bench.grouping_overlap")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=75600)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    K = load("kernels")
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(args.batch, args.heads, args.tokens, 128, device=dev, generator=g).to(torch.bfloat16)
               for _ in range(3))

    def dense():
        return K.attention_dense(q, k, v, return_lse=True)

    def group():
        return K.group_queries(q, 128, dims=16)

    want = group()
    res = {"heads": args.heads, "tokens": args.tokens, "batch": args.batch, "gpu": torch.cuda.get_device_name(),
           "torch": torch.__version__}
    res["dense_lse_ms"] = timed(dense, args.reps)
    res["grouping_ms"] = timed(group, args.reps)
    res["in_order_ms"] = timed(lambda: (dense(), group()), args.reps)
    lo, hi = torch.cuda.Stream.priority_range()  # (lowest, highest): the highest is the most negative
    res["priority_range"] = [lo, hi]
    same = True
    for prio_name, prio in (("high", hi), ("normal", 0)):
        side = torch.cuda.Stream(device=dev, priority=prio)
        for first in ("dense", "grouping"):
            out = {}

            def both():
                main = torch.cuda.current_stream(dev)
                side.wait_stream(main)  # q is ready
                if first == "dense":
                    out["d"] = dense()
                with torch.cuda.stream(side):
                    out["g"] = group()
                if first == "grouping":
                    out["d"] = dense()
                main.wait_stream(side)
                out["g"].record_stream(main)
            res[f"overlap_{prio_name}_{first}_first_ms"] = timed(both, args.reps)
            torch.cuda.synchronize()
            same = same and torch.equal(out["g"], want)
            log.info("%s priority, %s first: %.2f ms", prio_name, first, res[f"overlap_{prio_name}_{first}_first_ms"])
    got = {}

    def product():  # as the engine does it: the mark, the dense call, then the grouping at select
        pending = K.beside(group, q)
        got["d"] = dense()
        got["g"] = pending.result()
    res["kernels_beside_ms"] = timed(product, args.reps)
    torch.cuda.synchronize()
    same = same and torch.equal(got["g"], want)
    log.info("kernels.beside: %.2f ms", res["kernels_beside_ms"])
    res["groups_equal"] = same
    log.info(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
