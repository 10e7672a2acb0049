"""Kernel benchmark on one CUDA GPU: dense, block-sparse, token-sparse and exact selection (pass 1 + 2).

Usage (one call on the H200, see docs/benchmarks.md):
    python bench/kernels.py --out DIR [--shapes flux,wan13b,...] [--quick] [--densities 0.5,0.25] [--block-sizes 128]
Writes DIR/kernels.json (every measurement) and DIR/kernels.md (tables). Times are medians of
``triton.testing.do_bench``; effective TF/s counts 4*B*H*Nq*Nk*D times the density actually kept.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from _pack import load

log = logging.getLogger("bench.kernels")


SHAPES = {  # name: (heads, tokens, head_dim)
    "flux": (24, 4608, 128), "wan13b": (12, 32760, 128), "wan14b": (40, 75600, 128), "hyv": (24, 118800, 128),
    "flux-d64": (48, 4608, 64), "wan13b-d64": (24, 32760, 64), "wan14b-d64": (80, 75600, 64),
    "hyv-d64": (48, 118800, 64),
}
DENSITIES = (1.0, 0.5, 0.25, 0.1, 0.05)
TOKEN_DENSITIES = (0.25, 0.15, 0.1)


def bench(fn, rep_ms=60):
    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median"))


def block_lists(h, nqb, nkb, density, skewed, gen):
    """Random distinct sorted KV blocks per query block. Skewed: 10 % of query blocks dense, the rest
    sized so the overall density stays ``density`` (at least one block each). On ``gen``'s device."""
    dev = gen.device
    scores = torch.rand(1, h, nqb, nkb, device=dev, generator=gen)
    count = max(1, round(density * nkb))
    k = torch.full((1, h, nqb), count, device=dev)
    if skewed and density < 1.0:
        dense_rows = torch.rand(1, h, nqb, device=dev, generator=gen) < 0.1
        rest = max(1, round((density - 0.1) / 0.9 * nkb)) if density > 0.1 else 1
        k = torch.where(dense_rows, torch.full_like(k, nkb), torch.full_like(k, rest))
    order = torch.argsort(scores, dim=-1, descending=True)
    keep = torch.arange(nkb, device=dev) < k.unsqueeze(-1)
    chosen = torch.where(keep, order, torch.full_like(order, nkb))
    idx = torch.sort(chosen, dim=-1).values
    width = int(k.max())
    idx = idx[..., :width]
    idx = torch.where(idx == nkb, torch.full_like(idx, -1), idx).to(torch.int32)
    return idx.contiguous(), k.to(torch.int32).contiguous()


def kept_fraction(cnt, n, bq, bk):
    """Exact fraction of (q, k) pairs computed, counting ragged last blocks."""
    nqb, nkb = math.ceil(n / bq), math.ceil(n / bk)
    q_rows = torch.full((nqb,), bq, device=cnt.device, dtype=torch.float64)
    q_rows[-1] = n - (nqb - 1) * bq
    # ragged last KV block: approximate each kept block as full (the last block is 1 of nkb)
    frac = (cnt.double() * q_rows.view(1, 1, -1)).sum() * bk / (cnt.shape[1] * n * nkb * bk)
    return float(frac)


def flex_runner():
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention
    except Exception as exc:  # older torch
        log.warning("FlexAttention unavailable: %s", exc)
        return None
    compiled = torch.compile(flex_attention, dynamic=False)

    def run(q, k, v, idx, cnt, bs):
        nkb = math.ceil(k.shape[2] / bs)
        full = torch.zeros((*idx.shape[:3], nkb), dtype=torch.int32, device="cuda")
        full[..., :idx.shape[-1]] = idx.clamp(min=0)
        bm = BlockMask.from_kv_blocks(cnt, full, BLOCK_SIZE=bs, seq_lengths=(q.shape[2], k.shape[2]))
        return lambda: compiled(q, k, v, block_mask=bm)
    return run


def bench_shape(name, K, flex, densities, rows, block_sizes=(128, 64), token_grids=False, token_only=False):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    h, n, d = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    flops = 4.0 * h * n * n * d

    def rec(kind, ms, density=1.0, **extra):
        r = dict(shape=name, heads=h, tokens=n, head_dim=d, kind=kind, ms=ms, density=density,
                 eff_tflops=flops * density / ms / 1e9, **extra)
        rows.append(r)
        log.info("%-11s %-34s d=%.3f %9.3f ms %6.1f TF/s", name, kind, density, ms, r["eff_tflops"])
        return r

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        cudnn_ms = bench(lambda: F.scaled_dot_product_attention(q, k, v))
    rec("cudnn_sdpa_dense", cudnn_ms)
    if not token_only:
        dense_and_block_rows(q, k, v, K, flex, densities, block_sizes, gen, cudnn_ms, bench, rec)
    perm = torch.randperm(n, device="cuda", generator=gen).to(torch.int32)
    g = math.ceil(n / 128)
    groups = torch.full((g * 128,), -1, dtype=torch.int32, device="cuda")
    groups[:n] = perm
    groups = groups.view(1, 1, g, 128).expand(1, h, g, 128).contiguous()
    for dens in TOKEN_DENSITIES:
        kk = int(dens * n)
        toks = torch.topk(torch.rand(1, h, g, n, device="cuda", generator=gen), kk, dim=-1).indices
        toks = torch.sort(toks, -1).values.to(torch.int32).contiguous()
        tcnt = torch.full((1, h, g), kk, dtype=torch.int32, device="cuda")
        ms = bench(lambda: K.token_sparse_attention(q, k, v, groups, toks, tcnt, backend="triton", validate=False))
        r = rec("token128", ms, kk / n)
        r["speedup_vs_cudnn"] = cudnn_ms / ms
        if token_grids:
            token_grid_rows(K, q, k, v, groups, toks, tcnt, kk / n, bench, rec)
    if not token_only:
        _, lse = K.attention_dense(q, k, v, return_lse=True, backend="triton")
        p2_tok = bench(lambda: K.group_kv_mass(q, k, lse, groups, backend="triton", validate=False))
        p1 = min(r["ms"] for r in rows if r["shape"] == name and r["kind"] in ("ours_dense_lse", "auto_dense_lse"))
        rec("pass2_token_mass", p2_tok, pass1_plus_pass2_vs_cudnn=(p1 + p2_tok) / cudnn_ms)
    return kernel_paths(K, q)


def dense_and_block_rows(q, k, v, K, flex, densities, block_sizes, gen, cudnn_ms, bench, rec):
    """Our dense kernels, then block-sparse at each block size and density, balanced and skewed, against
    FlexAttention on the same mask where it runs."""
    h, n = q.shape[1], q.shape[2]
    rec("ours_dense", bench(lambda: K.attention_dense(q, k, v, backend="triton")))
    rec("ours_dense_lse", bench(lambda: K.attention_dense(q, k, v, return_lse=True, backend="triton")))
    rec("auto_dense_lse", bench(lambda: K.attention_dense(q, k, v, return_lse=True)))  # cuDNN + LSE
    for bs in block_sizes:
        nb = math.ceil(n / bs)
        for skewed in (False, True):
            for dens in densities:
                if skewed and dens == 1.0:
                    continue
                idx, cnt = block_lists(h, nb, nb, dens, skewed, gen)
                real = kept_fraction(cnt, n, bs, bs)
                tag = f"bsa{bs}{'_skew' if skewed else ''}"

                def fn(idx=idx, cnt=cnt, bs=bs):
                    return K.block_sparse_attention(q, k, v, idx, cnt, block_q=bs, block_k=bs, backend="triton",
                                            validate=False)
                ms = bench(fn)
                r = rec(tag, ms, real, target=dens)
                r["speedup_vs_cudnn"] = cudnn_ms / ms
                if flex is not None and bs == 128 and dens < 1.0:
                    try:
                        fms = bench(flex(q, k, v, idx, cnt, bs))
                        fr = rec("flex" + tag[3:], fms, real, target=dens)
                        fr["speedup_vs_cudnn"] = cudnn_ms / fms
                        r["vs_flex"] = fms / ms
                    except Exception as exc:  # compile failures are reported, not fatal
                        log.warning("flex failed on H=%d N=%d: %s", h, n, str(exc)[:300])


def token_grid_rows(K, q, k, v, groups, toks, tcnt, density, bench, rec):
    """--token-grids: the Gluon token kernel on its own grid (one program a query group) and on the persistent one
    (one program per SM: kernels/token_sparse_gluon.py, ``_token_persistent``), with the int32 lists above and with
    the engine's reuse call (compact int16 lists, fp8 residual in the epilogue), one after the other."""
    tt = importlib.import_module(K.__name__ + ".token_sparse_triton")
    ct = importlib.import_module(K.__name__ + ".compact_torch")
    res_mod = importlib.import_module(K.__name__ + "._residual")
    keep = torch.zeros(toks.shape[:3] + (k.shape[2],), dtype=torch.bool, device=q.device)
    keep.scatter_(-1, toks.long(), True)
    low, ends, cnt = ct.compact_keep(keep)
    del keep
    res = res_mod.encode_residual(torch.randn_like(q) * 0.05, "fp8", q.dtype)
    for path in ("gluon", "gluon_persistent"):
        tag = "" if path == "gluon" else "_persistent"
        rec("token128_int32" + tag, bench(lambda: tt.token_sparse_attention(
            q, k, v, groups, toks, tcnt, validate=False, path=path)), density)
        rec("token128_compact_fp8res" + tag, bench(lambda: tt.token_sparse_attention_compact(
            q, k, v, groups, low, ends, cnt, validate=False, residual=res, fill_ungrouped=False, path=path)), density)


def kernel_paths(K, q):
    """Whether each family's Gluon kernel takes ``q``'s shape with 128-blocks after the runs (the check the automatic
    dispatch makes, so also that no failure marked it broken): "gluon", or why not (the pointer / TMA path)."""
    hop = importlib.import_module(K.__name__ + "._hopper")
    kinds = {"gluon_dense": {}, "gluon_sparse": {}, "gluon_token": {"block_q": 128}}
    return {kind: hop.gluon_problem(kind, q, q, q, **kw) or "gluon" for kind, kw in kinds.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--quick", action="store_true", help="fewer densities (smoke run)")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--densities", default="", help="block-sparse target densities, comma-separated (default "
                    "1,0.5,0.25,0.1,0.05; --quick: 1,0.25,0.1)")
    ap.add_argument("--block-sizes", default="128,64", help="block sizes of the block-sparse masks, comma-separated")
    ap.add_argument("--token-grids", action="store_true", help="also time the Gluon token kernel on its own and on "
                    "the persistent grid, with int32 lists and with compact lists plus an fp8 residual")
    ap.add_argument("--token-only", action="store_true", help="skip the dense, block-sparse and pass-2 rows but "
                    "cuDNN's dense one (what the token rows are compared with)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    K = load("kernels")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    flex = None if args.no_flex else flex_runner()
    rows = []
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                cuda=torch.version.cuda, date=time.strftime("%Y-%m-%d %H:%M"))
    log.info("meta %s", meta)
    densities = (1.0, 0.25, 0.1) if args.quick else DENSITIES
    if args.densities:
        densities = tuple(float(x) for x in args.densities.split(","))
    block_sizes = tuple(int(x) for x in args.block_sizes.split(","))
    meta["paths"] = {}
    for name in args.shapes.split(","):
        meta["paths"][name] = bench_shape(name, K, flex, densities, rows, block_sizes, args.token_grids,
                                          args.token_only)
        log.info("%s: Gluon kernels eligible after the runs: %s", name, meta["paths"][name])
        torch.cuda.empty_cache()
        (out_dir / "kernels.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    (out_dir / "kernels.md").write_text(render(meta, rows))
    log.info("done")


def render(meta, rows):
    lines = [f"GPU {meta['gpu']}, torch {meta['torch']}, Triton {meta['triton']}, CUDA {meta['cuda']}, "
             f"{meta['date']}. bf16, B=1. ms = median of do_bench; TF/s = effective (work kept).", ""]
    if meta.get("paths"):
        lines += [f"Gluon kernels eligible after the runs (\"gluon\", or why not): {meta['paths']}", ""]
    for name in dict.fromkeys(r["shape"] for r in rows):
        rs = [r for r in rows if r["shape"] == name]
        h, n, d = rs[0]["heads"], rs[0]["tokens"], rs[0]["head_dim"]
        lines += [f"#### {name}: H={h}, N={n}, D={d}", "",
                  "| kernel | target d | real d | ms | eff TF/s | × cuDNN dense | × d (ideal 1) | vs Flex |",
                  "|---|---|---|---|---|---|---|---|"]
        cud = [r for r in rs if r["kind"] == "cudnn_sdpa_dense"][0]["ms"]
        for r in rs:
            sp = cud / r["ms"]
            extra = f"{r['vs_flex']:.2f}×" if "vs_flex" in r else ""
            if "pass1_plus_pass2_vs_cudnn" in r:
                extra = f"pass1+pass2 = {r['pass1_plus_pass2_vs_cudnn']:.2f}× cuDNN"
            lines.append(f"| {r['kind']} | {r.get('target', '')} | {r['density']:.3f} | {r['ms']:.3f} | "
                         f"{r['eff_tflops']:.0f} | {sp:.2f}× | {sp * r['density']:.2f} | {extra} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
