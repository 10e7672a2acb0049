"""GPU time of packing a residual to 4 bits and reading it back as fp8 (engine/residual.py; docs/decisions.md,
"Residuals at 4 bits"), at a real size: one layer's residual of Wan 2.1 14B 720p with CFG (2 x 40 heads x 75 600
tokens x 128) by default, with the mass rows a later anchor writes (mass-weighted reuse). Times, median of --reps
after a warm-up: unpacking on the GPU (what each reuse call of a
packed entry adds), packing on the GPU (an anchor's newcomer), and packing a host residual in page-locked memory on
the GPU (the cache's host path: its bytes there and back).

    python bench/residual_pack_time.py [--shape 2,40,75600,128] [--reps 5] [--out OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from _pack import load


def timed(fn, reps: int) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` runs after one warm-up, the GPU synchronised around each."""
    import torch
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def main(argv=None):
    import torch
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="2,40,75600,128")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    Residual = load("engine.residual").Residual
    shape = tuple(int(x) for x in args.shape.split(","))
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    fp8 = Residual.encode(torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=g), "fp8")
    rows = shape[:3]  # (log Z_C, log beta) of each row, as a later anchor stores them
    fp8.mass = torch.stack((20 + 3 * torch.randn(rows, device=dev, generator=g),
                            -5 * torch.rand(rows, device=dev, generator=g)), -1)
    packed = fp8.pack()
    host = Residual(fp8.data.cpu().pin_memory(), fp8.scale.cpu().pin_memory(), fp8.mass.cpu().pin_memory())
    bufs = {}  # the host results, page-locked once (as the cache's pool gives them), written again at each repetition

    def pinned(shape, dtype):
        if (shape, dtype) not in bufs:
            bufs[shape, dtype] = torch.empty(shape, dtype=dtype, pin_memory=True)
        return bufs[shape, dtype]
    res = {"shape": shape, "device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
           "fp8_mb": fp8.nbytes / 2**20, "packed_mb": packed.nbytes / 2**20,
           "unpack_ms": timed(lambda: packed.unpacked(), args.reps),
           "pack_ms": timed(lambda: fp8.pack(), args.reps),
           "pack_host_on_gpu_ms": timed(lambda: host.pack(work=dev, empty=pinned), args.reps)}
    assert torch.equal(host.pack(work=dev, empty=pinned).data, packed.data.cpu())  # the host path: the same bytes
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    packed.unpacked()
    res["unpack_peak_extra_mb"] = (torch.cuda.max_memory_allocated(dev) - base) / 2**20
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "pack_time.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
