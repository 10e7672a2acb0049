"""The Gluon Hopper kernel (kernels/attention_gluon.py) compiled for sm_90a on the CPU, every variant the dispatch
can launch: dense with and without LSE, block-sparse with each residual (model dtype, fp8 with its scale, weighted by
the mass), row order and both descriptor layouts, D 64 and 128 (tools/compile_report.py, ``compile_gluon``). Each must
build without spilling and fit sm_90's shared memory. There is no interpreter for Gluon; the GPU tests
(tests/test_gpu_kernels.py) check the numbers against the twins."""

import pytest

triton = pytest.importorskip("triton")


@pytest.fixture(scope="module")
def report(compile_report_module):
    """tools/compile_report.py, where this Triton has Gluon for Hopper."""
    try:
        from triton.experimental.gluon._runtime import GluonASTSource  # noqa: F401
        from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"this Triton has no Gluon for Hopper: {exc}")
    return compile_report_module


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
def test_every_variant_compiles_for_hopper_without_spills(report, name):
    res = report.compile_gluon(**VARIANTS[name])
    assert "error" not in res, res
    assert res["spill"] == 0 and res["tma"] and res["wgmma"], res
    assert res["shared"] <= 232448, res  # sm_90's per-block opt-in maximum


def test_rows_layout_addresses_comfyuis_views_without_a_copy(monkeypatch):
    """The descriptors' row views (pure torch, no GPU): a contiguous (B, H, N, D) tensor and ComfyUI's transposed
    (B, N, H, D) views are addressed in place, anything else is named for a copy, and the automatic choice leaves the
    latter (and k, v in different layouts) to the TMA kernels while an explicit Gluon call still takes them."""
    import torch
    from comfyui_sparse_attention.kernels import _hopper
    x = torch.arange(2 * 3 * 5 * 4, dtype=torch.float32).view(2, 3, 5, 4)
    t = x.transpose(1, 2).contiguous().transpose(1, 2)  # (B, N, H, D) memory seen as (B, H, N, D)
    packed = torch.zeros(2, 5, 3, 3, 4).select(3, 1).transpose(1, 2)  # q of a packed (B, N, H, 3, D) projection
    assert [_hopper.rows_layout(a) for a in (x, t, packed)] == ["bhnd", "bnhd", None]
    rows = t.transpose(1, 2).reshape(2 * 5, 3 * 4)  # row b*N + n, column h*D + d: the kernel's BNHD addressing
    assert torch.equal(rows[1 * 5 + 2, 2 * 4:3 * 4], x[1, 2, 2])
    # the rule on a pretend Hopper (this CPU has none): only the layouts differ between the calls below
    monkeypatch.setattr(_hopper, "device_capability", lambda t: (9, 0))
    monkeypatch.setattr(_hopper, "interpreting", lambda: False)
    monkeypatch.setattr(_hopper, "gluon_import_problem", lambda: None)
    n = _hopper.GLUON_MIN_TOKENS
    bhnd = torch.zeros(1, 2, n, 128, dtype=torch.bfloat16)
    bnhd = torch.zeros(1, n, 2, 128, dtype=torch.bfloat16).transpose(1, 2)
    odd = torch.zeros(1, n, 2, 3, 128, dtype=torch.bfloat16).select(3, 0).transpose(1, 2)
    assert _hopper.gluon_problem("gluon_dense", bhnd, bhnd, bhnd) is None
    assert _hopper.gluon_problem("gluon_dense", bnhd, bhnd, bhnd) is None  # q's layout is its own
    assert "layouts" in _hopper.gluon_problem("gluon_dense", bhnd, bhnd, bnhd)  # k and v differ
    assert "layouts" in _hopper.gluon_problem("gluon_dense", odd, bhnd, bhnd)
    assert _hopper.gluon_problem("gluon_dense", odd, bhnd, bnhd, auto=False) is None
    assert "under" in _hopper.gluon_problem("gluon_dense", bhnd[:, :, :n - 1], bhnd, bhnd)
