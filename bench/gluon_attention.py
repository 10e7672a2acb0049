"""The Gluon probe (docs/kernel_notes.md, "v17"): the Hopper kernel written in Gluon, kernels/attention_gluon.py,
driven with each of the tilings it was chosen among — KV tiles of 128 or 64 keys, 2 to 4 stages in the TMA ring, and
two consumer warpgroups of 64 rows each (``split``, the product's layout) or one 8-warp consumer of 128 rows (``w8``) —
checked against fp32 SDPA and the PyTorch twin at real sizes, then timed against cuDNN and our TMA kernels, dense and
block-sparse (the engine's CSR lists: kv_indices (B,H,nqb,max_k) int32, kv_counts (B,H,nqb) int32, block_q 128,
block_k = the tile). The schedule itself is described in kernels/attention_gluon.py.

Usage on the H200/H100: ``python3 bench/gluon_attention.py --out $OUT`` (bench/device_gluon.sh runs each
configuration's checks in its own process first). Offline, without a GPU: ``python bench/gluon_attention.py
--compile-only`` compiles every configuration for sm_90a and reports registers, spills and shared memory (Triton >= 3.6
with Gluon).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import triton
from triton.experimental.gluon import language as gl


def _kernel_module():
    """kernels/attention_gluon.py, the product's Gluon kernel, which this probe drives with its other tilings."""
    from _pack import load  # bench/_pack.py (bench/ is on the path: the script's folder)
    return load("kernels.attention_gluon")


CONFIGS = [dict(BLOCK_N=128, STAGES=2, SPLIT=False), dict(BLOCK_N=128, STAGES=2, SPLIT=True),
           dict(BLOCK_N=128, STAGES=3, SPLIT=True), dict(BLOCK_N=64, STAGES=4, SPLIT=True),
           dict(BLOCK_N=64, STAGES=4, SPLIT=False)]


CONFIGS_ALL = list(CONFIGS)


def _tag(cfg):
    """A configuration's label: 'BN128 s2 split'."""
    return f"BN{cfg['BLOCK_N']} s{cfg['STAGES']} {'split' if cfg['SPLIT'] else 'w8'}"


def _gl_dtype(dtype):
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]


def attention(q, k, v, kv_indices=None, kv_counts=None, *, block_n=128, stages=2, split=True, scale=None):
    """Dense (kv_indices None) or block-sparse attention on the product's Gluon kernel with one of CONFIGS' tilings.

    q, k, v: (B,H,N,D) bf16/fp16, D in {64, 128}; kv_indices (B,H,nqb,max_k) int32 sorted block lists (block_q 128,
    block_k ``block_n``), kv_counts (B,H,nqb) int32. Returns (B,H,N,D) in q's dtype."""
    d = q.shape[-1]
    if d not in (64, 128) or q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"the Gluon probe takes D 64/128 in bf16/fp16, got D {d} {q.dtype}")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lists = {} if kv_indices is None else dict(idx=kv_indices.to(torch.int32).contiguous(),
                                               cnt=kv_counts.to(torch.int32).contiguous())
    return _kernel_module().attention(q, k, v, out, scale=scale if scale is not None else d ** -0.5, block_k=block_n,
                                      tiles=(block_n, stages), split=split, **lists)


def compile_report(configs=None, modes=(True, False)):
    """Configurations (default every one of CONFIGS) compiled for sm_90a without a GPU, dense (True) and block-sparse
    (False): [(label, resources)] (tools/compile_report.py, ``compile_gluon``: regs, spill bytes, shared bytes, tma,
    wgmma)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from compile_report import compile_gluon
    return [(f"{'dense' if dense else 'sparse'} {_tag(cfg)}",
             compile_gluon(dense=dense, tiles=(cfg["BLOCK_N"], cfg["STAGES"]), split=cfg["SPLIT"]))
            for dense in modes for cfg in configs or CONFIGS]


def _check(K, log):
    """Against fp32 SDPA (dense) and the PyTorch twin (block-sparse) on the GPU: ragged N, empty rows, a row over every
    block, every configuration. q is scaled so that attention is peaked (outputs of order 1: a tile missed or counted
    twice shows far above bf16 rounding); each error must stay within 3x (+2e-3) of our Triton kernel's on the same
    call. Returns [(label, max abs error, ok)]."""
    import torch.nn.functional as F
    import kernels as kb  # bench/kernels.py (bench/ is on the path: the script's folder): SHAPES, block_lists, bench
    out = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    for h, n in ((2, 4133), (3, 32760)):
        q, k, v = (torch.randn(1, h, n, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
        q = (q * 2.5).to(q.dtype)
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        ours = K.attention_dense(q, k, v, backend="triton")
        ours_err = (ours.float() - ref).abs().max().item()
        log(f"dense {h}x{n}: our Triton kernel's max |err| {ours_err:.2e}")
        lists = {}
        for bn in sorted({c["BLOCK_N"] for c in CONFIGS}):
            nqb, nkb = triton.cdiv(n, 128), triton.cdiv(n, bn)
            idx, cnt = kb.block_lists(h, nqb, nkb, 0.25, True, gen)
            idx = torch.cat([idx, torch.full((1, h, nqb, max(0, nkb - idx.shape[-1])), -1, dtype=idx.dtype,
                                             device=idx.device)], -1)
            cnt[0, 0, :3] = 0  # empty rows
            cnt[0, -1, -1] = nkb  # the last (ragged) query block over every key block, the ragged last one included
            idx[0, -1, -1, :nkb] = torch.arange(nkb, device=idx.device, dtype=idx.dtype)
            twin = K.block_sparse_attention(q, k, v, idx, cnt, block_q=128, block_k=bn, backend="torch").float()
            mine = K.block_sparse_attention(q, k, v, idx, cnt, block_q=128, block_k=bn, backend="triton")
            lists[bn] = (idx, cnt, twin, (mine.float() - twin).abs().max().item())
            log(f"sparse {h}x{n} bk{bn}: our Triton kernel's max |err| {lists[bn][3]:.2e}")
        for cfg in CONFIGS:
            bn = cfg["BLOCK_N"]
            tag = f"{h}x{n} {_tag(cfg)}"
            idx, cnt, twin, mine_err = lists[bn]
            for kind, lists_, want, tol in (("dense", (), ref, ours_err), ("sparse", (idx, cnt), twin, mine_err)):
                try:
                    got = attention(q, k, v, *lists_, block_n=bn, stages=cfg["STAGES"], split=cfg["SPLIT"])
                    err = (got.float() - want).abs().max().item()
                except Exception as exc:  # a compile or launch failure fails this configuration only
                    log(f"{kind} {tag}: {type(exc).__name__}: {str(exc)[:400]}")
                    out.append((f"{kind} {tag}", float("nan"), False))
                    continue
                out.append((f"{kind} {tag}", err, err <= 3 * tol + 2e-3))
                log(f"{kind} {tag}: max |err| {err:.2e}")
    return out


def _time(K, shapes, log, budget_s, configs, densities=(0.25, 0.1, 0.5)):
    """ms of cuDNN dense, our TMA dense kernel, every Gluon configuration dense, and at d 0.5 / 0.25 / 0.1 our
    block-sparse kernel and the Gluon kernel (lists of 128 × BLOCK_N blocks), on random bf16 inputs."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import kernels as kb  # bench/kernels.py (bench/ is on the path: the script's folder): SHAPES, block_lists, bench
    t_end = time.time() + budget_s
    rows = []
    for name in shapes:
        h, n, d = kb.SHAPES[name]
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
        flops = 4.0 * h * n * n * d

        def rec(kind, variant, fn, density=1.0):
            try:
                ms = kb.bench(fn)
            except Exception as exc:
                log(f"{name:7s} {kind:6s} {variant:28s} failed: {type(exc).__name__}: {str(exc)[:300]}")
                return
            r = dict(shape=name, kind=kind, variant=variant, density=density, ms=ms,
                     tflops=flops * density / ms / 1e9)
            rows.append(r)
            log(f"{name:7s} {kind:6s} {variant:28s} d={density:.2f} {ms:9.3f} ms {r['tflops']:6.1f} TF/s")
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            rec("dense", "cudnn", lambda: F.scaled_dot_product_attention(q, k, v))
        rec("dense", "ours tma (+lse)", lambda: K.attention_dense(q, k, v, return_lse=True, backend="triton"))
        for cfg in configs:
            if time.time() > t_end:
                break
            tag = f"gluon {_tag(cfg)}"
            rec("dense", tag, lambda: attention(q, k, v, block_n=cfg["BLOCK_N"], stages=cfg["STAGES"],
                                                split=cfg["SPLIT"]))
        for dens in densities:
            if time.time() > t_end:
                break
            nqb = triton.cdiv(n, 128)
            lists = {}
            for bn in sorted({128} | {c["BLOCK_N"] for c in configs}):
                lists[bn] = kb.block_lists(h, nqb, triton.cdiv(n, bn), dens, False, gen)
            idx, cnt = lists[128]
            kept = kb.kept_fraction(cnt, n, 128, 128)
            rec("sparse", "ours tma bk128", lambda: K.block_sparse_attention(
                q, k, v, idx, cnt, block_q=128, block_k=128, validate=False), kept)
            for cfg in configs:
                bn = cfg["BLOCK_N"]
                i2, c2 = lists[bn]
                kept = kb.kept_fraction(c2, n, 128, bn)
                tag = f"gluon {_tag(cfg)} bk{bn}"
                rec("sparse", tag, lambda: attention(q, k, v, i2, c2, block_n=bn, stages=cfg["STAGES"],
                                                     split=cfg["SPLIT"]), kept)
            if 64 in lists:
                i2, c2 = lists[64]
                rec("sparse", "ours tma bk64", lambda: K.block_sparse_attention(
                    q, k, v, i2, c2, block_q=128, block_k=64, validate=False), kb.kept_fraction(c2, n, 128, 64))
        q = k = v = None  # noqa: F841  (the next shape's inputs take their memory)
        torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder for gluon.json and the compiler report")
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90a and report; no GPU needed")
    ap.add_argument("--shapes", default="wan14b,hyv,wan13b")
    ap.add_argument("--budget", type=float, default=300.0, help="seconds for the timings")
    ap.add_argument("--configs", default="", help="only these configurations, e.g. 'BN128 s2 split,BN128 s2 w8'")
    ap.add_argument("--densities", default="0.25,0.1,0.5", help="block-sparse densities timed ('' for dense only)")
    ap.add_argument("--list-configs", action="store_true", help="print the configurations' labels, one a line")
    ap.add_argument("--check-only", action="store_true",
                    help="only the checks against the twins (exit 0 when every configuration passes): "
                         "bench/device_gluon.sh runs each configuration so in its own process first, so that a "
                         "configuration that hangs the GPU costs its own timeout, not the run")
    args = ap.parse_args()
    global CONFIGS
    if args.list_configs:
        sys.stdout.write("".join(_tag(c) + "\n" for c in CONFIGS))
        return 0
    if args.configs:
        want = {c.strip() for c in args.configs.split(",")}
        CONFIGS = [c for c in CONFIGS if _tag(c) in want]
        if not CONFIGS:
            ap.error(f"--configs: none of {sorted(want)} is a configuration ({[_tag(c) for c in CONFIGS_ALL]})")
    log_file = None
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        log_file = open(Path(args.out, "gluon.log"), "a")  # noqa: SIM115  (line by line: a hang keeps what came before)

    def log(msg):
        sys.stderr.write(msg + "\n")
        sys.stderr.flush()
        if log_file:
            log_file.write(msg + "\n")
            log_file.flush()
    report = compile_report() if args.compile_only else []  # offline it says the same (same Triton, same target)
    for label, res in report:
        log(f"{label}: {res}")
    result = dict(report=report)
    if not args.compile_only:
        from _pack import load  # bench/_pack.py
        K = load("kernels")
        log(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
        checks = _check(K, log)
        result["checks"] = checks
        failed = {label.split(" ", 2)[2] for label, _, ok in checks if not ok}
        passed = [c for c in CONFIGS if _tag(c) not in failed]
        if failed:
            log(f"checks failed for {sorted(failed)}: those are not timed")
        if passed and not args.check_only:
            result["rows"] = _time(K, [s for s in args.shapes.split(",") if s], log, args.budget, passed,
                                   [float(x) for x in args.densities.split(",") if x.strip()])
    if args.out and not args.check_only:  # a check-only run's results are in the log (one process a configuration)
        Path(args.out, "gluon.json").write_text(json.dumps(result, indent=1))
    return 0 if all(ok for _, _, ok in result.get("checks", [])) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
