"""Pass 2 of the mc_sparse anchor on groups of 16 ranking queries (kernels/mass_triton.py ``_mass_packed_fwd``: PG
groups a program in one dot; docs/kernel_notes.md, "v22"), each configuration on its own and the autotuned choice.
The raw run mass-pack-1 also timed the earlier kernel (four groups a program, a 16-column dot each), since removed.

    python bench/mass_pack.py [--heads 40] [--tokens 75600] [--group 128] [--out FILE.json]

Wan 2.1 14B's self-attention by default: 40 heads x 75 600 tokens, D 128, bf16, groups of 128 queries ranked by every
8th (mass_queries 16, the default). The groups are consecutive queries (the kernel's time does not depend on which
queries a group holds); the LSE is the dense call's. Each result is checked against the twin's on the first and last
eight groups (max_rel_err). bench/engine.py's ``timed``: CUDA events, the median of 10 after one warm-up call. Also
reported: the tensor-core rate (QK^T only) each time implies.
"""

from __future__ import annotations

import argparse
import json
import logging

import torch
from _pack import load
from engine import timed

log = logging.getLogger("bench.mass_pack")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=75600)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    K = load("kernels")
    MT = load("kernels.mass_triton")
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    h, n, c = args.heads, args.tokens, args.group
    q, k, v = (torch.randn(1, h, n, 128, device=dev, generator=g).to(torch.bfloat16) for _ in range(3))
    _, lse = K.attention_dense(q, k, v, return_lse=True)
    n_groups = -(-n // c)
    ids = torch.arange(n_groups * c, device=dev, dtype=torch.int32)
    groups = torch.where(ids < n, ids, -1).view(1, 1, n_groups, c).expand(1, h, n_groups, c)
    ranking = groups[..., ::c // 16].contiguous()
    flops = 2 * h * (ranking >= 0).sum().item() / h * n * 128
    result = {"heads": h, "tokens": n, "group": c, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "ms": {}, "tflops": {}}

    def record(name, fn):
        ms = timed(fn, 10)
        result["ms"][name] = ms
        result["tflops"][name] = flops / ms / 1e9
        log.info("%-40s %7.2f ms  (%.0f TFLOP/s of QK^T)", name, ms, flops / ms / 1e9)

    tw = load("kernels.selection_torch")
    rows = [slice(0, 8), slice(n_groups - 8, n_groups)]
    refs = [tw.group_kv_mass(q, k, lse, ranking[:, :, r]) for r in rows]
    tuner = MT._mass_packed_fwd
    every = list(tuner.configs)
    for cfg in every:
        tuner.configs = [cfg]
        tuner.cache.clear()
        name = "dot " + ",".join(f"{k_}={v_}" for k_, v_ in cfg.kwargs.items()) + f",w={cfg.num_warps}"
        try:
            out = MT.group_kv_mass(q, k, lse, ranking)
            err = max(((out[:, :, r] - ref).abs().max() / ref.abs().max()).item() for r, ref in zip(rows, refs))
            result.setdefault("max_rel_err", {})[name] = err
            record(name, lambda: MT.group_kv_mass(q, k, lse, ranking))
        except Exception as e:  # a config that does not compile on this GPU is a result, not the end of the run
            log.warning("%s failed: %s", name, e)
            result.setdefault("failed", {})[name] = str(e)[:400]
    tuner.configs = every
    tuner.cache.clear()
    record("dot (autotuned)", lambda: MT.group_kv_mass(q, k, lse, ranking))
    result["dot_best_config"] = str(getattr(tuner, "best_config", ""))
    log.info("autotuned: %s", result["dot_best_config"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
