"""The Gluon Hopper kernels compiled for sm_90a on the CPU, every variant the dispatch can launch
(tools/compile_report.py): kernels/attention_gluon.py dense with and without LSE, block-sparse with each residual
(model dtype, fp8 with its scale, weighted by the mass), row order and both descriptor layouts, D 64 and 128
(``compile_gluon``); kernels/anchor_gluon.py's one-pass block anchor with each residual precision
(``compile_gluon_anchor``); kernels/token_sparse_gluon.py on int32 and compact lists with each residual
(``compile_gluon_token``).
Each must build without spilling and fit sm_90's shared memory. There is no interpreter for Gluon; the GPU tests
(tests/test_gpu_kernels.py) check the numbers against the twins, and the dispatch rules and the token launch's
arguments are checked here on the CPU."""

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
    "persistent, fp8 residual weighted by the mass": dict(dense=False, persistent=True, residual=2, mass=True),
    "persistent D64 bk64, lse, transposed q/k/v": dict(dense=False, persistent=True, d=64, block_k=64, lse=True,
                                                      q_bnhd=True, kv_bnhd=True),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_variant_compiles_for_hopper_without_spills(report, name):
    res = report.compile_gluon(**VARIANTS[name])
    assert "error" not in res, res
    assert res["spill"] == 0 and res["tma"] and res["wgmma"], res
    assert res["shared"] <= 232448, res  # sm_90's per-block opt-in maximum


ANCHOR_VARIANTS = {
    "fp8 residual, mass, lse": dict(),
    "fp8 residual, mass, no lse (the engine's anchor)": dict(lse=False),
    "model-dtype residual, no mass, no lse": dict(fp8=False, mass=False, lse=False),
    "D64 bk64 fp16, transposed q/k/v": dict(d=64, block_k=64, dtype="fp16", q_bnhd=True, kv_bnhd=True),
    "transposed k/v, fp8 residual": dict(kv_bnhd=True),
}


@pytest.mark.parametrize("name", list(ANCHOR_VARIANTS))
def test_every_anchor_variant_compiles_for_hopper_without_spills(report, name):
    """kernels/anchor_gluon.py: the two walks keep one accumulator (the sparse output waits in memory), so the
    consumers fit the dense kernel's register split without spilling."""
    res = report.compile_gluon_anchor(**ANCHOR_VARIANTS[name])
    assert "error" not in res, res
    assert res["spill"] == 0 and res["tma"] and res["wgmma"], res
    assert res["shared"] <= 232448, res


TOKEN_VARIANTS = {
    "int32 lists": dict(),
    "compact lists, fp8 residual": dict(compact=True, residual=2),
    "compact lists, model-dtype residual, fp16": dict(compact=True, residual=1, dtype="fp16"),
    "D64, fp8 residual": dict(d=64, residual=2),
    "D64 compact lists, model-dtype residual": dict(d=64, compact=True, residual=1),
    "64-wide tiles four deep (the benchmark's alternative)": dict(compact=True, residual=2, tiles=(64, 4)),
    "32-bit row offsets, int32 lists": dict(off32=True),
    "32-bit row offsets, compact lists, fp8 residual": dict(compact=True, residual=2, off32=True),
    "persistent, int32 lists": dict(persistent=True),
    "persistent, compact lists, fp8 residual": dict(persistent=True, compact=True, residual=2),
    "persistent, compact lists, model-dtype residual, fp16": dict(persistent=True, compact=True, residual=1,
                                                                 dtype="fp16"),
    "persistent, D64, fp8 residual": dict(persistent=True, d=64, residual=2),
}


@pytest.mark.parametrize("name", list(TOKEN_VARIANTS))
def test_every_token_variant_compiles_for_hopper_without_spills(report, name):
    """kernels/token_sparse_gluon.py: the gather loader (cp.async, four warps) and the block kernel's consumers fit
    the register split it asks for (LOADER) with at most a few spilled values, and sm_90's shared memory; the scores
    and PV are wgmma."""
    res = report.compile_gluon_token(**TOKEN_VARIANTS[name])
    assert "error" not in res, res
    # the loader keeps the next tile's ids across its waits: a few live values spill on the CPU's compile (Triton
    # 3.6, the device's: 0-40 bytes; 3.8: up to 184; docs/kernel_notes.md "v18"); the bound catches growth
    assert res["spill"] <= 256 and res["wgmma"] and not res["tma"], res
    assert res["shared"] <= 232448, res


@pytest.mark.parametrize("variant", [dict(), dict(compact=True, residual=2), dict(compact=True, residual=1)])
def test_token_loader_with_32_bit_offsets_spills_no_more(report, variant):
    """The loader's row offsets in 32 bits (OFF32) are there to take registers off the loader, which holds the next
    tile's ids and the copy addresses across its waits: compiled both ways, the 32-bit loader spills no more than the
    64-bit one (Triton 3.6, the device's: 40 -> 0 bytes with compact lists; docs/kernel_notes.md "v24")."""
    wide = report.compile_gluon_token(off32=False, **variant)
    narrow = report.compile_gluon_token(off32=True, **variant)
    assert "error" not in wide and "error" not in narrow, (wide, narrow)
    assert narrow["spill"] <= wide["spill"], (wide, narrow)


@pytest.fixture
def pretend_hopper(monkeypatch):
    """kernels/_hopper.py on a pretend Hopper with Gluon (this CPU has neither): (the module, GLUON_MIN_TOKENS, a
    contiguous (1, 2, N, 128) bf16 tensor, the same seen through ComfyUI's transposed (B, N, H, D) layout)."""
    import torch
    from comfyui_sparse_attention.kernels import _hopper
    monkeypatch.setattr(_hopper, "device_capability", lambda t: (9, 0))
    monkeypatch.setattr(_hopper, "interpreting", lambda: False)
    monkeypatch.setattr(_hopper, "gluon_import_problem", lambda module="attention_gluon": None)
    n = _hopper.GLUON_MIN_TOKENS
    return (_hopper, n, torch.zeros(1, 2, n, 128, dtype=torch.bfloat16),
            torch.zeros(1, n, 2, 128, dtype=torch.bfloat16).transpose(1, 2))


def test_gluon_token_rule_on_a_pretend_hopper(pretend_hopper):
    """Which token-sparse calls kernels/_hopper.py gives the Gluon token kernel (pure torch, no GPU): groups of 128,
    rows its 16-byte copies can read in place (ComfyUI's transposed views too), not an odd stride, and automatically
    only at head dim 128; an explicit call names the reason."""
    import torch
    _hopper, n, bhnd, bnhd = pretend_hopper
    odd = torch.zeros(1, 2, n, 131, dtype=torch.bfloat16)[..., :128]  # rows of 262 bytes
    assert _hopper.gluon_problem("gluon_token", bhnd, bhnd, bhnd) is None
    assert _hopper.gluon_problem("gluon_token", bnhd, bnhd, bhnd) is None
    assert "groups of 64" in _hopper.gluon_problem("gluon_token", bhnd, bhnd, bhnd, block_q=64)
    assert "16-byte" in _hopper.gluon_problem("gluon_token", bhnd, odd, bhnd)
    assert "under" in _hopper.gluon_problem("gluon_token", bhnd[:, :, :n - 1], bhnd, bhnd)
    d64 = torch.zeros(1, 2, n, 64, dtype=torch.bfloat16)  # measured slower than the pointer kernel: explicit only
    assert "head dim 64" in _hopper.gluon_problem("gluon_token", d64, d64, d64)
    assert _hopper.gluon_problem("gluon_token", d64, d64, d64, auto=False) is None
    with pytest.raises(ValueError, match="groups of 64"):
        _hopper.use_gluon("gluon_token", bhnd, bhnd, bhnd, block_q=64, path="gluon")


@pytest.mark.parametrize("precision,bk", [("fp8", 128), ("model", 64)])
def test_anchor_api_hands_the_gluon_anchor_its_arguments(pretend_hopper, monkeypatch, precision, bk):
    """kernels.api's block anchor on a pretend Hopper takes the Gluon one-pass anchor, which it hands the selected
    lists, their complements (together every KV block of a row exactly once), the output buffers in the shapes and
    dtypes the kernel writes, and the scale: a stand-in computing the twin from exactly what it is handed reproduces
    kernels/anchor_torch.py's dense output, LSE, residual and mass (pure torch, no GPU). Blocks the kernel cannot take
    are named."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    import torch
    from comfyui_sparse_attention.kernels import _residual, anchor_gluon, anchor_torch, api, block_sparse_torch
    from comfyui_sparse_attention.kernels import dense_torch
    _hopper, _, _, _ = pretend_hopper
    monkeypatch.setattr(_hopper, "GLUON_MIN_TOKENS", 256)
    monkeypatch.setattr(api, "choose", lambda *a: "triton")
    gen = torch.Generator().manual_seed(5)
    h, n, d = 2, 300, 128  # ragged: the last query and KV blocks are partial
    q, k, v = (torch.randn(1, h, n, d, generator=gen).to(torch.bfloat16) for _ in range(3))
    nqb, nkb = -(-n // 128), -(-n // bk)
    idx = torch.full((1, h, nqb, nkb), -1, dtype=torch.int32)
    cnt = torch.zeros((1, h, nqb), dtype=torch.int32)
    for hh in range(h):
        for r in range(nqb):
            keep = torch.sort(torch.randperm(nkb, generator=gen)[:(hh + r) % (nkb + 1)]).values
            idx[0, hh, r, :len(keep)] = keep.to(torch.int32)
            cnt[0, hh, r] = len(keep)  # rows from empty to every block
    seen = []

    def stand_in(q_, k_, v_, sel, sel_cnt, cmp, cmp_cnt, out, r_data, *, scale, block_k, lse, r_scale, mass):
        for row in range(sel.shape[2]):
            for hh in range(h):
                blocks = torch.cat([sel[0, hh, row, :sel_cnt[0, hh, row]], cmp[0, hh, row, :cmp_cnt[0, hh, row]]])
                assert torch.equal(torch.sort(blocks).values, torch.arange(nkb, dtype=torch.int32))
        assert out.shape == q_.shape and out.dtype == q_.dtype and lse is not None and lse.dtype == torch.float32
        assert (r_data.dtype == _residual.FP8) == (precision == "fp8") == (r_scale is not None)
        dense, dense_lse = dense_torch.attention_dense(q_, k_, v_, scale=scale, return_lse=True)
        sparse, sparse_lse = block_sparse_torch.block_sparse_attention(q_, k_, v_, sel, sel_cnt, block_q=128,
                                                                       block_k=block_k, scale=scale, return_lse=True)
        data, sc = _residual.encode_residual(dense, precision, q_.dtype, minus=sparse)
        out.copy_(dense)
        lse.copy_(dense_lse)
        r_data.copy_(data)
        if r_scale is not None:
            r_scale.copy_(sc)
        if mass is not None:
            mass.copy_(_residual.mass_of(dense_lse, sparse_lse))
        seen.append(scale)
        return out
    monkeypatch.setattr(anchor_gluon, "anchor", stand_in)
    got = api.block_anchor_attention(q, k, v, idx, cnt, block_q=128, block_k=bk, residual_precision=precision,
                                     return_lse=True, return_mass=True, scale=0.07)
    want = anchor_torch.block_anchor_attention(q, k, v, idx, cnt, block_q=128, block_k=bk, scale=0.07,
                                               residual_precision=precision, return_lse=True, return_mass=True)
    assert seen == [0.07]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for a, b in zip(got[2], want[2]):
        assert (a is None and b is None) or torch.equal(a.float().nan_to_num(), b.float().nan_to_num())
    assert "blocks 64x128" in _hopper.gluon_problem("gluon_anchor", q, k, v, block_q=64, block_k=128, auto=False)


def test_anchor_launch_binds_every_argument_to_its_parameter(monkeypatch):
    """``anchor_gluon.anchor`` launches ``_anchor_fwd`` with positional arguments: bound to the kernel's own
    parameter names (a stand-in for the launch, pure torch, no GPU), each lands where the kernel reads it."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    import torch
    from comfyui_sparse_attention.kernels import _residual, anchor_gluon
    names = anchor_gluon._anchor_fwd.arg_names
    seen = {}

    class Launch:
        def __getitem__(self, grid):
            def run(*args, **kw):
                seen.update(zip(names, args), **kw, grid=grid)
            return run
    monkeypatch.setattr(anchor_gluon, "_anchor_fwd", Launch())
    b, h, n, d, bk = 2, 3, 300, 64, 64
    q = torch.zeros(b, h, n, d, dtype=torch.float16)
    k = torch.zeros(b, n, h, d, dtype=torch.float16).transpose(1, 2)  # ComfyUI's transposed k/v
    nqb, nkb = 3, 5
    idx, cnt = torch.zeros(b, h, nqb, 2, dtype=torch.int32), torch.ones(b, h, nqb, dtype=torch.int32)
    cmp_idx, cmp_cnt = torch.zeros(b, h, nqb, nkb, dtype=torch.int32), torch.full((b, h, nqb), 4, dtype=torch.int32)
    out, lse = torch.empty_like(q), torch.empty(b, h, n)
    r_data, r_scale = torch.empty(b, h, n, d, dtype=_residual.FP8), torch.empty(b, h, n, 1)
    mass = torch.empty(b, h, n, 2)
    anchor_gluon.anchor(q, k, k, idx, cnt, cmp_idx, cmp_cnt, out, r_data, scale=0.5, block_k=bk, lse=lse,
                        r_scale=r_scale, mass=mass)
    assert set(names) <= set(seen), set(names) - set(seen)
    assert seen["Out"] is out and seen["Lse"] is lse and seen["R"] is r_data and seen["RS"] is r_scale
    assert seen["MS"] is mass and seen["IDX"] is idx and seen["CNT"] is cnt and seen["CIDX"] is cmp_idx
    assert seen["CCNT"] is cmp_cnt and seen["grid"] == (b * h * nqb,)
    assert (seen["H"], seen["N_Q"], seen["N_KV"], seen["NQB"], seen["MAX_K"], seen["MAX_C"]) == (h, n, n, nqb, 2, nkb)
    assert seen["qk_scale"] == pytest.approx(0.5 * 1.4426950408889634)
    assert seen["FP8_OUT"] and seen["MASS"] and seen["WRITE_LSE"] and not seen["Q_BNHD"] and seen["KV_BNHD"]
    assert (seen["BLOCK_N"], seen["HEAD_D"]) == (bk, d)
    with pytest.raises(ValueError, match="r_scale"):
        anchor_gluon.anchor(q, k, k, idx, cnt, cmp_idx, cmp_cnt, out, r_data, scale=0.5, block_k=bk)


def test_rows_layout_addresses_comfyuis_views_without_a_copy(request):
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
    _hopper, n, bhnd, bnhd = request.getfixturevalue("pretend_hopper")
    odd = torch.zeros(1, n, 2, 3, 128, dtype=torch.bfloat16).select(3, 0).transpose(1, 2)
    assert _hopper.gluon_problem("gluon_dense", bhnd, bhnd, bhnd) is None
    assert _hopper.gluon_problem("gluon_dense", bnhd, bhnd, bhnd) is None  # q's layout is its own
    assert "layouts" in _hopper.gluon_problem("gluon_dense", bhnd, bhnd, bnhd)  # k and v differ
    assert "layouts" in _hopper.gluon_problem("gluon_dense", odd, bhnd, bhnd)
    assert _hopper.gluon_problem("gluon_dense", odd, bhnd, bnhd, auto=False) is None
    assert "under" in _hopper.gluon_problem("gluon_dense", bhnd[:, :, :n - 1], bhnd, bhnd)


@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("path", ["auto", "gluon_persistent"])
def test_token_launch_hands_the_gluon_kernel_its_arguments(monkeypatch, compact, path):
    """token_sparse_triton's launch passes the Gluon token kernel the call's groups, lists (int32, or compact with
    their segment ends), counts, scale and contiguous residual in the order ``token_sparse_gluon.attention`` takes
    them: a stand-in computing the twin from exactly what it is handed reproduces the twin (pure torch, no GPU).
    The persistent grid is asked for by its path only."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.ampere")
    import torch
    from comfyui_sparse_attention.kernels import _hopper, compact_torch, token_sparse_gluon, token_sparse_torch
    from comfyui_sparse_attention.kernels import token_sparse_triton as tt
    gen = torch.Generator().manual_seed(3)
    b, h, n, d = 1, 2, 300, 64
    q, k, v = (torch.randn(b, h, n, d, generator=gen) for _ in range(3))
    groups = torch.randperm(384, generator=gen).view(1, 1, 3, 128).expand(b, h, 3, 128).contiguous().to(torch.int32)
    groups = torch.where(groups < n, groups, -1)
    keep = torch.rand(b, h, 3, n, generator=gen) < 0.3
    low, ends, cnt = compact_torch.compact_keep(keep)
    toks = compact_torch.decode_lists(low, ends).to(torch.int32)
    res = (torch.randn(b, h, n, d, generator=gen).to(torch.float8_e4m3fn), torch.rand(b, h, n, 1, generator=gen))
    seen = []

    def stand_in(q_, k_, v_, out, q_groups, lists, seg_ends, kv_counts, *, scale, segment, residual=None, tiles=None,
                 persistent=False):
        seen.append((seg_ends is not None, persistent))
        ids = lists if seg_ends is None else compact_torch.decode_lists(lists, seg_ends, segment=segment)
        out.copy_(token_sparse_torch.token_sparse_attention(q_, k_, v_, q_groups, ids, kv_counts, scale=scale,
                                                            residual=residual))
        return out
    monkeypatch.setattr(_hopper, "use_gluon", lambda *a, **kw: True)
    monkeypatch.setattr(token_sparse_gluon, "attention", stand_in)
    if compact:
        got = tt.token_sparse_attention_compact(q, k, v, groups, low, ends, cnt, scale=0.2, residual=res, path=path)
    else:
        got = tt.token_sparse_attention(q, k, v, groups, toks, cnt, scale=0.2, residual=res, path=path)
    want = token_sparse_torch.token_sparse_attention(q, k, v, groups, toks, cnt, scale=0.2, residual=res)
    assert seen == [(compact, path == "gluon_persistent")] and torch.allclose(got, want, atol=1e-5)


def test_a_failing_gluon_dense_call_falls_to_cudnn_at_once(monkeypatch):
    """kernels/api.py's automatic dense call: when the Gluon kernel fails (a compile error, simulated), that very call
    is answered by cuDNN, as every later one is, and the failure is remembered (pure torch, no GPU: the dispatch's
    device checks and cuDNN are stand-ins)."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    import torch
    from comfyui_sparse_attention.kernels import _hopper, api, attention_gluon, dense_cudnn
    monkeypatch.setattr(_hopper, "_broken", {})
    monkeypatch.setattr(api, "choose", lambda *a, **kw: "triton")
    monkeypatch.setattr(_hopper, "use_gluon", lambda kind, *a, **kw: kind not in _hopper._broken)
    tried = []

    def compile_error(*a, **kw):
        tried.append(1)
        raise RuntimeError("PTX assembly failed (simulated)")
    monkeypatch.setattr(attention_gluon, "attention", compile_error)
    answered = []
    monkeypatch.setattr(dense_cudnn, "supported", lambda q: True)
    monkeypatch.setattr(dense_cudnn, "attention_dense", lambda q, k, v, scale, return_lse: (
        answered.append(return_lse), (torch.full_like(q, 2.0), torch.zeros(q.shape[:3])))[1])
    q = torch.randn(1, 2, 64, 64)
    for _ in range(2):
        out, lse = api.attention_dense(q, q, q, return_lse=True)
        assert torch.equal(out, torch.full_like(q, 2.0))
    assert tried == [1] and answered == [True, True] and "gluon_dense" in _hopper.broken()


def test_the_persistent_gluon_kernel_is_asked_for_by_name_and_takes_block_lists_only():
    """``path="gluon_persistent"`` is an explicit choice that names why it cannot run here (no Hopper on this CPU),
    and the launcher refuses a dense call for the persistent grid before building anything."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    import torch
    from comfyui_sparse_attention.kernels import attention_gluon, block_sparse_triton
    q = torch.randn(1, 2, 256, 64)
    idx = torch.zeros(1, 2, 2, 1, dtype=torch.int32)
    cnt = torch.ones(1, 2, 2, dtype=torch.int32)
    assert "gluon_persistent" in block_sparse_triton.PATHS
    with pytest.raises(ValueError, match="Gluon kernel cannot take this call"):
        block_sparse_triton.block_sparse_attention(q, q, q, idx, cnt, block_q=128, block_k=128,
                                                   path="gluon_persistent")
    with pytest.raises(ValueError, match="block-sparse lists"):
        attention_gluon.attention(q, q, q, torch.empty_like(q), scale=0.125, persistent=True)


def test_residual_args_hand_the_epilogue_contiguous_rows():
    """Both Gluon launchers' residual arguments: the mode, and the data and fp8 scale made contiguous (the epilogue
    indexes them as the output's rows), the output standing in for what is absent."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    import torch
    from comfyui_sparse_attention.kernels import attention_gluon as ag
    out = torch.zeros(1, 2, 8, 4)
    data = torch.randn(1, 8, 2, 4).transpose(1, 2)  # a (B, N, H, D) view
    scale = torch.rand(1, 8, 2, 1).transpose(1, 2)
    mode, d, s = ag.residual_args((data, scale), out)
    assert mode == ag.RES_FP8 and d.is_contiguous() and s.is_contiguous() and torch.equal(d, data)
    assert ag.residual_args((data, None), out)[0] == ag.RES_MODEL and ag.residual_args((data, None), out)[2] is out
    assert ag.residual_args(None, out) == (ag.RES_NONE, out, out)


def test_token_loader_offsets_in_32_bits_only_where_they_fit():
    """kernels/token_sparse_gluon.py's OFF32 (the loader's row offsets in 32 bits) is taken only where every K and V
    row of a head lies within 2^31 elements of its start (shapes and strides only: meta tensors, no memory), and an
    explicit off32 beyond that is refused before any launch."""
    import torch
    tg = pytest.importorskip("comfyui_sparse_attention.kernels.token_sparse_gluon")

    def bnhd(n, h, d=128):  # ComfyUI's (B, N, H, D) memory seen as (B, H, N, D): a row's stride is H x D
        return torch.empty((1, n, h, d), device="meta").transpose(1, 2)
    assert tg.offsets_fit_32(bnhd(75600, 40), bnhd(75600, 40))  # Wan 14B 720p: 387 M elements
    assert tg.offsets_fit_32(bnhd(118800, 24), bnhd(118800, 24))  # HunyuanVideo 720p
    assert not tg.offsets_fit_32(bnhd(75600, 40), bnhd(419432, 40))  # its last row ends past 2^31
    n = 2**31 // 128  # contiguous (B, H, N, D): the last row ends exactly at 2^31
    assert tg.offsets_fit_32(*(torch.empty((1, 1, n, 128), device="meta"),) * 2) is False
    assert tg.offsets_fit_32(*(torch.empty((1, 1, n - 1, 128), device="meta"),) * 2)
    assert tg.offsets_fit_32(bnhd(419431, 40), bnhd(419431, 40))  # the last that fits
    big = bnhd(419432, 40)
    with pytest.raises(ValueError, match="32-bit offsets"):
        tg.attention(big, big, big, None, None, None, None, None, scale=1.0, segment=32768, off32=True)


def test_token_loader_flags_follow_the_kind_of_list(monkeypatch):
    """``token_sparse_gluon.attention`` launches the loader with the row offsets OFF32 gives the call's kind of list
    (int32 ids: 32-bit, measured faster; compact lists: 64-bit, measured slower in 32), never 32-bit offsets where
    K/V rows lie beyond them, and 32-bit ones where asked (a stand-in launch; no GPU)."""
    import torch
    tg = pytest.importorskip("comfyui_sparse_attention.kernels.token_sparse_gluon")
    launched = []

    class Launch:
        def __getitem__(self, grid):
            return lambda *args, **kw: launched.append(kw["OFF32"])
    monkeypatch.setattr(tg, "_token_fwd", Launch())
    q = torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16)
    groups = torch.zeros(1, 2, 2, 128, dtype=torch.int32)
    cnt = torch.ones(1, 2, 2, dtype=torch.int32)
    ids, low = torch.zeros(1, 2, 2, 16, dtype=torch.int32), torch.zeros(1, 2, 2, 16, dtype=torch.int16)
    ends = torch.full((1, 2, 2, 1), 16, dtype=torch.int32)
    big = torch.empty((1, 419432, 40, 128), dtype=torch.bfloat16, device="meta").transpose(1, 2)  # past 2^31
    kw = dict(scale=1.0, segment=32768)
    tg.attention(q, q, q, torch.empty_like(q), groups, ids, None, cnt, **kw)
    tg.attention(q, q, q, torch.empty_like(q), groups, low, ends, cnt, **kw)
    tg.attention(q, big, big, torch.empty_like(q), groups, ids, None, cnt, **kw)
    tg.attention(q, q, q, torch.empty_like(q), groups, low, ends, cnt, off32=True, **kw)
    assert launched == [True, False, False, True]
