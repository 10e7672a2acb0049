"""The Gluon probe (bench/gluon_attention.py, docs/kernel_notes.md "v17") compiled for sm_90a on the CPU: its two
partition layouts build, fit the H100's shared memory and the register split without spilling, and lower to TMA
copies and wgmma. Its numbers come from the GPU (bench/device_gluon.sh)."""

import pytest

triton = pytest.importorskip("triton")


def test_the_gluon_probe_compiles_for_hopper_without_spills(bench_import):
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"this Triton has no Gluon for Hopper: {exc}")
    mod = bench_import("gluon_attention")
    rows = mod.compile_report(configs=[dict(BLOCK_N=128, STAGES=2, SPLIT=False)], modes=(True,))
    rows += mod.compile_report(configs=[dict(BLOCK_N=128, STAGES=2, SPLIT=True)], modes=(False,))
    assert [label for label, _ in rows] == ["dense BN128 s2 w8", "sparse BN128 s2 split"]
    for label, res in rows:
        assert "error" not in res, (label, res)
        assert res["spill"] == 0 and res["tma"] and res["wgmma"], (label, res)
        assert res["shared"] <= 232448, (label, res)  # sm_90's per-block opt-in maximum
