"""Compile the kernels' autotune candidates for a GPU architecture without a GPU and report their resources.

    python tools/compile_report.py [--arch 90] [--kernels hopper,pointer,token,mass,residual] [--head-dims 128,64]
                                   [--loop plain,ahead] [--mass]

For each candidate: registers, spill bytes (ptxas -v), shared memory against the architecture's limit per
program, and whether the loads became TMA copies and the dots wgmma, from Triton's own ptxas. ``--arch``: the
compute capability as a number (90 Hopper; 80 A100, 86 RTX 30xx, 89 RTX 40xx, 120 RTX 50xx, which run the
pointer kernels: ``hopper`` is sm_90 only). Residuals are typed as the engine passes them there: fp8 data, as
bytes where Triton has no fp8 type (kernels/_triton_common.py, ``fp8_typed_on``). Use the device's Triton version for
figures that match it (e.g. ``pip install --target /tmp/t36 triton==3.6.0`` and ``PYTHONPATH=/tmp/t36``).
docs/kernel_notes.md records the results and what they decided.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from _pack import load  # noqa: E402

# bytes of shared memory one program may use (CUDA's per-block opt-in maximum), by compute capability
SMEM_LIMITS = {75: 65536, 80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448, 120: 101376}


def compile_one(fn, types, constexprs, divisible, config, arch: int = 90, source=None):
    """Compile ``fn`` (a JITFunction) for compute capability ``arch`` (90: sm_90a); returns a dict of resources (or
    an error). ``source``: the source class (default triton.compiler.ASTSource; Gluon's GluonASTSource for a
    ``gluon.jit`` function)."""
    import triton
    from triton.backends.compiler import GPUTarget
    names = fn.arg_names
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible if n in names and n not in constexprs}
    src = (source or triton.compiler.ASTSource)(fn=fn, signature=sig, attrs=attrs,
                                                constexprs={(names.index(k),): v for k, v in constexprs.items()})
    opts = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    if getattr(config, "maxnreg", None):
        opts["maxnreg"] = config.maxnreg
    try:
        c = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)
    except Exception as exc:
        return dict(error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}")
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(c.asm["ptx"])
        gpu = "sm_90a" if arch == 90 else f"sm_{arch}" + ("a" if arch >= 100 else "")
        ptxas = bin_dir / ("ptxas-blackwell" if arch >= 100 and (bin_dir / "ptxas-blackwell").exists() else "ptxas")
        log = subprocess.run([str(ptxas), "-v", "--gpu-name", gpu, str(ptx), "-o", os.devnull],
                             capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores", log)
    ttgir = c.asm["ttgir"]
    return dict(regs=int(regs.group(1)) if regs else None, spill=int(spill.group(1)) if spill else None,
                shared=c.metadata.shared, tma="async_tma_copy_global_to_local" in ttgir,
                wgmma="warp_group_dot " in ttgir)


def gluon_types(d, bn, dtype, fp8, **more):
    """The argument types kernels/attention_gluon.py's kernels and the anchor share: the three TMA descriptors (a
    128-row query tile, ``bn``-row K/V tiles of head dim ``d`` in ``dtype``), the epilogue's pointers (the residual
    fp8 or in ``dtype``), the lists and the scale; ``more`` adds or overrides."""
    from triton.experimental.gluon import language as gl
    block_m = load("kernels.attention_gluon").BLOCK_M
    gdt = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype]
    q_layout = gl.NVMMASharedLayout.get_default_for([block_m, d], gdt)
    kv_layout = gl.NVMMASharedLayout.get_default_for([bn, d], gdt)
    return dict(q_desc=f"tensordesc<{dtype}[{block_m}, {d}],{q_layout!r}>",
                k_desc=f"tensordesc<{dtype}[{bn}, {d}],{kv_layout!r}>",
                v_desc=f"tensordesc<{dtype}[{bn}, {d}],{kv_layout!r}>",
                Out=f"*{dtype}", Lse="*fp32", R="*fp8e4nv" if fp8 else f"*{dtype}", RS="*fp32", MS="*fp32",
                IDX="*i32", CNT="*i32", qk_scale="fp32", **more)


def compile_gluon(*, dense, d=128, block_k=128, tiles=None, split=True, dtype="bf16", residual=0, mass=False,
                  lse=False, ordered=False, q_bnhd=False, kv_bnhd=False, persistent=False, arch: int = 90):
    """kernels/attention_gluon.py's kernel compiled (Triton >= 3.6 with Gluon) for one variant, as its ``attention``
    launches it: dense or block-sparse, head dim ``d``, the tiles of ``block_k`` (or ``tiles`` = (BLOCK_N, STAGES)),
    ``split`` (two consumer warpgroups) or one 8-warp consumer, bf16/fp16, residual 0 none / 1 model dtype / 2 fp8,
    the mass, the LSE, heavy-first rows, the (B, N, H, D) descriptor layouts; ``persistent``: the persistent
    block-sparse kernel (``_attention_persistent``) instead. Returns ``compile_one``'s dict."""
    from triton.experimental.gluon._runtime import GluonASTSource
    mod = load("kernels.attention_gluon")
    bn, stages = tiles or mod.TILES[block_k]
    types = gluon_types(d, bn, dtype, residual == 2, ORDER="*i32")
    consts = dict(Q_BNHD=q_bnhd, KV_BNHD=kv_bnhd, BLOCK_N=bn, HEAD_D=d, STAGES=stages, RESIDUAL=residual, MASS=mass,
                  WRITE_LSE=lse)
    if not persistent:
        consts.update(DENSE=dense, ORDERED=ordered, SPLIT=split)
    conf = argparse.Namespace(num_warps=4 if split else 8, num_stages=1, maxnreg=None)
    pointers = ["Out", "Lse", "R", "RS", "MS", "IDX", "CNT", "ORDER"]
    fn = mod._attention_persistent if persistent else mod._attention_fwd
    return compile_one(fn, types, consts, pointers, conf, arch, source=GluonASTSource)


def compile_gluon_anchor(*, d=128, block_k=128, dtype="bf16", fp8=True, mass=True, lse=True, q_bnhd=False,
                         kv_bnhd=False, arch: int = 90):
    """kernels/anchor_gluon.py's fused anchor compiled for one variant, as its ``anchor`` launches it: head dim ``d``,
    the tiles of ``block_k``, bf16/fp16, an fp8 or model-dtype residual, the mass, the LSE, the (B, N, H, D)
    descriptor layouts. Returns ``compile_one``'s dict."""
    from triton.experimental.gluon._runtime import GluonASTSource
    mod = load("kernels.anchor_gluon")
    bn, stages = load("kernels.attention_gluon").TILES[block_k]
    types = gluon_types(d, bn, dtype, fp8, CIDX="*i32", CCNT="*i32")
    consts = dict(Q_BNHD=q_bnhd, KV_BNHD=kv_bnhd, BLOCK_N=bn, HEAD_D=d, STAGES=stages, FP8_OUT=fp8, MASS=mass,
                  WRITE_LSE=lse)
    conf = argparse.Namespace(num_warps=4, num_stages=1, maxnreg=None)
    pointers = ["Out", "Lse", "R", "RS", "MS", "IDX", "CNT", "CIDX", "CCNT"]
    return compile_one(mod._anchor_fwd, types, consts, pointers, conf, arch, source=GluonASTSource)


def compile_gluon_token(*, d=128, residual=0, compact=False, dtype="bf16", tiles=None, off32=None, persistent=False,
                        arch: int = 90):
    """kernels/token_sparse_gluon.py's kernel compiled for one variant, as its ``attention`` launches it: head dim
    ``d``, residual 0 none / 1 model dtype / 2 fp8, int32 or compact int16 lists (two segments), bf16/fp16, ``tiles``
    (BLOCK_N, STAGES) or the module's for ``d``, ``off32`` the loader's 32-bit row offsets (None: the module's OFF32 for
    the kind of list), ``persistent`` the one-program-per-SM kernel (``_token_persistent``).
    Returns ``compile_one``'s dict (``tma`` is False: the loads are cp.async)."""
    from triton.experimental.gluon._runtime import GluonASTSource
    mod = load("kernels.token_sparse_gluon")
    bn, stages = tiles or mod.TILES[d]
    types = dict(Q=f"*{dtype}", K=f"*{dtype}", V=f"*{dtype}", Out=f"*{dtype}",
                 R="*fp8e4nv" if residual == 2 else f"*{dtype}", RS="*fp32", QG="*i32",
                 TOK="*i16" if compact else "*i32", CNT="*i32", SEG="*i32", qk_scale="fp32")
    warps, regs, consumer_regs = mod.PERSISTENT_LOADER if persistent else mod.LOADER
    consts = dict(HEAD_D=d, BLOCK_N=bn, STAGES=stages, RESIDUAL=residual, N_SEG=2 if compact else 0,
                  SEGMENT=load("kernels.compact_torch").SEGMENT, LOADER_WARPS=warps, LOADER_REGS=regs,
                  CONSUMER_REGS=consumer_regs,
                  OFF32=mod.OFF32["compact" if compact else "int32"] if off32 is None else off32)
    conf = argparse.Namespace(num_warps=4, num_stages=1, maxnreg=None)
    divisible = ["Q", "K", "V", "Out", "R", "QG", "TOK", "CNT"] + [f"s{t}{a}" for t in "qkv" for a in "bhn"]
    kernel = mod._token_persistent if persistent else mod._token_fwd
    return compile_one(kernel, types, consts, divisible, conf, arch, source=GluonASTSource)

def jit_of(fn):
    """The JITFunction under autotune/heuristics wrappers."""
    while type(fn).__name__ != "JITFunction":
        fn = fn.fn
    return fn


def cases(kinds, head_dims, loops=("plain",), mass=False, arch=90):
    """(label, jit function, types, constexprs, divisible args, config) of every candidate, for each loop mode of
    ``loops`` (kernels/_triton_common.py, loop_ahead); with ``mass`` the block-sparse and anchor candidates read /
    write the residual's mass (kernels/_residual.py). ``arch``: the compute capability compiled for; the residual
    the pointer and token kernels read is fp8, typed or as bytes as the engine passes it there."""
    ah, tt, mt = load("kernels.attention_hopper"), load("kernels.token_sparse_triton"), load("kernels.mass_triton")
    bs, dn, tc = load("kernels.block_sparse_triton"), load("kernels.dense_triton"), load("kernels._triton_common")
    typed = tc.fp8_typed_on((arch // 10, arch % 10))
    res_mode, res_type = (tc.RES_FP8, "*fp8e4nv") if typed else (tc.RES_FP8_BYTES, "*u8")
    ptr = {n: "*bf16" for n in ("Q", "K", "V", "Out", "R", "RO")}
    ptr.update({n: "*i32" for n in ("KV_IDX", "KV_CNT", "CMP_IDX", "CMP_CNT", "ORDER", "COUNTER", "QG", "TOK", "CNT")})
    ptr.update({"Lse": "*fp32", "LSE": "*fp32", "RS": "*fp32", "ROS": "*fp32", "OUT": "*fp32", "qk_scale": "fp32",
                "MS": "*fp32"})
    div = ["Q", "K", "V", "Out", "R", "RO", "QG", "TOK", "CNT", "LSE", "OUT"] + [
        f"s{t}{a}" for t in "qkvor" for a in "bhn"]
    for d, loop in ((d, loop) for d in head_dims for loop in loops):
        pad = max(16, 1 << (d - 1).bit_length())
        tag = ("" if loop == "plain" else f" {loop}") + (" mass" if mass else "")
        if "hopper" in kinds and arch == 90:
            for kind, configs, mode, extra in (("sparse", ah.SPARSE_CONFIGS, 0, {}),
                                               ("persistent", ah.PERSISTENT_CONFIGS, 0, dict(PERSISTENT=True)),
                                               ("dense", ah.DENSE_CONFIGS, 1, dict(WRITE_LSE=True)),
                                               ("anchor", ah.ANCHOR_CONFIGS, 2, dict(RES_OUT=2, WRITE_LSE=True)),
                                               ("residual", ah.SPARSE_CONFIGS, 3, dict(RESIDUAL=1, RES_OUT=2))):
                for c in ah._prune(configs, {}, BLOCK_K=128, BLOCK_M=128):
                    ce = dict(HEAD_DIM=d, D_PAD=pad, BLOCK_M=128, BLOCK_K=128, BLOCK_N=c.kwargs["BLOCK_N"],
                              EVEN_K=False, EVEN_N=False, MODE=mode, RESIDUAL=0, RES_OUT=0, WRITE_LSE=False,
                              ORDERED=mode in (0, 3), PERSISTENT=False, WARP_SPEC=False, PROGS_PER_SM=1, LAZY=False,
                              AHEAD=loop == "ahead", MASS=mass and mode in (0, 2, 3))
                    ce.update(extra)
                    types = {**ptr, "RO": "*fp8e4nv"} if ce["RES_OUT"] == 2 else ptr  # the engine stores fp8 R
                    yield f"{kind} D{d}{tag}", jit_of(ah._attn_tma), types, ce, div, c
        if "pointer" in kinds:  # the kernels of GPUs without TMA (kernels/_hopper.py)
            for c in bs._CONFIGS:  # a reuse call: the engine's fp8 residual, weighted by the mass with ``mass``
                ce = dict(HEAD_DIM=d, D_PAD=pad, RESIDUAL=res_mode, BLOCK_M=128, BLOCK_K=128,
                          BLOCK_N=c.kwargs["BLOCK_N"], EVEN_K=False, LAZY=False, MASS=mass, WRITE_LSE=False)
                yield f"pointer sparse D{d}{tag}", jit_of(bs._bsa_fwd), {**ptr, "R": res_type}, ce, div, c
            for c in dn._CONFIGS:  # the dense call and its LSE
                ce = dict(HEAD_DIM=d, D_PAD=pad, WRITE_LSE=True, BLOCK_M=c.kwargs["BLOCK_M"],
                          BLOCK_N=c.kwargs["BLOCK_N"], EVEN_N=False, LAZY=False)
                yield f"pointer dense D{d}{tag}", jit_of(dn._dense_fwd), ptr, ce, div, c
        if "token" in kinds:
            for n_seg, tok in ((0, "*i32"), (2, "*i16")):  # int32 lists; the engine's compact int16 lists
                for c in tt._CONFIGS:
                    ce = dict(HEAD_DIM=d, D_PAD=pad, RESIDUAL=0 if arch == 90 else res_mode, GROUP=128,
                              BLOCK_N=c.kwargs["BLOCK_N"], LAZY=False, N_SEG=n_seg, SEGMENT=65536,
                              AHEAD=loop == "ahead")
                    yield (f"token{' compact' if n_seg else ''} D{d}{tag}", jit_of(tt._token_fwd),
                           {**ptr, "TOK": tok, "SEG": "*i32", "R": res_type}, ce, div + ["SEG"], c)
        if "residual" in kinds and loop == "plain":  # the anchor's residual in one pass: fp8 where Triton types it
            rt = load("kernels.residual_encode_triton")
            types = {"A": "*bf16", "S": "*bf16", "RO": "*fp8e4nv" if typed else "*bf16", "ROS": "*fp32",
                     "SUMS": "*fp32"}
            ce = dict(HEAD_DIM=d, D_PAD=pad, BLOCK=rt.BLOCK_M, FP8_OUT=typed)
            yield (f"residual D{d}", jit_of(rt._residual_fwd), types, ce, ["A", "S", "RO", "ROS", "SUMS"],
                   argparse.Namespace(kwargs={}, num_warps=rt.NUM_WARPS, num_stages=1, maxnreg=None))
        if "mass" in kinds and loop == "plain":  # pass 2 has one loop
            for c in mt.CONFIGS:
                ce = dict(HEAD_DIM=d, D_PAD=pad, GROUP=128, USE_TMA=arch == 90, EVEN_N=False, **c.kwargs)
                yield f"mass D{d}", jit_of(mt._mass_fwd), ptr, ce, div, c
            for c in mt.PACKED_CONFIGS:  # groups of 16 (mass_queries), one dot over PG of them
                ce = dict(HEAD_DIM=d, D_PAD=pad, USE_TMA=arch == 90, EVEN_N=False, **c.kwargs)
                yield f"mass16 D{d}", jit_of(mt._mass_packed_fwd), ptr, ce, div, c


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90, choices=sorted(SMEM_LIMITS),
                    help="compute capability to compile for (90 = sm_90a)")
    ap.add_argument("--kernels", default="hopper,pointer,token,mass")
    ap.add_argument("--head-dims", default="128,64")
    ap.add_argument("--loop", default="plain", help="loop modes to compile, comma-separated: plain, ahead")
    ap.add_argument("--mass", action="store_true", help="block-sparse and anchor candidates with the residual's mass")
    args = ap.parse_args()
    import triton
    limit = SMEM_LIMITS[args.arch]
    print(f"Triton {triton.__version__}, target sm_{args.arch}, shared memory limit {limit} bytes per program")
    print(f"{'kernel':22s} {'config':52s} {'regs':>5s} {'spill':>6s} {'shared':>7s} tma wgmma")
    for label, fn, types, ce, div, c in cases(args.kernels.split(","), [int(x) for x in args.head_dims.split(",")],
                                              args.loop.split(","), args.mass, args.arch):
        cfg = ", ".join(f"{k}={v}" for k, v in c.kwargs.items()) + f", w{c.num_warps} s{c.num_stages}" + (
            f" maxnreg {c.maxnreg}" if getattr(c, "maxnreg", None) else "")
        r = compile_one(fn, types, ce, div, c, args.arch)
        if "error" in r:
            print(f"{label:22s} {cfg:52s} FAILED {r['error']}")
            continue
        over = "  > shared limit" if r["shared"] > limit else ""
        print(f"{label:22s} {cfg:52s} {r['regs']:5d} {r['spill']:6d} {r['shared']:7d} {str(r['tma'])[0]:>3s} "
              f"{str(r['wgmma'])[0]:>5s}{over}", flush=True)


if __name__ == "__main__":
    main()
