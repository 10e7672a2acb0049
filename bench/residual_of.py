"""The anchor's residual, formed and encoded: ``kernels.residual_of`` on Triton (one pass,
kernels/residual_encode_triton.py) against its twin and the engine's path before (docs/kernel_notes.md, "v23"), with
the sums of squares the fidelity needs.

    python bench/residual_of.py [--heads 40] [--tokens 75600] [--batch 1] [--out FILE.json]

bf16 (B, H, N, 128) outputs laid out (B, N, H, D) as the attention kernels write them; fp8 and the model's dtype; the
median of CUDA events around each call after a warm-up (bench/engine.py's ``timed``).
"""

from __future__ import annotations

import argparse
import json
import logging

import torch
from _pack import load
from engine import timed

log = logging.getLogger("bench.residual_of")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=75600)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    K = load("kernels")
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (args.batch, args.tokens, args.heads, 128)
    dense = torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16).transpose(1, 2)
    sparse = (dense.float() + 0.05 * torch.randn(dense.shape, device="cuda", generator=g)).to(torch.bfloat16)
    res = {"heads": args.heads, "tokens": args.tokens, "batch": args.batch, "gpu": torch.cuda.get_device_name(),
           "torch": torch.__version__}
    for backend in ("triton", "torch"):
        for precision in ("fp8", "model"):
            res[f"{backend}_{precision}_ms"] = timed(lambda: K.residual_of(
                dense, sparse, precision=precision, return_sums=True, backend=backend), 7)
    # the engine's old path: R in bf16, two norms read on the host, then the fp8 encoding of R
    enc = load("engine.residual")

    def before():
        diff = dense - sparse
        torch.stack([torch.linalg.vector_norm(diff), torch.linalg.vector_norm(dense)]).float().tolist()
        return enc.Residual.encode(diff, "fp8")
    res["before_fp8_ms"] = timed(before, 7)
    log.info(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
