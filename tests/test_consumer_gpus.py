"""The kernels of GPUs without TMA (Ampere, Ada, Blackwell's RTX cards), compiled for them on the CPU: no GPU needed.

The H200 runs the TMA kernels, so its GPU tests never compile these for the cards most users have. Triton compiles
for any target without one (tools/compile_report.py); what a kernel takes there is decided as the engine decides it
(kernels/_triton_common.py: an fp8 residual goes as its bytes where Triton has no fp8 type; docs/kernel_notes.md,
"v14").
"""


import pytest

triton = pytest.importorskip("triton")

# compute capability -> card (one each: A100, RTX 3090, RTX 4090, RTX 5090)
ARCHS = {80: "A100", 86: "RTX 30xx", 89: "RTX 40xx", 120: "RTX 50xx"}


@pytest.fixture(scope="module")
def report(compile_report_module):
    """tools/compile_report.py as a module (it compiles for any target without a GPU)."""
    return compile_report_module


def test_fp8_is_typed_only_from_compute_capability_8_9():
    from comfyui_sparse_attention.kernels._triton_common import fp8_typed_on
    assert [fp8_typed_on(c) for c in ((7, 5), (8, 0), (8, 6), (8, 7))] == [False] * 4
    assert [fp8_typed_on(c) for c in ((8, 9), (9, 0), (10, 0), (12, 0))] == [True] * 4
    assert fp8_typed_on(None)  # the interpreter
    assert not fp8_typed_on((9, 4), hip=True)  # ROCm: the bytes


@pytest.mark.parametrize("capability,mode", [((8, 6), 3), ((8, 0), 3), ((8, 9), 2), ((12, 0), 2)])
def test_a_reuse_call_passes_an_fp8_residual_as_bytes_below_8_9(monkeypatch, capability, mode):
    """What the kernels get for a CUDA device of each compute capability (the device's capability is asked once
    per device): fp8 typed from 8.9 on, else a uint8 view of the same memory."""
    import types

    import torch
    from comfyui_sparse_attention.kernels import _triton_common as C
    from comfyui_sparse_attention.kernels import backend
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    backend._capability.cache_clear()
    try:
        data = torch.zeros(1, 2, 4, 8).to(torch.float8_e4m3fn)
        scale = torch.ones(1, 2, 4, 1)
        # the kernels' view of a tensor on CUDA device 0: the same storage, its device read from .device
        cuda_data = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), view=data.view,
                                          stride=data.stride)
        assert C.residual_mode((cuda_data, scale)) == mode
        passed = C.residual_launch_args((cuda_data, scale), torch.zeros(1))[0]
        if mode == 3:
            assert passed.dtype == torch.uint8 and passed.data_ptr() == data.data_ptr()
        else:
            assert passed is cuda_data
    finally:
        backend._capability.cache_clear()


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_reuse_kernels_compile_for_consumer_gpus_and_one_candidate_does_not_spill(report, arch):
    """A reuse call's kernels (block-sparse with the mass-weighted fp8 residual, the token kernel with its compact
    lists) compile for the card with the residual as the engine passes it there, within its shared memory; and each
    has an autotune candidate that hardly spills (4 warps at BLOCK_M 128 and D 128 spill 0.8-4 KB a thread; the
    8-warp ones 0-8 bytes, by Triton version)."""
    limit = report.SMEM_LIMITS[arch]
    picked = {}
    for label, fn, types, ce, div, c in report.cases(["pointer", "token"], [128], ("plain",), mass=True, arch=arch):
        kind = label.split(" D")[0]
        if kind not in ("pointer sparse", "token compact") or c.num_warps != 8 or c.kwargs["BLOCK_N"] != 64 \
                or c.num_stages != 3:
            continue
        assert types["R"] == ("*fp8e4nv" if arch >= 89 else "*u8")
        assert ce["RESIDUAL"] == (2 if arch >= 89 else 3)
        picked[kind] = report.compile_one(fn, types, ce, div, c, arch)
    assert set(picked) == {"pointer sparse", "token compact"}
    for kind, r in picked.items():
        assert "error" not in r, (ARCHS[arch], kind, r)
        assert r["shared"] <= limit and r["spill"] <= 64, (ARCHS[arch], kind, r)


@pytest.mark.parametrize("capability,on_triton", [((7, 5), False), ((6, 1), False), ((8, 0), True), ((8, 6), True)])
def test_gpus_before_ampere_run_the_pytorch_backend(monkeypatch, capability, on_triton):
    """Triton supports NVIDIA GPUs from compute capability 8.0; compiled for sm_75 the kernels spill ~130 KB a thread
    and exceed a Turing program's shared memory, so a T4 or an RTX 20xx takes the PyTorch backend (logged once)."""
    import types

    import torch
    from comfyui_sparse_attention.kernels import backend
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(backend, "triton_available", lambda: True)
    backend._capability.cache_clear()
    try:
        t = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
        problem = backend.triton_problem("auto", t, None)
        assert (problem is None) == on_triton, problem
        if not on_triton:
            assert f"compute capability {capability[0]}.{capability[1]}" in problem
            assert backend.choose("auto", t, None, "block_sparse_attention") == "torch"
            with pytest.raises(ValueError, match="need 8.0"):
                backend.choose("triton", t, None, "block_sparse_attention")
    finally:
        backend._capability.cache_clear()


@pytest.mark.parametrize("arch", [90, 86])
def test_pass_two_compiles_with_a_candidate_that_does_not_spill(report, arch):
    """Pass 2 (kernels/mass_triton.py, both kernels: all queries of a group, and groups of 16 in one dot): every
    candidate compiles for Hopper (wgmma, TMA loads) and an RTX 30xx card within its shared memory, and each kernel has
    a candidate that spills nothing (on sm_86 the 8-group ones, first for Hopper, spill 16-24 bytes: kernel_notes
    "v22")."""
    clean = {}
    for label, fn, types, ce, div, c in report.cases(["mass"], [128], ("plain",), arch=arch):
        kind = label.split(" D")[0]
        r = report.compile_one(fn, types, ce, div, c, arch)
        assert "error" not in r, (arch, label, r)
        assert r["shared"] <= report.SMEM_LIMITS[arch], (arch, label, r)
        assert r["wgmma"] == (arch == 90) and r["tma"] == (arch == 90), (arch, label, r)
        clean[kind] = clean.get(kind, False) or r["spill"] == 0
    assert clean == {"mass": True, "mass16": True}, clean


@pytest.mark.parametrize("arch", [90, 80, 86, 89, 120])
def test_anchor_residual_kernel_compiles_without_spilling(report, arch):
    """kernels/residual_encode_triton.py (the anchor's residual in one pass) compiles for Hopper and the consumer
    cards, writing fp8 where Triton types it (the engine's residual) and the model's dtype elsewhere, at head dims 128
    and 64, with no spill (64 rows on 4 warps spilled on sm_90: kernel_notes "v23")."""
    got = list(report.cases(["residual"], [128, 64], ("plain",), arch=arch))
    assert len(got) == 2
    for label, fn, types, ce, div, c in got:
        assert ce["FP8_OUT"] == (arch >= 89), (arch, label)
        r = report.compile_one(fn, types, ce, div, c, arch)
        assert "error" not in r and r["spill"] == 0, (arch, label, r)
