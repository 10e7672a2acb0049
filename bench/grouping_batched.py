"""Cond and uncond grouped in one call or apart on the GPU: where the groups part (tests/test_gpu_kernels.py,
``test_cond_and_uncond_group_alike_batched_or_apart``; docs/kernel_notes.md, "v22").

    python bench/grouping_batched.py [--tokens 16384,75600] [--out FILE.json]

For two samples of 4 heads each (bf16, D 128, random): the projection on 16 leading directions of both in one call
against each alone (max abs difference), the partition of equal points batched or apart (identical groups?), and
the whole grouping's groups batched or apart (share of identical groups, share of identical query-to-group maps).
"""

from __future__ import annotations

import argparse
import json
import logging

import torch
from _pack import load

log = logging.getLogger("bench.grouping_batched")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="16384,75600")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    K = load("kernels")
    gt = load("kernels.grouping_torch")
    g = torch.Generator(device="cuda").manual_seed(0)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    for n in (int(x) for x in args.tokens.split(",")):
        q = torch.randn(2, 4, n, 128, device="cuda", generator=g).to(torch.bfloat16)
        pb = gt.project_leading(q, 16)
        pa = torch.cat([gt.project_leading(q[:1], 16), gt.project_leading(q[1:], 16)])
        same_points = gt._group(pb.clone(), 128, owned=True)
        apart_points = torch.cat([gt._group(pb[:1].clone(), 128, owned=True), gt._group(pb[1:].clone(), 128,
                                                                                        owned=True)])
        both = K.group_queries(q, 128, dims=16)
        apart = torch.cat([K.group_queries(q[:1], 128, dims=16), K.group_queries(q[1:], 128, dims=16)])
        rows_same = (both == apart).all(-1).float().mean().item()
        row = {"projection_max_abs_diff": (pb - pa).abs().max().item(),
               "projection_max_abs": pb.abs().max().item(),
               "partition_of_equal_points_identical": bool(torch.equal(same_points, apart_points)),
               "groups_identical_share": rows_same,
               "groups_all_identical": bool(torch.equal(both, apart))}
        res[str(n)] = row
        log.info("%d tokens: %s", n, row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
