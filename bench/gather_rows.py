"""The query grouping's row gather timed in several forms (kernels/gather_torch.py and gather_triton.py; kernel_notes
"v21": at 16 coordinates a row the grouping's index_select took ~17 of its ~35 ms of GPU time at Wan 14B).

    python bench/gather_rows.py [--heads 40] [--tokens 75600] [--dims 16,128] [--out FILE.json]

For each row width: the gather of every row of ``heads`` blocks of ``tokens`` rows by a random permutation inside each
block (what a level of the grouping reads), as index_select, advanced indexing, an element-wise gather with an
expanded index, a float64 view (two fp32 values a lane) and the pack's Triton kernel (kernels/gather_triton.py); then
``group_queries(q, 128, dims=16)`` (kernels/grouping_torch.py) with the grouping's gather replaced by each form.
bench/engine.py's ``timed``: CUDA events, the median of 10 (5 for the grouping) after one warm-up call (the raw runs
gather-rows-1 and -2 took three warm-ups).
"""

from __future__ import annotations

import argparse
import json
import logging

import torch
from _pack import load
from engine import timed

log = logging.getLogger("bench.gather_rows")

FORMS = {
    "index_select": lambda rows, idx: rows.index_select(0, idx),
    "indexing": lambda rows, idx: rows[idx],
    "gather": lambda rows, idx: torch.gather(rows, 0, idx.unsqueeze(-1).expand(-1, rows.shape[1])),
    "float64_view": lambda rows, idx: rows.view(torch.float64).index_select(0, idx).view(torch.float32),
    "triton": lambda rows, idx: load("kernels.gather_triton").gather_rows(rows, idx),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=75600)
    ap.add_argument("--dims", default="16,128")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    grouping = load("kernels.grouping_torch")
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    h, n = args.heads, args.tokens
    idx = (torch.argsort(torch.rand(h, n, device=dev, generator=g), dim=1)
           + torch.arange(h, device=dev).view(h, 1) * n).view(-1)
    result = {"heads": h, "tokens": n, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "gather_ms": {}, "group_queries_ms": {}}
    for d in (int(x) for x in args.dims.split(",")):
        rows = torch.randn(h * n, d, device=dev, generator=g)
        ref = rows.index_select(0, idx)
        for name, fn in FORMS.items():
            assert torch.equal(fn(rows, idx), ref), name
            ms = timed(lambda: fn(rows, idx), 10)
            result["gather_ms"][f"{name} d{d}"] = ms
            log.info("gather %-13s d %3d: %.3f ms (%.0f GB/s)", name, d, ms, 2 * rows.numel() * 4 / ms / 1e6)
    q = torch.randn(1, h, n, 128, device=dev, generator=g).to(torch.bfloat16)
    base = grouping.group_queries(q, 128, 16)
    for name, fn in FORMS.items():
        assert torch.equal(grouping.group_queries(q, 128, 16, gather=fn), base), name
        ms = timed(lambda: grouping.group_queries(q, 128, 16, gather=fn), 5)
        result["group_queries_ms"][name] = ms
        log.info("group_queries(dims=16) with %-13s %.2f ms", name, ms)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
