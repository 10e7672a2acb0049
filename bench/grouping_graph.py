"""The query grouping with and without its CUDA graph (kernels/grouping_graph.py; docs/kernel_notes.md, "v22").

    python bench/grouping_graph.py [--heads 40] [--tokens 75600] [--batch 1] [--out FILE.json]

``kernels.group_queries(q, 128, dims=16)`` at Wan 2.1 14B by default (bf16 queries, one head layout of 40 x 75 600):
wall ms of the call run as it is (SPARSE_ATTN_GROUPING_GRAPH=0), of a shape's first call (as it is, noted), of the
second (warm-up and capture, then the replay), and of replays (the median of 10, bench/engine.py's ``timed``:
CUDA events around each call after one warm-up). Also the GPU memory the graphs hold (allocated and reserved, before
and after ``release()``), and whether the replayed groups equal those run as they are.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

import torch
from _pack import load
from engine import timed

log = logging.getLogger("bench.grouping_graph")


def wall_ms(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=75600)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    K = load("kernels")
    gg = load("kernels.grouping_graph")
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(args.batch, args.heads, args.tokens, 128, device=dev, generator=g).to(torch.bfloat16)
    q2 = torch.randn(args.batch, args.heads, args.tokens, 128, device=dev, generator=g).to(torch.bfloat16)

    def call(x=q):
        return K.group_queries(x, 128, dims=16)

    res = {"heads": args.heads, "tokens": args.tokens, "batch": args.batch, "gpu": torch.cuda.get_device_name(),
           "torch": torch.__version__}
    gg.release()
    os.environ["SPARSE_ATTN_GROUPING_GRAPH"] = "0"
    want, want2 = call(), call(q2)
    res["eager_ms"] = timed(call, 10)
    os.environ.pop("SPARSE_ATTN_GROUPING_GRAPH")
    gg.release()
    torch.cuda.synchronize()
    base_alloc, base_res = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    res["first_call_ms"] = wall_ms(call)
    res["capture_call_ms"] = wall_ms(call)
    res["replay_ms"] = timed(call, 10)
    res["same_groups"] = bool(torch.equal(call(), want) and torch.equal(call(q2), want2))
    torch.cuda.synchronize()
    res["graph_allocated_mb"] = (torch.cuda.memory_allocated() - base_alloc) / 2**20
    res["graph_reserved_mb"] = (torch.cuda.memory_reserved() - base_res) / 2**20
    gg.release()
    res["after_release_reserved_mb"] = (torch.cuda.memory_reserved() - base_res) / 2**20
    for k_, v_ in res.items():
        log.info("%-26s %s", k_, f"{v_:.2f}" if isinstance(v_, float) else v_)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
