"""The Gluon Hopper kernel (kernels/attention_gluon.py) compiled for sm_90a on the CPU, every variant the dispatch
can launch: dense with and without LSE, block-sparse with each residual (model dtype, fp8 with its scale, weighted by
the mass), row order and both descriptor layouts, D 64 and 128. Each must build, keep the consumers' 240 registers
without spilling, fit sm_90's shared memory and lower to TMA copies and wgmma. There is no interpreter for Gluon; the
GPU tests (tests/test_gpu_kernels.py) check the numbers against the twins."""

import argparse

import pytest

triton = pytest.importorskip("triton")


@pytest.fixture(scope="module")
def gluon(compile_report_module):
    try:
        from triton.experimental.gluon._runtime import GluonASTSource  # noqa: F401
        from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"this Triton has no Gluon for Hopper: {exc}")
    from comfyui_sparse_attention.kernels import attention_gluon
    return attention_gluon, compile_report_module


def _compile(gluon, *, dense, d=128, block_k=128, dtype="bf16", residual=0, mass=False, lse=False, ordered=False,
             q_bnhd=False, kv_bnhd=False, split=True):
    mod, report = gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    bn, stages = mod.TILES[block_k]
    gdt = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype]
    q_layout = gl.NVMMASharedLayout.get_default_for([mod.BLOCK_M, d], gdt)
    kv_layout = gl.NVMMASharedLayout.get_default_for([bn, d], gdt)
    types = dict(q_desc=f"tensordesc<{dtype}[{mod.BLOCK_M}, {d}],{q_layout!r}>",
                 k_desc=f"tensordesc<{dtype}[{bn}, {d}],{kv_layout!r}>",
                 v_desc=f"tensordesc<{dtype}[{bn}, {d}],{kv_layout!r}>",
                 Out=f"*{dtype}", Lse="*fp32", R={0: f"*{dtype}", 1: f"*{dtype}", 2: "*fp8e4nv"}[residual],
                 RS="*fp32", MS="*fp32", IDX="*i32", CNT="*i32", ORDER="*i32", qk_scale="fp32")
    consts = dict(DENSE=dense, ORDERED=ordered, Q_BNHD=q_bnhd, KV_BNHD=kv_bnhd, BLOCK_N=bn, HEAD_D=d, STAGES=stages,
                  RESIDUAL=residual, MASS=mass, WRITE_LSE=lse, SPLIT=split)
    conf = argparse.Namespace(num_warps=4 if split else 8, num_stages=1, maxnreg=None)
    pointers = ["Out", "Lse", "R", "RS", "MS", "IDX", "CNT", "ORDER"]
    return report.compile_one(mod._attention_fwd, types, consts, pointers, conf, source=GluonASTSource)


VARIANTS = {
    "dense": dict(dense=True),
    "dense + lse, transposed q/k/v": dict(dense=True, lse=True, q_bnhd=True, kv_bnhd=True),
    "dense D64 fp16": dict(dense=True, d=64, dtype="fp16", lse=True),
    "sparse, fp8 residual weighted by the mass, ordered": dict(dense=False, residual=2, mass=True, ordered=True),
    "sparse bk64, model-dtype residual, lse, transposed k/v": dict(dense=False, block_k=64, residual=1, lse=True,
                                                                   kv_bnhd=True),
    "sparse D64, fp8 residual": dict(dense=False, d=64, residual=2),
    "one 8-warp consumer (the probe's w8)": dict(dense=False, split=False),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_variant_compiles_for_hopper_without_spills(gluon, name):
    res = _compile(gluon, **VARIANTS[name])
    assert "error" not in res, res
    assert res["spill"] == 0 and res["tma"] and res["wgmma"], res
    assert res["shared"] <= 232448, res  # sm_90's per-block opt-in maximum
