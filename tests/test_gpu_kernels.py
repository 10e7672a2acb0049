"""Triton kernels at real sizes on a CUDA GPU (marker gpu): against the PyTorch twins and against
``scaled_dot_product_attention`` on an explicit mask (sampled query rows at long N), bf16."""

import math

import pytest
import torch
import torch.nn.functional as F

from comfyui_sparse_attention import kernels as K

pytestmark = pytest.mark.gpu
DEV = "cuda"


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def qkv(h, n, d, seed, dtype=torch.bfloat16):
    g = torch.Generator(device=DEV).manual_seed(seed)
    pos = torch.arange(n, device=DEV, dtype=torch.float32).view(n, 1)
    feat = torch.sin(pos * torch.linspace(0.001, 0.5, d, device=DEV).view(1, d))
    q = (torch.randn(1, h, n, d, device=DEV, generator=g) + feat).to(dtype)
    k = (torch.randn(1, h, n, d, device=DEV, generator=g) + feat).to(dtype)
    v = torch.randn(1, h, n, d, device=DEV, generator=g).to(dtype)
    return q, k, v


def random_lists(h, nqb, nkb, count, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    scores = torch.rand(1, h, nqb, nkb, device=DEV, generator=g)
    scores[..., 0] = 2.0  # a sink column always kept
    idx = torch.sort(torch.topk(scores, count, dim=-1).indices, -1).values.to(torch.int32).contiguous()
    cnt = torch.full((1, h, nqb), count, dtype=torch.int32, device=DEV)
    cnt[0, 0, 1] = 0  # one empty row
    return idx, cnt


def sdpa_rows(q, k, v, rows, allow_rows):
    """SDPA (explicit boolean mask) for the query rows ``rows``; allow_rows: (1,H,len(rows),N)."""
    out = F.scaled_dot_product_attention(q[:, :, rows].float(), k.float(), v.float(), attn_mask=allow_rows)
    return torch.nan_to_num(out, nan=0.0)


@pytest.mark.parametrize("n,d", [(4133, 64), (32768, 128), (120000, 64), (120000, 128)])
def test_dense_matches_sdpa(n, d):
    h = 4 if n < 100000 else 2
    q, k, v = qkv(h, n, d, seed=n + d)
    out, lse = K.attention_dense(q, k, v, return_lse=True, backend="triton")
    ref = F.scaled_dot_product_attention(q, k, v)
    assert not torch.isnan(out).any()
    assert rel(out, ref) <= 1e-2
    rows = torch.arange(0, n, 997, device=DEV)
    s = (q[:, :, rows].float() @ k.float().transpose(-1, -2)) * d ** -0.5
    assert torch.allclose(lse[:, :, rows], torch.logsumexp(s, -1), atol=2e-2)


@pytest.mark.parametrize("n,d,bq,bk", [(32768, 128, 128, 128), (32768, 64, 64, 128), (120000, 128, 128, 64),
                                       (75600, 64, 128, 128)])
def test_block_sparse_matches_sdpa_and_twin(n, d, bq, bk):
    h = 2
    q, k, v = qkv(h, n, d, seed=n + bq)
    nqb, nkb = math.ceil(n / bq), math.ceil(n / bk)
    idx, cnt = random_lists(h, nqb, nkb, max(2, nkb // 8), seed=bk)
    out = K.block_sparse_attention(q, k, v, idx, cnt, block_q=bq, block_k=bk, backend="triton")
    assert not torch.isnan(out).any()
    assert torch.equal(out[0, 0, bq:2 * bq], torch.zeros_like(out[0, 0, bq:2 * bq]))
    twin = K.block_sparse_attention(q, k, v, idx, cnt, block_q=bq, block_k=bk, backend="torch")
    assert rel(out, twin) <= 1e-2
    qblocks = torch.tensor([0, 2, nqb // 2, nqb - 1], device=DEV)
    rows = (qblocks.view(-1, 1) * bq + torch.arange(bq, device=DEV)).view(-1)
    rows = rows[rows < n]
    blk = torch.zeros(1, h, nqb, nkb, dtype=torch.bool, device=DEV)
    valid = torch.arange(idx.shape[-1], device=DEV) < cnt.unsqueeze(-1)
    blk.scatter_(3, torch.where(valid, idx.long(), 0), valid)
    allow = blk[:, :, rows // bq].repeat_interleave(bk, -1)[..., :n]
    assert rel(out[:, :, rows], sdpa_rows(q, k, v, rows, allow)) <= 1e-2


@pytest.mark.parametrize("n,d,c", [(32768, 128, 128), (120000, 64, 128), (32768, 64, 64)])
def test_token_sparse_matches_sdpa_and_twin(n, d, c):
    h = 2
    q, k, v = qkv(h, n, d, seed=n + c)
    groups = K.group_queries(q, c)
    g = groups.shape[2]
    sel = int(0.15 * n)
    gen = torch.Generator(device=DEV).manual_seed(3)
    toks = torch.sort(torch.topk(torch.rand(1, h, g, n, device=DEV, generator=gen), sel, dim=-1).indices, -1).values
    toks, cnt = toks.to(torch.int32).contiguous(), torch.full((1, h, g), sel, dtype=torch.int32, device=DEV)
    out = K.token_sparse_attention(q, k, v, groups, toks, cnt, backend="triton")
    assert not torch.isnan(out).any()
    twin = K.token_sparse_attention(q, k, v, groups, toks, cnt, backend="torch")
    assert rel(out, twin) <= 1e-2
    for gi in (0, g // 2, g - 1):
        rows = groups[0, 0, gi].long()
        rows = rows[rows >= 0]
        allow = torch.zeros(1, 1, rows.numel(), n, dtype=torch.bool, device=DEV)
        allow[..., toks[0, 0, gi, :cnt[0, 0, gi]].long()] = True
        ref = sdpa_rows(q[:, :1], k[:, :1], v[:, :1], rows, allow)
        assert rel(out[:, :1, rows], ref) <= 1e-2


@pytest.mark.parametrize("n,c", [(75600, 128), (32760, 64)])
def test_grouping_at_real_sizes(monkeypatch, n, c):
    """kernels/grouping_torch.py on the GPU at Wan sizes: an equal partition, and groups as tight with the long
    segments' directions taken from a subsample as with every point (within-group scatter of the queries)."""
    from comfyui_sparse_attention.kernels import grouping_torch
    h, d = 2, 128
    gen = torch.Generator(device=DEV).manual_seed(n)
    centers = torch.randn(h, 48, d, device=DEV, generator=gen) * 3  # clusters shuffled along the sequence
    labels = torch.randint(0, 48, (h, n), device=DEV, generator=gen)
    q = (torch.gather(centers, 1, labels.unsqueeze(-1).expand(h, n, d))
         + 0.3 * torch.randn(h, n, d, device=DEV, generator=gen)).unsqueeze(0).to(torch.bfloat16)
    sub = K.group_queries(q, c)
    g = -(-n // c)
    assert sub.shape == (1, h, g, c) and sub.dtype == torch.int32
    for hi in range(h):
        flat = sub[0, hi].reshape(-1)
        assert torch.equal(torch.sort(flat[flat >= 0]).values, torch.arange(n, device=DEV, dtype=torch.int32))
    monkeypatch.setattr(grouping_torch, "SUBSAMPLE", 1 << 30)
    exact = K.group_queries(q, c)

    def within(groups):
        idx = groups[0, :, :-1].long()  # the full groups
        x = torch.stack([q[0, hi].float()[idx[hi]] for hi in range(h)])
        return float(((x - x.mean(2, keepdim=True)) ** 2).sum())

    assert within(sub) <= 1.05 * within(exact)


@pytest.mark.parametrize("n,p", [(75600, 0.15), (118800, 0.02), (4133, 0.5)])
def test_compact_keep_matches_twin_at_real_sizes(n, p):
    """kernels/compact_triton.py against its twin on a Wan 14B / HunyuanVideo anchor's mask (3 heads' groups),
    with an empty and a full row."""
    gen = torch.Generator(device=DEV).manual_seed(n)
    keep = torch.rand(1, 3, -(-n // 64), n, device=DEV, generator=gen) < p
    keep[0, 0, 0] = False
    keep[0, 1, 5] = True
    got = K.compact_keep(keep, backend="triton")
    want = K.compact_keep(keep, backend="torch")
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("n,d", [(32768, 128), (120000, 64)])
def test_group_kv_mass_matches_twin_with_bounded_memory(n, d):
    h = 1
    q, k, v = qkv(h, n, d, seed=7)
    _, lse = K.attention_dense(q, k, v, return_lse=True, backend="triton")
    groups = K.group_queries(q, 128)
    # first calls autotune (the autotuner's timing scratch is not the kernel's memory)
    K.group_kv_mass(q, k, lse, groups, backend="triton")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    tok = K.group_kv_mass(q, k, lse, groups, backend="triton")
    peak = torch.cuda.max_memory_allocated() - base
    out_bytes = tok.numel() * 4
    assert peak <= out_bytes + (64 << 20)  # nothing beyond the outputs (+ small scratch)
    real = (groups >= 0).sum(-1).float()
    assert torch.allclose(tok.sum(-1), real, rtol=2e-2)
    gsub = groups[:, :, :8]
    twin = K.group_kv_mass(q, k, lse, gsub, backend="torch")
    assert rel(tok[:, :, :8], twin) <= 1e-2


def test_auto_dense_uses_a_fast_path_with_lse():
    q, k, v = qkv(4, 8192, 128, seed=11)
    out, lse = K.attention_dense(q, k, v, return_lse=True)  # auto: cuDNN when available
    ref, ref_lse = K.attention_dense(q, k, v, return_lse=True, backend="triton")
    assert rel(out, ref) <= 1e-2
    assert torch.allclose(lse, ref_lse, atol=2e-2)
    assert lse.shape == (1, 4, 8192) and lse.dtype == torch.float32


# ---- Hopper (TMA) variants, fused residuals, anchor, pass 2: each against its twin at real sizes ----

def _is_hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


needs_hopper = pytest.mark.skipif(not _is_hopper(), reason="needs a Hopper GPU (TMA kernels)")


def skewed_lists(h, nqb, nkb, count, seed):
    """random_lists plus a few dense rows (text/sink-like) and one empty row."""
    idx, cnt = random_lists(h, nqb, nkb, count, seed)
    full = torch.arange(nkb, dtype=torch.int32, device=DEV)
    wide = torch.full((1, h, nqb, nkb), -1, dtype=torch.int32, device=DEV)
    wide[..., :idx.shape[-1]] = idx
    for row in (0, nqb // 3, nqb - 1):
        wide[0, :, row] = full
        cnt[0, :, row] = nkb
    return wide.contiguous(), cnt


def make_residual(kind, shape, seed):
    if kind == "none":
        return None
    g = torch.Generator(device=DEV).manual_seed(seed)
    diff = torch.randn(shape, device=DEV, generator=g) * 0.05
    if kind == "bf16":
        return diff.to(torch.bfloat16), None
    s = (diff.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12)
    return (diff / s).to(torch.float8_e4m3fn), s


def decoded(res):
    return res[0].float() if res[1] is None else res[0].float() * res[1]


_TWINS = {}


@needs_hopper
@pytest.mark.parametrize("path", ["tma", "persistent", "warp_spec", "pointer"])
@pytest.mark.parametrize("n,d,bq,bk,res_kind", [(32760, 128, 128, 128, "fp8"), (75600, 64, 128, 128, "bf16"),
                                                 (4133, 80, 64, 128, "none"), (20000, 128, 64, 64, "bf16")])
def test_block_sparse_variants_match_twin(path, n, d, bq, bk, res_kind):
    from comfyui_sparse_attention.kernels import block_sparse_torch, block_sparse_triton
    h = 2
    q, k, v = qkv(h, n, d, seed=n + d)
    nqb, nkb = math.ceil(n / bq), math.ceil(n / bk)
    idx, cnt = skewed_lists(h, nqb, nkb, max(2, nkb // 8), seed=bk + d)
    res = make_residual(res_kind, q.shape, seed=n)
    try:
        out = block_sparse_triton.block_sparse_attention(q, k, v, idx, cnt, block_q=bq, block_k=bk, residual=res,
                                                         path=path)
    except Exception as exc:  # a variant that does not compile here is reported, not fatal
        if path == "warp_spec":
            pytest.skip(f"warp_spec variant did not compile: {type(exc).__name__}: {str(exc)[:200]}")
        raise
    assert not torch.isnan(out).any()
    key = (n, d, bq, bk, res_kind)
    if key not in _TWINS:  # one twin run per case serves every path
        _TWINS[key] = block_sparse_torch.block_sparse_attention(q, k, v, idx, cnt, block_q=bq, block_k=bk,
                                                                residual=res)
    assert rel(out, _TWINS[key]) <= 1e-2
    empty = out[0, 0, bq:2 * bq]  # query block 1 of head 0 has an empty list
    want = torch.zeros_like(empty) if res is None else decoded(res)[0, 0, bq:2 * bq].to(out.dtype)
    assert torch.equal(empty, want)


@needs_hopper
@pytest.mark.parametrize("path", ["tma", "persistent"])
@pytest.mark.parametrize("n,d", [(32768, 128), (75600, 128), (4133, 64), (20000, 96)])
def test_dense_tma_matches_sdpa(path, n, d):
    from comfyui_sparse_attention.kernels import dense_triton
    h = 2
    q, k, v = qkv(h, n, d, seed=n + 3 * d)
    out, lse = dense_triton.attention_dense(q, k, v, return_lse=True, path=path)
    ref = F.scaled_dot_product_attention(q, k, v)
    assert not torch.isnan(out).any() and rel(out, ref) <= 1e-2
    rows = torch.arange(0, n, 997, device=DEV)
    s = (q[:, :, rows].float() @ k.float().transpose(-1, -2)) * d ** -0.5
    assert torch.allclose(lse[:, :, rows], torch.logsumexp(s, -1), atol=2e-2)


@needs_hopper
@pytest.mark.parametrize("precision", ["model", "fp8"])
@pytest.mark.parametrize("n,d,bq,bk,path", [(32760, 128, 128, 128, "tma"), (75600, 128, 128, 128, "persistent"),
                                             (4133, 64, 64, 64, "tma")])
def test_anchor_matches_dense_and_sparse(precision, n, d, bq, bk, path, monkeypatch):
    from comfyui_sparse_attention.kernels import anchor_triton, block_sparse_torch
    monkeypatch.setenv("SPARSE_ATTN_GLUON", "0")  # the public primitive's TMA paths (the Gluon anchor has its test)
    h = 2
    q, k, v = qkv(h, n, d, seed=n + 5)
    nqb, nkb = math.ceil(n / bq), math.ceil(n / bk)
    idx, cnt = skewed_lists(h, nqb, nkb, max(2, nkb // 4), seed=bq)
    out, lse, res = anchor_triton.block_anchor_attention(q, k, v, idx, cnt, block_q=bq, block_k=bk,
                                                         residual_precision=precision, return_lse=True, path=path)
    ref, ref_lse = K.attention_dense(q, k, v, return_lse=True)  # cuDNN
    sparse = block_sparse_torch.block_sparse_attention(q, k, v, idx, cnt, block_q=bq, block_k=bk)
    assert not torch.isnan(out).any() and rel(out, ref) <= 1e-2
    assert torch.allclose(lse, ref_lse, atol=2e-2)
    assert rel(decoded(res), ref.float() - sparse.float()) <= (2e-2 if precision == "model" else 6e-2)
    # the public primitive takes the fused kernel on Hopper and agrees
    out2, res2 = K.block_anchor_attention(q, k, v, idx, cnt, block_q=bq, block_k=bk, residual_precision=precision)
    from comfyui_sparse_attention.kernels import _hopper
    assert "anchor" not in _hopper.broken()
    assert rel(out2, out) <= 1e-2 and rel(decoded(res2), decoded(res)) <= 6e-2


@needs_hopper
def test_fp8_residual_store_rounds_as_torch_and_keeps_non_finite_nan():
    """On the GPU the residual epilogues cast to fp8 without the interpreter's software rounding: the codes equal
    torch's (ties to even, subnormals; Triton's fp32 division may move a random value by one step), and an inf or
    NaN in the residual leaves NaN in its own element, where the hardware's saturating cast would give 448
    (tests/fp8_store_check.py)."""
    import fp8_store_check
    r = fp8_store_check.check(DEV)
    assert r["scale_rel"] <= 1e-6 and r["codes_equal"] >= 0.999 and r["max_steps"] <= 1, r
    # the ties reach the cast exactly only where Triton's fp32 division gave the row scale 448 / 448 = 1 exactly
    assert r["ties_equal"] or not r["ties_scale_exact"], r
    assert r["nan_where_nonfinite"] and r["finite_elsewhere"], r


@needs_hopper
@pytest.mark.parametrize("precision", ["model", "fp8"])
@pytest.mark.parametrize("n,d,bq,bk", [(32760, 128, 128, 128), (75600, 128, 128, 128), (4133, 64, 64, 64),
                                       (20000, 96, 64, 128)])
def test_anchor_residual_epilogue_matches_twin(precision, n, d, bq, bk, monkeypatch):
    """Low-density anchors (lists narrower than kernels/api.py's FUSED_ANCHOR_ABOVE): the dense call plus the TMA
    block-sparse kernel forming R and the mass in its epilogue, against the twin, on an empty row, short rows and
    ragged N; through kernels.api (the Gluon anchor off: test_gluon_anchor_matches_twin has it) the composed path
    runs, not the fused pass, and its output is the dense one."""
    from comfyui_sparse_attention.kernels import _hopper, anchor_torch, anchor_triton, api
    monkeypatch.setenv("SPARSE_ATTN_GLUON", "0")
    h = 2
    q, k, v = qkv(h, n, d, seed=n + 9)
    nqb, nkb = math.ceil(n / bq), math.ceil(n / bk)
    idx, cnt = random_lists(h, nqb, nkb, max(2, int(0.08 * nkb)), seed=d)
    cnt[0, 1, ::3] = 1  # short rows: the sink block only
    dense, lse = K.attention_dense(q, k, v, return_lse=True)  # cuDNN
    got = anchor_triton.block_residual(q, k, v, idx, cnt, dense, lse, block_q=bq, block_k=bk,
                                       residual_precision=precision, return_mass=True)
    want = anchor_torch.block_residual(q, k, v, idx, cnt, dense, lse, block_q=bq, block_k=bk,
                                       residual_precision=precision, return_mass=True)
    assert not torch.isnan(decoded(got[:2])).any()
    assert rel(decoded(got[:2]), decoded(want[:2])) <= (2e-2 if precision == "model" else 6e-2)
    empty = decoded(got[:2])[0, 0, bq:2 * bq]  # query block 1 of head 0 kept nothing: R is the dense output
    assert rel(empty, dense[0, 0, bq:2 * bq].float()) <= (1e-2 if precision == "model" else 4e-2)
    live = (want[2][..., 1] > math.log(1e-3)) & (got[2][..., 1] > math.log(1e-3))
    assert live.float().mean() > 0.5 and not torch.isnan(got[2]).any()
    assert (got[2] - want[2])[live].abs().max() < 2e-2
    calls = []
    real = {name: getattr(anchor_triton, name) for name in ("block_anchor_attention", "block_residual")}

    def api_anchor(lists, counts, **kw):  # kernels.api's anchor, recording which Triton path it took
        for name, fn in real.items():
            setattr(anchor_triton, name, lambda *a, name=name, fn=fn, **k_: calls.append(name) or fn(*a, **k_))
        try:
            return K.block_anchor_attention(q, k, v, lists, counts, block_q=bq, block_k=bk,
                                            residual_precision=precision, **kw)
        finally:
            for name, fn in real.items():
                setattr(anchor_triton, name, fn)
    out, res = api_anchor(idx, cnt, return_mass=True)
    assert idx.shape[-1] <= api.FUSED_ANCHOR_ABOVE * nkb and calls == ["block_residual"]
    assert "residual" not in _hopper.broken()
    assert rel(out, dense) <= 1e-3 and rel(decoded(res[:2]), decoded(got[:2])) <= 1e-3
    # a dense row (text) makes the lists as wide as the KV blocks: the stated density still picks the composed path
    wide = torch.full((1, h, nqb, nkb), -1, dtype=torch.int32, device=DEV)
    wide[..., :idx.shape[-1]] = idx
    wide[0, :, 0] = torch.arange(nkb, dtype=torch.int32, device=DEV)
    wcnt = cnt.clone()
    wcnt[0, :, 0] = nkb
    calls.clear()
    out, res = api_anchor(wide, wcnt, density=0.1)
    twin = anchor_torch.block_residual(q, k, v, wide, wcnt, dense, lse, block_q=bq, block_k=bk,
                                       residual_precision=precision)
    assert calls == ["block_residual"] and rel(out, dense) <= 1e-3
    assert rel(decoded(res), decoded(twin)) <= (2e-2 if precision == "model" else 6e-2)


@pytest.mark.parametrize("res_kind", ["bf16", "fp8"])
def test_token_sparse_residual_matches_twin(res_kind):
    n, d, c, h = 32768, 128, 128, 2
    q, k, v = qkv(h, n, d, seed=21)
    groups = K.group_queries(q, c)
    g = groups.shape[2]
    sel = int(0.15 * n)
    gen = torch.Generator(device=DEV).manual_seed(4)
    toks = torch.sort(torch.topk(torch.rand(1, h, g, n, device=DEV, generator=gen), sel, dim=-1).indices, -1).values
    toks, cnt = toks.to(torch.int32).contiguous(), torch.full((1, h, g), sel, dtype=torch.int32, device=DEV)
    lost = groups.clone()
    lost[0, 1, 3] = -1  # queries in no group get exactly the residual
    res = make_residual(res_kind, q.shape, seed=5)
    out = K.token_sparse_attention(q, k, v, lost, toks, cnt, backend="triton", residual=res)
    twin = K.token_sparse_attention(q, k, v, lost, toks, cnt, backend="torch", residual=res)
    assert not torch.isnan(out).any() and rel(out, twin) <= 1e-2
    rows = groups[0, 1, 3].long()
    assert torch.equal(out[0, 1, rows], decoded(res)[0, 1, rows].to(out.dtype))


@pytest.mark.parametrize("n,res_kind", [(75600, "fp8"), (118800, None)])
def test_compact_token_lists_decode_in_the_kernel(n, res_kind):
    """The engine's cached int16 lists (kernels.compact_keep, two segments at these lengths) run through the token
    kernel, which decodes them in registers: equal to the kernel and the twin on the decoded int32 lists."""
    from comfyui_sparse_attention.kernels.compact_torch import decode_lists
    d, c, h = 128, 128, 2
    q, k, v = qkv(h, n, d, seed=n)
    groups = K.group_queries(q, c)
    g = groups.shape[2]
    gen = torch.Generator(device=DEV).manual_seed(7)
    keep = torch.rand(1, h, g, n, device=DEV, generator=gen) < 0.15
    keep[0, 0, 5] = False  # a group with nothing to attend
    low, ends, cnt = K.compact_keep(keep)
    assert ends.shape[-1] == 2 and low.shape[-1] % 16 == 0
    res = None if res_kind is None else make_residual(res_kind, q.shape, seed=3)
    out = K.token_sparse_attention_compact(q, k, v, groups, low, ends, cnt, backend="triton", residual=res)
    toks = decode_lists(low, ends)
    plain = K.token_sparse_attention(q, k, v, groups, toks, cnt, backend="triton", residual=res)
    twin = K.token_sparse_attention(q, k, v, groups, toks, cnt, backend="torch", residual=res)
    assert not torch.isnan(out).any() and rel(out, plain) <= 1e-3 and rel(out, twin) <= 1e-2


@pytest.mark.parametrize("path", ["pointer", "tma"])
def test_group_kv_mass_paths_match_twin(path):
    from comfyui_sparse_attention.kernels import mass_triton
    if path == "tma" and not _is_hopper():
        pytest.skip("needs a Hopper GPU (TMA kernels)")
    n, d, h = 32760, 128, 2
    q, k, v = qkv(h, n, d, seed=8)
    _, lse = K.attention_dense(q, k, v, return_lse=True)
    groups = K.group_queries(q, 128)
    out = mass_triton.group_kv_mass(q, k, lse, groups, path=path)
    twin = K.group_kv_mass(q, k, lse, groups[:, :, :8], backend="torch")
    assert not torch.isnan(out).any() and rel(out[:, :, :8], twin) <= 1e-2
    real = (groups >= 0).sum(-1).float()
    assert torch.allclose(out.sum(-1), real, rtol=2e-2)


@pytest.mark.parametrize("path", ["pointer", "tma"])
@pytest.mark.parametrize("n", [32760, 75600])
def test_packed_groups_of_16_match_twin(path, n):
    """mass_queries: groups of 16 queries, several to a program (75 600 tokens: 591 groups, not a multiple of eight,
    so the last program is padded; 32 760: 256, none)."""
    from comfyui_sparse_attention.kernels import mass_triton
    if path == "tma" and not _is_hopper():
        pytest.skip("needs a Hopper GPU (TMA kernels)")
    q, k, v = qkv(2, n, 128, seed=9)
    _, lse = K.attention_dense(q, k, v, return_lse=True)
    sub = K.group_queries(q, 128)[..., ::8].contiguous()
    out = mass_triton.group_kv_mass(q, k, lse, sub, path=path)
    assert out.shape == (1, 2, sub.shape[2], n) and not torch.isnan(out).any()
    last = sub.shape[2] - 3
    for rows in (slice(0, 6), slice(last, None)):
        assert rel(out[:, :, rows], K.group_kv_mass(q, k, lse, sub[:, :, rows], backend="torch")) <= 1e-2
    real = (sub >= 0).sum(-1).float()
    assert torch.allclose(out.sum(-1), real, rtol=2e-2)



@pytest.mark.parametrize("cfg", range(len(__import__("comfyui_sparse_attention.kernels.mass_triton",
                                                         fromlist=["x"]).PACKED_CONFIGS)))
def test_every_packed_mass_config_matches_twin(cfg):
    """Each configuration of the one-dot packed kernel (kernels/mass_triton.py ``_mass_packed_fwd``, 4 or 8 groups
    of 16 a program, with and without the polynomial half) at Wan 14B's group count (591 groups: padded to 592), on
    the TMA path where the GPU has it: the twin's masses on the first and last groups, each group's total mass."""
    from comfyui_sparse_attention.kernels import mass_triton
    tuner = mass_triton._mass_packed_fwd
    every = list(tuner.configs)
    q, k, v = qkv(2, 75600, 128, seed=10)
    _, lse = K.attention_dense(q, k, v, return_lse=True)
    sub = K.group_queries(q, 128)[..., ::8].contiguous()
    tuner.configs = [mass_triton.PACKED_CONFIGS[cfg]]
    tuner.cache.clear()
    try:
        out = mass_triton.group_kv_mass(q, k, lse, sub)
    finally:
        tuner.configs = every
        tuner.cache.clear()
    assert out.shape == (1, 2, sub.shape[2], 75600) and not torch.isnan(out).any()
    for rows in (slice(0, 6), slice(sub.shape[2] - 3, None)):
        assert rel(out[:, :, rows], K.group_kv_mass(q, k, lse, sub[:, :, rows], backend="torch")) <= 1e-2
    assert torch.allclose(out.sum(-1), (sub >= 0).sum(-1).float(), rtol=2e-2)

def test_keep_at_threshold_kernel_matches_twin_at_real_size():
    """kernels/threshold_triton.py at Wan 14B's anchor rows: a view of a padded mass buffer (591 of 600 groups,
    75 600 keys), a sampled threshold with underflowed zeros tied to it in one head (ties overflow the room there),
    equal to the twin; keep_top through both backends equal; with a cap every row is over (docs/kernel_notes.md,
    "v27"), equal to the twin and never above it; no host synchronisation in the kernel's call, capped or not."""
    from comfyui_sparse_attention.engine.block_geometry import keep_bound, keep_top
    g = torch.Generator(device=DEV).manual_seed(4)
    buf = torch.rand(1, 3, 600, 75600, device=DEV, generator=g) ** 8
    buf[0, 1, :, 5000:] = 0.0
    mass = buf[:, :, :591]
    k = 11340
    cols = torch.arange(0, 75600, 75600 // 4096, device=DEV)[:4096]
    thresh = torch.topk(mass[..., cols], round(k * 4096 / 75600), dim=-1).values[..., -1:]
    twin = K.keep_at_threshold(mass, thresh, k, backend="torch")
    out = K.keep_at_threshold(mass, thresh, k, backend="triton")
    assert torch.equal(out, twin)
    assert torch.equal(keep_top(mass, k, backend="triton"), keep_top(mass, k, backend="torch"))
    # a cap every row is over (a threshold of 0): each row's raised threshold bisected in its program, as the twin
    cap = keep_bound(k, 75600)
    low = torch.zeros_like(thresh)
    capped = K.keep_at_threshold(mass, low, k, cap=cap, backend="triton")
    assert torch.equal(capped, K.keep_at_threshold(mass, low, k, cap=cap, backend="torch"))
    # never over the cap; head 0's rows keep exactly the entries above their (cap + 1)-th largest value, which is
    # cap of them unless values tie there (rand() ** 8 in fp32 repeats values: one row kept cap - 1 on an H100)
    assert int(capped.sum(-1).max()) <= cap
    row = mass[0, 0]
    above = (row > torch.topk(row, cap + 1, dim=-1).values[..., -1:]).sum(-1)
    assert torch.equal(capped[0, 0].sum(-1), above) and int(above.min()) >= cap - 2
    kept_low = torch.where(capped[0, 0], row, torch.full_like(row, float("inf"))).amin(-1)
    left_high = torch.where(capped[0, 0], torch.full_like(row, -1.0), row).amax(-1)
    assert bool((kept_low > left_high).all())  # the largest entries, none skipped
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        K.keep_at_threshold(mass, thresh, k, backend="triton")
        K.keep_at_threshold(mass, low, k, cap=cap, backend="triton")
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_grouping_on_leading_directions_at_real_size():
    """group_queries(dims=32) at 75 600 tokens, D 128, bf16: an equal partition, the same groups with the Triton row
    gather as with index_select, groups about as tight in the full space as dims 0 on structured queries, and
    (after the first call builds the level plan) no host synchronisation."""
    q, _, _ = qkv(4, 75600, 128, seed=21)
    full = K.group_queries(q, 128)
    ours = K.group_queries(q, 128, dims=32)
    assert ours.shape == full.shape
    # the row gathers on the Triton kernel (auto) or index_select (torch): the same rows, the same groups
    assert torch.equal(ours, K.group_queries(q, 128, dims=32, backend="torch"))
    assert torch.equal(full, K.group_queries(q, 128, backend="torch"))
    flat = ours[0, 2].reshape(-1)
    assert torch.equal(torch.sort(flat[flat >= 0]).values, torch.arange(75600, device=DEV, dtype=torch.int32))

    def scatter(groups):
        idx = groups[0, :, :-1].long()  # the full groups
        x = torch.gather(q[0].float(), 1, idx.reshape(4, -1, 1).expand(4, -1, 128)).view(4, -1, 128, 128)
        return float(((x - x.mean(2, keepdim=True)) ** 2).sum())
    assert scatter(ours) <= 1.1 * scatter(full)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        K.group_queries(q, 128, dims=32)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@needs_hopper
def test_dispatch_takes_tma_only_when_aligned():
    from comfyui_sparse_attention.kernels import _hopper
    q, k, v = qkv(2, 8192, 128, seed=13)
    assert _hopper.use_tma("sparse", k, v)
    wide = torch.zeros(1, 2, 8192, 132, dtype=k.dtype, device=DEV)  # rows 264 bytes apart: no TMA
    wide[..., :128] = k
    assert not _hopper.use_tma("sparse", wide[..., :128], v)
    idx, cnt = random_lists(2, 64, 64, 8, seed=1)
    out = K.block_sparse_attention(q, wide[..., :128], v, idx, cnt, block_q=128, block_k=128, backend="triton")
    ref = K.block_sparse_attention(q, k, v, idx, cnt, block_q=128, block_k=128, backend="triton")
    assert rel(out, ref) <= 1e-3


@pytest.mark.parametrize("method", ["block_topk", "mc_sparse"])
def test_engine_reuse_under_inference_mode_on_the_triton_kernels(method):
    """As ComfyUI runs it: anchor and reuse calls under torch.inference_mode (cached selections are inference
    tensors, which have no version counter) on the Triton path, against the same calls on the PyTorch twins."""
    from comfyui_sparse_attention.engine import CallContext, SparseConfig, SparseEngine, TokenLayout
    layout = TokenLayout(grid=(4, 32, 64))
    q0, k0, v0 = qkv(4, 8192, 128, seed=5)
    q1, k1, v1 = qkv(4, 8192, 128, seed=6)
    outs = {}
    for backend in ("triton", "torch"):
        eng = SparseEngine(SparseConfig(method=method, density=0.15, min_tokens=0, backend=backend, residual=True))
        with torch.inference_mode():
            eng.begin_run()
            eng.attend(q0, k0, v0, CallContext(layer=0, step=0, layout=layout))
            outs[backend] = [eng.attend(q1, k1, v1, CallContext(layer=0, step=s, layout=layout)) for s in (1, 2)]
            t = eng.end_run().totals()
        assert t["anchors"] == 1 and t["reuses"] == 2 and t["fallbacks"] == 0
    assert torch.equal(outs["triton"][0], outs["triton"][1])  # the remembered row order changes nothing
    assert rel(outs["triton"][1], outs["torch"][1]) <= 2e-2


@needs_hopper
@pytest.mark.parametrize("path", ["tma", "persistent", "warp_spec", "pointer"])
@pytest.mark.parametrize("n,d", [(32760, 128), (75600, 128), (4133, 64)])
def test_lazy_rescale_matches_eager_at_real_sizes(monkeypatch, n, d, path):
    """SPARSE_ATTN_RESCALE=lazy (kernels/_triton_common.py): block-sparse with an fp8 residual and dense + LSE on
    every kernel variant, the fused anchor (TMA variants) and the token-sparse kernel agree with the eager kernels
    and with the twins."""
    from comfyui_sparse_attention.kernels import (anchor_triton, block_sparse_torch, block_sparse_triton,
                                                  dense_triton)
    h, bq = 2, 128 if d == 128 else 64
    q, k, v = qkv(h, n, d, seed=n + 11)
    k = k * torch.linspace(0.5, 1.5, n, device=DEV).view(1, 1, n, 1).to(k.dtype)  # maxima that keep climbing
    nb = math.ceil(n / bq)
    idx, cnt = skewed_lists(h, nb, nb, max(2, nb // 8), seed=d)
    res = make_residual("fp8", q.shape, seed=3)
    outs = {}
    for mode in ("eager", "lazy"):
        monkeypatch.setenv("SPARSE_ATTN_RESCALE", mode)
        try:
            got = dict(
                sparse=block_sparse_triton.block_sparse_attention(q, k, v, idx, cnt, block_q=bq, block_k=bq,
                                                                  residual=res, path=path),
                dense=dense_triton.attention_dense(q, k, v, return_lse=True, path=path))
        except Exception as exc:  # as test_block_sparse_variants_match_twin: warp_spec may not compile here
            if path == "warp_spec":
                pytest.skip(f"warp_spec variant did not compile: {type(exc).__name__}: {str(exc)[:200]}")
            raise
        if path in ("tma", "persistent"):
            got["anchor"] = anchor_triton.block_anchor_attention(q, k, v, idx, cnt, block_q=bq, block_k=bq,
                                                                 residual_precision="model", return_lse=True,
                                                                 path=path)
        outs[mode] = got
    lazy, eager = outs["lazy"], outs["eager"]
    twin = block_sparse_torch.block_sparse_attention(q, k, v, idx, cnt, block_q=bq, block_k=bq, residual=res)
    assert not torch.isnan(lazy["sparse"]).any()
    assert rel(lazy["sparse"], twin) <= 1e-2 and rel(lazy["sparse"], eager["sparse"]) <= 1e-2
    assert rel(lazy["dense"][0], F.scaled_dot_product_attention(q, k, v)) <= 1e-2
    assert torch.allclose(lazy["dense"][1], eager["dense"][1], atol=2e-2)
    if "anchor" in lazy:  # dense output, LSE, residual (data, scale)
        assert rel(lazy["anchor"][0], eager["anchor"][0]) <= 1e-2
        assert torch.allclose(lazy["anchor"][1], eager["anchor"][1], atol=2e-2)
        assert rel(decoded(lazy["anchor"][2]), decoded(eager["anchor"][2])) <= 2e-2
    if path == "tma":  # the token kernel has one variant; it runs lazy (the mode set last)
        groups = K.group_queries(q, 128)
        g, sel = groups.shape[2], int(0.15 * n)
        gen = torch.Generator(device=DEV).manual_seed(9)
        toks = torch.topk(torch.rand(1, h, g, n, device=DEV, generator=gen), sel, -1).indices
        toks = torch.sort(toks, -1).values.to(torch.int32).contiguous()
        tcnt = torch.full((1, h, g), sel, dtype=torch.int32, device=DEV)
        token = K.token_sparse_attention(q, k, v, groups, toks, tcnt, backend="triton")
        assert not torch.isnan(token).any()
        assert rel(token, K.token_sparse_attention(q, k, v, groups, toks, tcnt, backend="torch")) <= 1e-2


@needs_hopper
@pytest.mark.parametrize("path", ["tma", "persistent"])
@pytest.mark.parametrize("n,d", [(32760, 128), (75600, 128), (4133, 64)])
def test_scores_ahead_matches_plain_at_real_sizes(monkeypatch, n, d, path):
    """SPARSE_ATTN_LOOP=ahead (kernels/_triton_common.py, loop_ahead): block-sparse with an fp8 residual, dense + LSE
    and the fused anchor on the TMA variants, and the token kernel on int32 and compact lists, agree with the plain
    loops and with the twins on skewed lists (empty, short and full rows)."""
    from comfyui_sparse_attention.kernels import (anchor_triton, block_sparse_torch, block_sparse_triton,
                                                  dense_triton)
    from comfyui_sparse_attention.kernels.compact_torch import decode_lists
    h, bq = 2, 128 if d == 128 else 64
    q, k, v = qkv(h, n, d, seed=n + 13)
    nb = math.ceil(n / bq)
    idx, cnt = skewed_lists(h, nb, nb, max(2, nb // 8), seed=d + 1)
    res = make_residual("fp8", q.shape, seed=4)
    groups = K.group_queries(q, 128 if d == 128 else 64)
    gen = torch.Generator(device=DEV).manual_seed(11)
    keep = torch.rand(1, h, groups.shape[2], n, device=DEV, generator=gen) < 0.15
    keep[0, 0, 1] = False  # a group with nothing to attend
    keep[0, 1, 2, :70] = True  # a few lists of other lengths
    low, ends, tcnt = K.compact_keep(keep)
    toks = decode_lists(low, ends)
    outs = {}
    for mode in ("plain", "ahead"):
        monkeypatch.setenv("SPARSE_ATTN_LOOP", mode)
        outs[mode] = dict(
            sparse=block_sparse_triton.block_sparse_attention(q, k, v, idx, cnt, block_q=bq, block_k=bq,
                                                              residual=res, path=path),
            dense=dense_triton.attention_dense(q, k, v, return_lse=True, path=path),
            anchor=anchor_triton.block_anchor_attention(q, k, v, idx, cnt, block_q=bq, block_k=bq,
                                                        residual_precision="fp8", return_lse=True, path=path),
            token=K.token_sparse_attention(q, k, v, groups, toks, tcnt, backend="triton", residual=res),
            compact=K.token_sparse_attention_compact(q, k, v, groups, low, ends, tcnt, backend="triton",
                                                     residual=res))
    ahead, plain = outs["ahead"], outs["plain"]
    twin = block_sparse_torch.block_sparse_attention(q, k, v, idx, cnt, block_q=bq, block_k=bq, residual=res)
    assert not torch.isnan(ahead["sparse"]).any()
    assert rel(ahead["sparse"], twin) <= 1e-2 and rel(ahead["sparse"], plain["sparse"]) <= 1e-3
    assert rel(ahead["dense"][0], F.scaled_dot_product_attention(q, k, v)) <= 1e-2
    assert torch.allclose(ahead["dense"][1], plain["dense"][1], atol=1e-3)
    assert rel(ahead["anchor"][0], plain["anchor"][0]) <= 1e-3
    assert torch.allclose(ahead["anchor"][1], plain["anchor"][1], atol=1e-3)
    assert rel(decoded(ahead["anchor"][2]), decoded(plain["anchor"][2])) <= 2e-2
    token_twin = K.token_sparse_attention(q, k, v, groups, toks, tcnt, backend="torch", residual=res)
    for kind in ("token", "compact"):
        assert not torch.isnan(ahead[kind]).any()
        assert rel(ahead[kind], plain[kind]) <= 1e-3 and rel(ahead[kind], token_twin) <= 1e-2


@needs_hopper
@pytest.mark.parametrize("path", ["tma", "pointer"])
@pytest.mark.parametrize("n,d", [(32760, 128), (75600, 128), (4133, 64)])
def test_mass_weighted_residual_at_real_sizes(n, d, path):
    """The fused anchor's mass against the twin's (rows where the anchor left out at least 0.1 % of the mass; below
    that the weight multiplies a residual of that size), and a reuse call weighted by one mass on the kernel against
    the twin, on skewed lists (empty, short and full rows); the weighting moves the output."""
    from comfyui_sparse_attention.kernels import (anchor_torch, anchor_triton, block_sparse_torch,
                                                  block_sparse_triton)
    h, bq = 2, 128 if d == 128 else 64
    q, k, v = qkv(h, n, d, seed=n + 17)
    nb = math.ceil(n / bq)
    idx, cnt = skewed_lists(h, nb, nb, max(2, nb // 8), seed=d + 2)
    kern = anchor_triton.block_anchor_attention(q, k, v, idx, cnt, block_q=bq, block_k=bq, residual_precision="fp8",
                                                return_mass=True)
    twin = anchor_torch.block_anchor_attention(q, k, v, idx, cnt, block_q=bq, block_k=bq, residual_precision="fp8",
                                               return_mass=True)
    live = (twin[1][2][..., 1] > math.log(1e-3)) & (kern[1][2][..., 1] > math.log(1e-3))
    assert live.float().mean() > 0.5 and not torch.isnan(kern[1][2]).any()
    assert (kern[1][2] - twin[1][2])[live].abs().max() < 2e-2
    q2 = (q.float() * 1.1).to(q.dtype)
    got, lse = block_sparse_triton.block_sparse_attention(q2, k, v, idx, cnt, block_q=bq, block_k=bq,
                                                          residual=twin[1], path=path, return_lse=True)
    want, want_lse = block_sparse_torch.block_sparse_attention(q2, k, v, idx, cnt, block_q=bq, block_k=bq,
                                                               residual=twin[1], return_lse=True)
    fixed = block_sparse_torch.block_sparse_attention(q2, k, v, idx, cnt, block_q=bq, block_k=bq,
                                                      residual=twin[1][:2])
    fin = torch.isfinite(want_lse)
    assert torch.equal(fin, torch.isfinite(lse)) and (lse - want_lse)[fin].abs().max() < 2e-2
    assert not torch.isnan(got).any()
    assert rel(got, want) <= 1e-2 and rel(want, fixed) > 3 * rel(got, want)


TUNE_CHILD = r"""
import importlib.util, json, sys, time, torch
spec = importlib.util.spec_from_file_location("comfyui_sparse_attention", sys.argv[1] + "/__init__.py",
                                              submodule_search_locations=[sys.argv[1]])
pack = importlib.util.module_from_spec(spec); sys.modules["comfyui_sparse_attention"] = pack
spec.loader.exec_module(pack)
from comfyui_sparse_attention import kernels as K
from comfyui_sparse_attention.kernels import attention_hopper, token_sparse_triton
benched = []
tuners = [token_sparse_triton._token_fwd, attention_hopper._kernel("sparse")]
for t in tuners:  # count the configurations each autotuner times (Triton keeps its timing function in _do_bench)
    inner = t._do_bench
    t._do_bench = lambda fn, quantiles=None, _inner=inner: (benched.append(1), _inner(fn, quantiles=quantiles))[1]
g = torch.Generator(device="cuda").manual_seed(0)
h, n, d = 4, 32768, 128
q, k, v = (torch.randn(1, h, n, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
groups = K.group_queries(q, 128)
gn = groups.shape[2]
toks = torch.sort(torch.rand(1, h, gn, n, device="cuda", generator=g).topk(2000, -1).indices, -1).values.int()
cnt = torch.full((1, h, gn), 2000, dtype=torch.int32, device="cuda")
nb = n // 128
idx = torch.sort(torch.rand(1, h, nb, nb, device="cuda", generator=g).topk(40, -1).indices, -1).values.int()
bcnt = torch.full((1, h, nb), 40, dtype=torch.int32, device="cuda")
t0 = time.perf_counter()
a = K.token_sparse_attention(q, k, v, groups, toks, cnt, backend="triton", validate=False)
b = K.block_sparse_attention(q, k, v, idx, bcnt, block_q=128, block_k=128, backend="triton")
torch.cuda.synchronize()
print("RESULT:" + json.dumps(dict(benched=len(benched), seconds=time.perf_counter() - t0,
                                  sums=[float(a.float().sum()), float(b.float().sum())])))
"""


def test_tunings_are_read_back_by_a_new_process(tmp_path):
    """The autotuners keep their tunings on disk (kernels/_triton_common.py, tune_options): a second process with the
    same Triton cache times no configuration and computes the same outputs. With the Gluon kernels off: on Hopper
    they take these calls (32 768 tokens, D 128) and tune nothing, while the autotuned Triton kernels serve what they
    do not (shorter sequences, other head dims, other GPUs)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "SPARSE_ATTN_TUNE"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    env["SPARSE_ATTN_GLUON"] = "0"
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", TUNE_CHILD, str(root)], env=env, capture_output=True, text=True,
                              timeout=600)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT:")]
        assert proc.returncode == 0 and lines, proc.stderr[-4000:]
        runs.append(json.loads(lines[-1][7:]))
    first, second = runs
    assert first["benched"] > 2 and second["benched"] == 0, runs
    assert second["sums"] == first["sums"]


def _pool_cache(monkeypatch, n=12288):
    """A SelectionCache on a pool of its own (engine/pinned_pool.py) and a maker of entries with fp8 residuals of
    2 x 8 x n x 128 bytes (24 MiB at n = 12288: torch's allocator would take 32 MiB)."""
    from comfyui_sparse_attention.engine import SparseConfig, TokenLayout, cache as cache_mod
    from comfyui_sparse_attention.engine.cache import Entry, SelectionCache
    from comfyui_sparse_attention.engine.pinned_pool import PinnedPool
    from comfyui_sparse_attention.engine.policy_static import build_static
    from comfyui_sparse_attention.engine.residual import Residual

    pool = PinnedPool()
    monkeypatch.setattr(cache_mod, "POOL", pool)
    monkeypatch.setattr(cache_mod, "host_memory", lambda: None)
    sel = build_static(2, 8, n, TokenLayout(grid=(3, 64, 64)), SparseConfig(block_q=64, block_k=64), DEV)

    def entry(seed, importance=0.1):
        g = torch.Generator(device=DEV).manual_seed(seed)
        data = torch.randn(2, 8, n, 128, device=DEV, generator=g).to(torch.float8_e4m3fn)
        return Entry(sel, Residual(data, torch.rand(2, 8, n, 1, device=DEV, generator=g)), importance=importance)
    return pool, SelectionCache, entry


def same_bytes(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_host_entries_live_in_exact_size_page_locked_buffers_recycled_across_anchors(monkeypatch):
    """The cache's host side on a real GPU: residuals go to page-locked buffers of exactly their size, come back
    exact, a later anchor's entry under the same key reuses the buffer with its own data, and the buffers a run did
    not use are freed at its end."""
    import time

    pool, SelectionCache, entry = _pool_cache(monkeypatch)
    n = 12288
    cache = SelectionCache(device_budget=0, cpu_budget=1 << 34, offload=True)
    keys = [(layer, True, (), n) for layer in range(3)]
    first = [entry(i) for i in range(3)]
    try:
        for key, e in zip(keys, first):
            assert cache.put(key, e) == "cpu"
        host = cache.on_cpu[keys[0]].residual.data
        assert pool.owns(host) and host.is_pinned() and pool.held_bytes >= 3 * host.numel()
        for key, e in zip(keys, first):
            assert same_bytes(cache.get(key, DEV).residual.data, e.residual.data)
        later = entry(10)
        ptr = cache.on_cpu[keys[1]].residual.data.data_ptr()
        assert cache.put(keys[1], later) == "cpu"  # a later anchor replaces it: the buffer is recycled
        assert cache.on_cpu[keys[1]].residual.data.data_ptr() == ptr
        back = cache.get(keys[1], DEV)
        assert same_bytes(back.residual.data, later.residual.data) and torch.equal(back.residual.scale,
                                                                                   later.residual.scale)
        held = pool.held_bytes
        cache.clear()  # end of the run: the buffers stay for the next run, free
        assert pool.free_bytes == pool.held_bytes == held
        cache.put(keys[0], entry(20))
        cache.clear()
        assert pool.held_bytes < held  # the buffers the second run did not use were unregistered and freed
    finally:
        cache.reset()
        pool.trim(since=time.monotonic())  # this pool is the test's own: nothing stays page-locked
        assert pool.held_bytes == 0


def test_a_recycled_host_buffer_is_written_only_after_the_prefetch_reading_it(monkeypatch):
    """A prefetch still copying a host residual to the GPU (held back on its side stream), then a more important
    newcomer takes that residual's room and its buffer: the newcomer's copy into the buffer waits for the prefetch,
    so the prefetched copy, which the next call uses, keeps the old residual."""
    import time

    pool, SelectionCache, entry = _pool_cache(monkeypatch)
    n = 12288
    keys = [(layer, True, (), n) for layer in range(2)]
    a, b = entry(0, importance=0.2), entry(1, importance=0.01)
    # room for both entries and one more selection: the newcomer needs exactly b's residual to give way
    cache = SelectionCache(device_budget=0, cpu_budget=2 * a.nbytes + b.selection.nbytes, offload=True)
    try:
        assert cache.put(keys[0], a) == "cpu" and cache.put(keys[1], b) == "cpu"
        cache.get(keys[0], DEV), cache.get(keys[1], DEV)
        cache.new_step()  # the next step prefetches keys[1] when keys[0] is used
        cache._stream = torch.cuda.Stream()
        with torch.cuda.stream(cache._stream):
            torch.cuda._sleep(2_000_000_000)  # ~1 s: the prefetch's copy waits behind it
        cache.get(keys[0], DEV)
        assert keys[1] in cache.prefetched
        ptr = cache.on_cpu[keys[1]].residual.data.data_ptr()
        newcomer = entry(2, importance=0.5)
        assert cache.put((5, True, (), n), newcomer) == "cpu"  # keys[1]'s residual gave way
        assert cache.on_cpu[keys[1]].residual is None and cache.on_cpu[keys[0]].residual is not None
        assert cache.on_cpu[(5, True, (), n)].residual.data.data_ptr() == ptr
        prefetched = cache.get(keys[1], DEV)
        torch.cuda.synchronize()
        assert same_bytes(prefetched.residual.data, b.residual.data)
        assert same_bytes(cache.get((5, True, (), n), DEV).residual.data, newcomer.residual.data)
    finally:
        cache.reset()
        pool.trim(since=time.monotonic())
        assert pool.held_bytes == 0


def test_packed_host_residuals_take_the_halves_of_the_fp8_buffers_they_replace(monkeypatch):
    """residual_precision "auto" on a real GPU with host room for six residuals at 4 bits but three at fp8: the layers
    after the third are packed with the stored ones, each packed residual in half of a page-locked fp8 buffer the
    packing freed (engine/pinned_pool.py: cut buffers inside one registered region), and every one comes back
    exactly as packing it on the GPU gives; a later anchor's packed residuals take the same buffers."""
    import time

    pool, SelectionCache, entry = _pool_cache(monkeypatch)
    n = 12288
    keys = [(layer, True, (), n) for layer in range(6)]
    first = [entry(i) for i in range(6)]
    room = 6 * (first[0].nbytes - first[0].residual.packing_frees) + 100
    assert 3 * first[0].nbytes < room < 4 * first[0].nbytes
    cache = SelectionCache(device_budget=0, cpu_budget=room, offload=True, pack_when_short=True)
    try:
        for key, e in zip(keys, first):
            assert cache.put(key, e) == "cpu"
        regions = set(pool._regions)
        assert len(regions) <= 4, regions  # three fp8 buffers cut in halves, and the first packing's own
        for key, e in zip(keys, first):
            stored = cache.on_cpu[key].residual
            assert stored.packed and pool.owns(stored.data) and stored.data.is_pinned()
            assert same_bytes(cache.get(key, DEV).residual.data, e.residual.pack().data)
        later = [entry(10 + i) for i in range(6)]
        for key, e in zip(keys, later):
            assert cache.put(key, e) == "cpu"
        assert set(pool._regions) <= regions and cache.counters["residual_dropped"] == 0  # nothing locked anew
        torch.cuda.synchronize()
        for key, e in zip(keys, later):
            assert same_bytes(cache.get(key, DEV).residual.data, e.residual.pack().data)
    finally:
        cache.reset()
        pool.trim(since=time.monotonic())
        assert pool.held_bytes == 0


def test_a_host_copy_that_fails_midway_gives_its_buffers_back_after_their_copies(monkeypatch):
    """Entry.pinned runs out of host memory at its second tensor: the buffer the first one took goes back to the pool
    with an event on the stream its copy was issued on, so the pool neither writes nor unregisters it under that
    copy; the error propagates."""
    pool, _, entry = _pool_cache(monkeypatch)
    from comfyui_sparse_attention.engine import cache as cache_mod
    e = entry(0)
    calls = []
    real = pool.empty

    def empty_then_out_of_memory(shape, dtype, device=None):  # after the first pooled buffer (the residual's)
        if any(calls):
            raise RuntimeError("out of host memory (simulated)")
        out = real(shape, dtype, device)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(pool, "empty", empty_then_out_of_memory)
    token = object()
    with pytest.raises(RuntimeError, match="simulated"):
        cache_mod.Entry(e.selection, e.residual, importance=0.1).pinned(token)
    free = [b for b in pool._buffers.values() if not b.in_use]
    assert len(free) == 1 and token in free[0].owners and free[0].events  # waited for before reuse or unregistering
    torch.cuda.synchronize()
    pool.trim(since=float("inf"))
    assert pool.held_bytes == 0


def test_a_refused_page_lock_leaves_no_cuda_error_behind():
    """cudaHostRegister on a range already registered fails; its error must not surface in the next kernel."""
    from comfyui_sparse_attention.engine.pinned_pool import _cuda_register, _cuda_unregister

    base = torch.empty(1 << 20, dtype=torch.uint8)
    assert _cuda_register(base.data_ptr(), base.numel())
    try:
        assert not _cuda_register(base.data_ptr(), base.numel())
        assert float((torch.ones(8, device=DEV) * 3).sum()) == 24.0
    finally:
        _cuda_unregister(base.data_ptr())
    assert float((torch.ones(8, device=DEV) * 2).sum()) == 16.0


@pytest.mark.parametrize("path", ["tma", "persistent", "pointer", "token"])
def test_fast_launch_relaunch_matches_tritons_own_path(monkeypatch, path):
    """kernels/fast_launch.py: once a key was seen, the compiled kernel is relaunched directly with the new call's
    tensors, and gives exactly what Triton's own launch gives; a misaligned q (what Triton specialises on) makes a
    new key that goes through Triton's path, correct too."""
    from comfyui_sparse_attention.kernels import block_sparse_triton, fast_launch
    if path in ("tma", "persistent") and not _is_hopper():
        pytest.skip("needs a Hopper GPU (TMA kernels)")
    n, d, h = 8192, 128, 4
    q0, k0, v0 = qkv(h, n, d, seed=31)
    q1, k1, v1 = qkv(h, n, d, seed=32)
    res = make_residual("fp8", q0.shape, seed=6)
    if path == "token":
        groups = K.group_queries(q0, 128)
        sel = int(0.15 * n)
        gen = torch.Generator(device=DEV).manual_seed(7)
        toks = torch.sort(torch.topk(torch.rand(1, h, groups.shape[2], n, device=DEV, generator=gen), sel,
                                     dim=-1).indices, -1).values.to(torch.int32).contiguous()
        cnt = torch.full((1, h, groups.shape[2]), sel, dtype=torch.int32, device=DEV)

        def call(q, k, v):
            return K.token_sparse_attention(q, k, v, groups, toks, cnt, backend="triton", residual=res)
    else:
        idx, cnt = skewed_lists(h, n // 128, n // 128, 10, seed=5)

        def call(q, k, v):
            return block_sparse_triton.block_sparse_attention(q, k, v, idx, cnt, block_q=128, block_k=128,
                                                              residual=res, path=path)
    fast_launch.reset()
    call(q0, k0, v0)  # tunes and compiles through Triton's path; the key is remembered
    assert fast_launch.counts() == {"direct": 0, "normal": 1, "replayed": 0}
    fast = call(q1, k1, v1)
    assert fast_launch.counts() == {"direct": 1, "normal": 1, "replayed": 0}, "the seen key did not relaunch directly"
    monkeypatch.setenv("SPARSE_ATTN_FAST_LAUNCH", "0")
    own = call(q1, k1, v1)
    assert torch.equal(fast, own)
    monkeypatch.delenv("SPARSE_ATTN_FAST_LAUNCH")
    buf = torch.empty(q1.numel() + 1, dtype=q1.dtype, device=DEV)
    odd = buf[1:].view(q1.shape)  # 2 bytes off a 16-byte boundary
    odd.copy_(q1)
    before = fast_launch.counts()
    shifted = call(odd, k1, v1)
    assert fast_launch.counts()["normal"] == before["normal"] + 1
    assert rel(shifted, own) <= 1e-3
    assert torch.equal(call(odd, k1, v1), shifted) and fast_launch.counts()["direct"] == before["direct"] + 1


def test_mc_reuse_writes_every_row_without_the_fill(monkeypatch):
    """An mc_sparse selection covers every row (groups and dense text rows): its reuse call skips the kernel's
    decode pass of the residual and gives exactly what the call with the pass gives."""
    import dataclasses

    from comfyui_sparse_attention.engine import CallContext, SparseConfig, SparseEngine, TokenLayout
    from comfyui_sparse_attention.kernels import token_sparse_triton
    layout = TokenLayout(text_len=256, grid=(4, 32, 62))
    q0, k0, v0 = qkv(4, 8192, 128, seed=41)
    q1, k1, v1 = qkv(4, 8192, 128, seed=42)
    eng = SparseEngine(SparseConfig(method="mc_sparse", density=0.15, min_tokens=0, residual=True))
    decodes = []
    real = token_sparse_triton.decode_into
    monkeypatch.setattr(token_sparse_triton, "decode_into", lambda out, res: decodes.append(1) or real(out, res))
    with torch.inference_mode():
        eng.begin_run()
        eng.attend(q0, k0, v0, CallContext(layer=0, step=0, layout=layout))
        key = CallContext(layer=0, step=0, layout=layout).key(8192)
        entry = eng.cache.on_device[key]
        assert entry.selection.covers_all and entry.selection.dense_rows.numel() == 256
        # a NaN tensor freed at once: the reuse call's output likely lands on its memory, so a row left out shows
        torch.full_like(q1, float("nan"))
        skipped = eng.attend(q1, k1, v1, CallContext(layer=0, step=1, layout=layout))
        assert not decodes and torch.isfinite(skipped).all()
        filled = dataclasses.replace(entry.selection, covers_all=False).run(q1, k1, v1, residual=entry.residual)
        assert decodes
        eng.end_run()
    assert torch.equal(skipped, filled)


@pytest.mark.parametrize("path", ["pointer", "token"])
def test_fast_launch_takes_each_calls_grid(path):
    """A batch of 2 has a batch of 1's strides, so the direct relaunch's key is the same; the grid (which the
    pointer and token kernels size by the batch, taking no B argument) must be the call's own: both batch rows
    computed. (The TMA kernel takes its row count as an argument: a new key.)"""
    from comfyui_sparse_attention.kernels import block_sparse_triton, fast_launch
    n, d, h = 4096, 128, 2
    one = qkv(h, n, d, seed=51)
    two = tuple(torch.cat([t, u]) for t, u in zip(one, qkv(h, n, d, seed=52)))
    if path == "token":
        groups = K.group_queries(one[0], 128)
        toks = torch.arange(0, n, 5, device=DEV, dtype=torch.int32).expand(1, h, groups.shape[2], -1).contiguous()
        cnt = torch.full((1, h, groups.shape[2]), toks.shape[-1], dtype=torch.int32, device=DEV)

        def call(q, k, v):
            b = q.shape[0]
            return K.token_sparse_attention(q, k, v, groups.expand(b, -1, -1, -1).contiguous(),
                                            toks.expand(b, -1, -1, -1).contiguous(),
                                            cnt.expand(b, -1, -1).contiguous(), backend="triton")
    else:
        idx, cnt = skewed_lists(h, n // 128, n // 128, 6, seed=9)

        def call(q, k, v):
            b = q.shape[0]
            return block_sparse_triton.block_sparse_attention(
                q, k, v, idx.expand(b, -1, -1, -1).contiguous(), cnt.expand(b, -1, -1).contiguous(), block_q=128,
                block_k=128, path=path)
    fast_launch.reset()
    call(*one)
    call(*one)
    assert fast_launch.counts()["direct"] == 1
    out = call(*two)
    assert fast_launch.counts()["direct"] == 2, "the batch of 2 did not share the batch of 1's key"
    assert torch.equal(out[:1], call(*one))
    assert torch.equal(out[1:], call(*(t[1:] for t in two)))


@pytest.mark.parametrize("method", ["block_topk", "mc_sparse"])
def test_engine_reuse_calls_are_replayed_and_equal_the_call_itself(method):
    """kernels/replay.py on the real kernels: an engine's reuse calls of a stored entry, with new q, k, v each step
    (bf16, 8 192 tokens, no text rows), are replayed from the fourth on, and each equals the selection's own kernel
    call bit for bit; an anchor makes a new entry, whose calls are recorded afresh."""
    from comfyui_sparse_attention.engine import CallContext, SparseConfig, SparseEngine, TokenLayout
    from comfyui_sparse_attention.kernels import fast_launch, replay
    if not replay.ENABLED:
        pytest.skip("SPARSE_ATTN_REPLAY=0")
    layout = TokenLayout(text_len=0, grid=(4, 32, 64))
    n, h = 8192, 4
    eng = SparseEngine(SparseConfig(method=method, density=0.15, min_tokens=0, residual=True, anchor_steps="0,9"))
    with torch.inference_mode():
        eng.begin_run()
        for step in range(12):
            ctx = CallContext(layer=0, step=step, total_steps=12, layout=layout)
            q, k, v = qkv(h, n, 128, seed=60 + step)
            before = fast_launch.counts()["replayed"]
            out = eng.attend(q, k, v, ctx)
            entry = eng.cache.on_device[ctx.key(n)]
            replayed = fast_launch.counts()["replayed"] - before
            if step in (0, 9):  # anchors
                assert entry.replay is None and replayed == 0
                continue
            calls = step if step < 9 else step - 9  # reuse calls of this entry so far
            assert replayed == (calls >= 4), f"step {step}: replayed {replayed} ({entry.replay.refused})"
            assert torch.equal(out, entry.selection.run(q, k, v, residual=entry.residual)), f"step {step}"
        stats = eng.end_run()
    assert stats.totals()["replays"] == 5  # steps 4-8 (the second entry's two reuse calls are recorded)


@pytest.mark.parametrize("method", ["block_topk", "mc_sparse"])
def test_an_anchors_store_never_waits_for_the_device(method):
    """An anchor's store (bf16, 16 384 tokens, D 128, room on the card): the residual formed and encoded, its
    fidelity ‖R‖ / ‖dense‖ and the cache placement make no host synchronisation (docs/kernel_notes.md, "v26"), through
    ``_store`` (R from the two outputs) and, for a block selection, ``_store_residual`` (R from the anchor kernel).
    The fidelity stays a 0-d tensor on the device until the run's statistics read it, as the float computed from the
    two outputs. (The selection itself still reads its density and list widths on the host.)"""
    from comfyui_sparse_attention.engine import CallContext, SparseConfig, SparseEngine, TokenLayout
    from comfyui_sparse_attention.engine.residual import Residual
    from comfyui_sparse_attention.engine.selection import BlockSelection
    layout = TokenLayout(text_len=0, grid=(4, 64, 64))
    n, h = 16384, 4
    eng = SparseEngine(SparseConfig(method=method, density=0.15, min_tokens=0, residual=True))
    q, k, v = qkv(h, n, 128, seed=80)
    ctx = CallContext(layer=0, step=0, total_steps=8, layout=layout)
    key = ctx.key(n)
    with torch.inference_mode():
        eng.begin_run()
        eng.attend(q, k, v, ctx)  # the anchor as the engine runs it: kernels tuned, the selection stored
        sel = eng.cache.on_device[key].selection
        out_d = K.attention_dense(q, k, v)
        out_s = sel.run(q, k, v)
        block = isinstance(sel, BlockSelection)
        if block:
            out_a, res = sel.anchor(q, k, v, precision="fp8")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            assert eng._store(key, sel, out_d, out_s, ctx) == "device"
            entry = eng.cache.on_device[key]
            if block:
                eng._store_residual(key, sel, out_a, Residual(*res), ctx)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert isinstance(entry.importance, torch.Tensor) and entry.importance.device.type == "cuda"
        want = float((out_d.double() - out_s.double()).norm() / out_d.double().norm())
        stats = eng.end_run()
    fid = stats.layers[0].fidelity
    assert len(fid) == (3 if block else 2) and all(isinstance(f, float) for f in fid)
    assert fid[1] == pytest.approx(want, rel=1e-2)
    if block:
        assert fid[2] == pytest.approx(want, rel=5e-2)


def layer_under_sync_debug(eng, qkv_, layout, inspect):
    """Layer 0's anchor (it tunes the kernels and builds the plans), then layer 1's anchor and reuse call under
    ``torch.cuda.set_sync_debug_mode("error")`` (a host synchronisation raises). qkv_: (q, k, v) (B, H, N, D) on CUDA.
    Returns (``inspect`` of layer 1's cached selection, called before the run ends, the run's statistics)."""
    from comfyui_sparse_attention.engine import CallContext
    q, k, v = qkv_
    n = q.shape[2]
    ctx = [CallContext(layer=layer, step=step, total_steps=8, layout=layout) for layer in (0, 1) for step in (0, 1)]
    with torch.inference_mode():
        eng.begin_run()
        eng.attend(q, k, v, ctx[0])
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            eng.attend(q, k, v, ctx[2])  # layer 1's anchor
            eng.attend(q, k, v, ctx[3])  # and its reuse call
        finally:
            torch.cuda.set_sync_debug_mode("default")
        result = inspect(eng.cache.on_device[ctx[2].key(n)].selection)
        stats = eng.end_run()
    return result, stats


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("text", [0, 200])
@pytest.mark.parametrize("method", ["block_topk", "mc_sparse", "hybrid"])
def test_a_whole_anchor_never_waits_for_the_device(method, text, per_head):
    """A whole anchor call as the engine makes it (bf16, 16 384 video tokens, with and without 200 text tokens
    ahead of them: ragged last blocks), and a reuse call after it, make no host synchronisation
    (docs/kernel_notes.md, "v27"): the selection's density stays on the device, a block plan's widths were read when
    it was built, and mc_sparse's lists are as wide as the budget (keep_top's short rows keep exactly it). The first
    layer's call tunes the kernels and builds the plan; the second layer's is the one watched. The densities the
    statistics read afterwards are the selections' exact ones. per_head: densities 0.05 and 0.15 on alternate heads
    of both layers (head groups by index tensors, made at layer 0's anchor and kept). (Key segments longer than
    4 x 4096 tokens: test_a_long_segment_mc_sparse_anchor_never_waits_for_the_device.) hybrid: its plan, the block
    plan with the static half's windows forced, is built at layer 0 and kept (docs/kernel_notes.md, "v28")."""
    from comfyui_sparse_attention.engine import SparseConfig, SparseEngine, TokenLayout
    from comfyui_sparse_attention.engine.selection import BlockSelection, block_pairs_fraction
    layout = TokenLayout(text_len=text, grid=(4, 64, 64))
    n, h = text + 16384, 4
    factors = {layer: [0.5, 1.5, 0.5, 1.5] for layer in (0, 1)} if per_head else {}
    eng = SparseEngine(SparseConfig(method=method, density=0.1, min_tokens=0, residual=True, layer_densities=factors))
    def exact_density(sel):
        assert isinstance(sel.density, torch.Tensor) and sel.density.device.type == "cuda"
        if isinstance(sel, BlockSelection):
            return block_pairs_fraction(sel.kv_indices, sel.kv_counts, n, n, sel.block_q, sel.block_k)
        bound = round((0.15 if per_head else 0.1) * 16384) + text  # the text keys: a dense pair
        assert sel.kv_low.shape[-1] == -(-bound // 16) * 16 and int(sel.kv_counts.max()) <= bound
        return float(sel.density)

    exact, stats = layer_under_sync_debug(eng, qkv(h, n, 128, seed=81), layout, exact_density)
    assert stats.layers[1].reuses == 1 and stats.layers[1].density == pytest.approx(exact, rel=1e-9)


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("text", [0, 200])
def test_a_long_segment_mc_sparse_anchor_never_waits_for_the_device(text, per_head):
    """As test_a_whole_anchor_never_waits_for_the_device for mc_sparse with a key segment longer than 4 x SAMPLE
    (20 480 video tokens, with and without 200 text tokens): keep_top's sampled threshold, capped at keep_bound, so the
    lists are keep_bound wide (plus the text keys, a dense pair) and the anchor never reads their width back
    (docs/kernel_notes.md, "v27"). per_head: densities 0.05 and 0.15 on alternate heads; the widest head group's bound
    sizes the joined lists."""
    from comfyui_sparse_attention.engine import SparseConfig, SparseEngine, TokenLayout
    from comfyui_sparse_attention.engine.block_geometry import keep_bound
    layout = TokenLayout(text_len=text, grid=(5, 64, 64))
    video, h = 20480, 4
    n = text + video
    factors = {layer: [0.5, 1.5, 0.5, 1.5] for layer in (0, 1)} if per_head else {}
    eng = SparseEngine(SparseConfig(method="mc_sparse", density=0.1, min_tokens=0, residual=True,
                                    layer_densities=factors))
    def exact_density(sel):
        assert isinstance(sel.density, torch.Tensor) and sel.density.device.type == "cuda"
        bound = keep_bound(round((0.15 if per_head else 0.1) * video), video) + text  # the text keys: a dense pair
        assert sel.kv_low.shape[-1] == -(-bound // 16) * 16 and int(sel.kv_counts.max()) <= bound
        return float(sel.density)

    exact, stats = layer_under_sync_debug(eng, qkv(h, n, 128, seed=82), layout, exact_density)
    assert stats.layers[1].reuses == 1 and stats.layers[1].density == pytest.approx(exact, rel=1e-9)


@pytest.mark.parametrize("n,d,bq,bk", [(32760, 128, 128, 128), (20000, 64, 64, 64)])
def test_fp8_residual_read_as_bytes_equals_the_typed_load(monkeypatch, n, d, bq, bk):
    """The software e4m3 decode that cards below compute capability 8.9 take (docs/kernel_notes.md, "v14"), run on
    this GPU's hardware: the pointer block-sparse kernel (plain and mass-weighted residual) and the token kernel give
    the same output bit for bit with the residual's bytes as with the typed fp8 load."""
    from comfyui_sparse_attention.kernels import _triton_common as C
    from comfyui_sparse_attention.kernels import anchor_torch, block_sparse_triton
    h = 2
    q, k, v = qkv(h, n, d, seed=n + d + 1)
    nqb, nkb = math.ceil(n / bq), math.ceil(n / bk)
    idx, cnt = skewed_lists(h, nqb, nkb, max(2, nkb // 8), seed=bk + d + 1)
    res = make_residual("fp8", q.shape, seed=n + 1)
    dense, lse = K.attention_dense(q, k, v, return_lse=True, backend="torch")
    mres = anchor_torch.block_residual(q, k, v, idx, cnt, dense, lse, block_q=bq, block_k=bk,
                                       residual_precision="fp8", return_mass=True)
    groups = K.group_queries(q, 128 if d == 128 else 64)
    g = groups.shape[2]
    sel = max(1, n // 8)
    gen = torch.Generator(device=DEV).manual_seed(7)
    toks = torch.sort(torch.topk(torch.rand(1, h, g, n, device=DEV, generator=gen), sel, dim=-1).indices, -1).values
    toks, tcnt = toks.to(torch.int32).contiguous(), torch.full((1, h, g), sel, dtype=torch.int32, device=DEV)
    outs = {}
    for typed in (True, False):
        monkeypatch.setattr(C, "fp8_typed", lambda t, typed=typed: typed)
        assert C.residual_mode(res) == (C.RES_FP8 if typed else C.RES_FP8_BYTES)
        outs[typed] = [block_sparse_triton.block_sparse_attention(q, k, v, idx, cnt, block_q=bq, block_k=bk,
                                                                  residual=r, path="pointer") for r in (res, mres)]
        outs[typed].append(K.token_sparse_attention(q, k, v, groups, toks, tcnt, backend="triton", residual=res))
    for typed_out, bytes_out in zip(outs[True], outs[False]):
        assert not torch.isnan(bytes_out).any() and torch.equal(typed_out, bytes_out)


# ---- the Gluon kernel (kernels/attention_gluon.py): against SDPA and the twins at real sizes ----

def _bnhd(t):
    """The same values as a (B, N, H, D)-contiguous tensor seen as (B, H, N, D): ComfyUI's transposed views."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


@needs_hopper
@pytest.mark.parametrize("n,nk,d,dtype,layout", [(32768, 32768, 128, torch.bfloat16, "bhnd"),
                                                  (75600, 75600, 128, torch.bfloat16, "bnhd"),
                                                  (4133, 4133, 64, torch.float16, "bhnd"),
                                                  (20000, 20000, 64, torch.bfloat16, "bnhd"),
                                                  (20000, 4133, 128, torch.bfloat16, "mixed")])
def test_gluon_dense_matches_sdpa(n, nk, d, dtype, layout):
    from comfyui_sparse_attention.kernels import dense_triton
    h = 3
    q, k, v = qkv(h, max(n, nk), d, seed=n + nk + d, dtype=dtype)
    q, k, v = q[:, :, :n].contiguous(), k[:, :, :nk].contiguous(), v[:, :, :nk].contiguous()
    if layout == "bnhd":
        q, k, v = _bnhd(q), _bnhd(k), _bnhd(v)
    elif layout == "mixed":  # q transposed, k contiguous, v transposed: k and v in different layouts
        q, v = _bnhd(q), _bnhd(v)
    out, lse = dense_triton.attention_dense(q, k, v, return_lse=True, path="gluon")
    ref = F.scaled_dot_product_attention(q, k, v)
    assert out.is_contiguous() and not torch.isnan(out).any() and rel(out, ref) <= 1e-2
    rows = torch.cat([torch.arange(0, n, 997, device=DEV), torch.tensor([n - 1], device=DEV)])
    s = (q[:, :, rows].float() @ k.float().transpose(-1, -2)) * d ** -0.5
    assert torch.allclose(lse[:, :, rows], torch.logsumexp(s, -1), atol=2e-2)


@needs_hopper
@pytest.mark.parametrize("n,d,bk,res_kind,layout", [(32760, 128, 128, "fp8", "bhnd"), (75600, 128, 128, "bf16", "bnhd"),
                                                    (20000, 64, 64, "none", "bhnd"), (4133, 128, 64, "fp8", "bnhd")])
def test_gluon_block_sparse_matches_twin(n, d, bk, res_kind, layout):
    """Skewed lists (empty, short and full rows; the ragged last blocks), each residual kind, the row LSE; a row with
    an empty list gets exactly its residual."""
    from comfyui_sparse_attention.kernels import block_sparse_torch, block_sparse_triton
    h, bq = 2, 128
    q, k, v = qkv(h, n, d, seed=n + d + 5)
    if layout == "bnhd":
        q, k, v = _bnhd(q), _bnhd(k), _bnhd(v)
    nqb, nkb = math.ceil(n / bq), math.ceil(n / bk)
    idx, cnt = skewed_lists(h, nqb, nkb, max(2, nkb // 8), seed=bk + d)
    res = make_residual(res_kind, q.shape, seed=n)
    out, lse = block_sparse_triton.block_sparse_attention(q, k, v, idx, cnt, block_q=bq, block_k=bk, residual=res,
                                                          path="gluon", return_lse=True)
    want, want_lse = block_sparse_torch.block_sparse_attention(q, k, v, idx, cnt, block_q=bq, block_k=bk,
                                                               residual=res, return_lse=True)
    assert not torch.isnan(out).any() and rel(out, want) <= 1e-2
    fin = torch.isfinite(want_lse)
    assert torch.equal(fin, torch.isfinite(lse)) and (lse - want_lse)[fin].abs().max() < 2e-2
    empty = out[0, 0, bq:2 * bq]  # query block 1 of head 0 has an empty list
    assert torch.equal(empty, torch.zeros_like(empty) if res is None else decoded(res)[0, 0, bq:2 * bq].to(out.dtype))


@needs_hopper
@pytest.mark.parametrize("n", [32760, 75600])
def test_gluon_mass_weighted_residual_matches_twin(n):
    """A reuse call weighted by an anchor's mass on the Gluon kernel against the twin; the weighting moves the
    output."""
    h, bq, d = 2, 128, 128
    q, k, v = qkv(h, n, d, seed=n + 19)
    nb = math.ceil(n / bq)
    idx, cnt = skewed_lists(h, nb, nb, max(2, nb // 8), seed=d + 3)
    got, want, fixed = gluon_mass_reuse(q, k, v, idx, cnt, bq)
    assert not torch.isnan(got).any()
    assert rel(got, want) <= 1e-2 and rel(want, fixed) > 3 * rel(got, want)


@needs_hopper
def test_auto_takes_the_gluon_kernel_from_its_size_on(monkeypatch):
    """``auto`` runs the Gluon kernel for dense and block-sparse calls from GLUON_MIN_TOKENS query tokens on (the
    engine's 128 x 128 blocks), the TMA kernels below, and neither under SPARSE_ATTN_GLUON=0."""
    from comfyui_sparse_attention.kernels import _hopper, attention_gluon
    if _hopper.gluon_import_problem():
        pytest.skip(f"no Gluon here: {_hopper.gluon_import_problem()}")
    calls = []
    real = attention_gluon.attention
    monkeypatch.setattr(attention_gluon, "attention", lambda *a, **kw: (calls.append(kw.get("idx") is None),
                                                                         real(*a, **kw))[1])

    def run(n):
        q, k, v = qkv(2, n, 128, seed=n)
        nb = math.ceil(n / 128)
        idx, cnt = random_lists(2, nb, nb, 8, seed=n)
        K.attention_dense(q, k, v)
        K.block_sparse_attention(q, k, v, idx, cnt, block_q=128, block_k=128)
    run(_hopper.GLUON_MIN_TOKENS)
    assert calls == [True, False]
    calls.clear()
    run(_hopper.GLUON_MIN_TOKENS - 1)
    assert calls == []
    monkeypatch.setenv("SPARSE_ATTN_GLUON", "0")
    run(_hopper.GLUON_MIN_TOKENS)
    assert calls == [] and not _hopper.broken()


@needs_hopper
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_gluon_batch_of_two_matches_twin(layout):
    """A CFG batch (B = 2) on the Gluon kernel, dense with LSE and block-sparse with an fp8 residual weighted by the
    mass: each batch row against the twin (the kernel's rows, lists and epilogue tensors are indexed by b * H + h)."""
    from comfyui_sparse_attention.kernels import dense_triton
    h, n, d, bq = 3, 20000, 128, 128
    parts = [qkv(h, n, d, seed=s) for s in (71, 72)]
    q, k, v = (torch.cat([p[i] for p in parts]) for i in range(3))
    if layout == "bnhd":
        q, k, v = _bnhd(q), _bnhd(k), _bnhd(v)
    out, lse = dense_triton.attention_dense(q, k, v, return_lse=True, path="gluon")
    ref, ref_lse = dense_torch_lse(q, k, v)
    assert rel(out[0], ref[0]) <= 1e-2 and rel(out[1], ref[1]) <= 1e-2
    assert (lse - ref_lse).abs().max() < 2e-2
    nb = math.ceil(n / bq)
    idx, cnt = skewed_lists(h, nb, nb, max(2, nb // 8), seed=9)
    idx, cnt = torch.cat([idx, idx.flip(1)]), torch.cat([cnt, cnt.flip(1)])  # another list per batch row
    got, want, _ = gluon_mass_reuse(q, k, v, idx, cnt, bq)
    assert rel(got[0], want[0]) <= 1e-2 and rel(got[1], want[1]) <= 1e-2


@needs_hopper
@pytest.mark.parametrize("n,d,bk,precision,layout,b", [(32760, 128, 128, "fp8", "bhnd", 1),
                                                       (75600, 128, 128, "model", "bnhd", 1),
                                                       (20000, 64, 64, "fp8", "bhnd", 1),
                                                       (4133, 128, 64, "model", "bnhd", 1),
                                                       (20000, 128, 128, "fp8", "bnhd", 2)])
def test_gluon_anchor_matches_twin(n, d, bk, precision, layout, b, monkeypatch):
    """kernels/anchor_gluon.py (the selected walk, the sparse output stashed in Out, the complement walk on from the
    same state) against the twin on skewed lists (full rows, an empty row, ragged N), each residual precision, the
    mass, a CFG batch and ComfyUI's transposed views: the dense output and LSE against fp32, R against the twin's; a
    row that kept every block has R exactly 0 and an empty row R = its dense output; kernels.api takes this path."""
    from comfyui_sparse_attention.kernels import _hopper, anchor_gluon, anchor_torch, anchor_triton
    h, bq = 2, 128
    parts = [qkv(h, n, d, seed=n + d + 31 * i) for i in range(b)]
    q, k, v = (torch.cat([p[i] for p in parts]) for i in range(3))
    if layout == "bnhd":
        q, k, v = _bnhd(q), _bnhd(k), _bnhd(v)
    nqb, nkb = math.ceil(n / bq), math.ceil(n / bk)
    idx, cnt = skewed_lists(h, nqb, nkb, max(2, nkb // 8), seed=bk + d)
    if b == 2:
        idx, cnt = torch.cat([idx, idx.flip(1)]), torch.cat([cnt, cnt.flip(1)])
    out, lse, res = anchor_triton.block_anchor_attention(q, k, v, idx, cnt, block_q=bq, block_k=bk,
                                                         residual_precision=precision, return_lse=True,
                                                         return_mass=True, path="gluon")
    ref, ref_lse = dense_torch_lse(q, k, v)
    assert out.is_contiguous() and not torch.isnan(out).any()
    for i in range(b):
        assert rel(out[i], ref[i]) <= 1e-2
    assert (lse - ref_lse).abs().max() < 2e-2
    want = anchor_torch.block_residual(q, k, v, idx, cnt, out, lse, block_q=bq, block_k=bk,
                                       residual_precision=precision, return_mass=True)
    assert not torch.isnan(decoded(res[:2])).any()
    assert rel(decoded(res[:2]), decoded(want[:2])) <= (2e-2 if precision == "model" else 6e-2)
    full = decoded(res[:2])[0, :, :bq]  # query block 0 keeps every block: both walks end in the same state
    assert torch.equal(full, torch.zeros_like(full))
    empty = decoded(res[:2])[0, 0, bq:2 * bq]  # query block 1 of head 0 kept nothing: R is the dense output
    if precision == "model":
        assert torch.equal(res[0][0, 0, bq:2 * bq], out[0, 0, bq:2 * bq])
    else:
        assert rel(empty, out[0, 0, bq:2 * bq].float()) <= 4e-2
    assert rel(empty, ref[0, 0, bq:2 * bq].float()) <= (1e-2 if precision == "model" else 4e-2)
    # the engine's call: the mass without the LSE (the kernel computes the LSE either way, so the same bits)
    out3, res3 = anchor_triton.block_anchor_attention(q, k, v, idx, cnt, block_q=bq, block_k=bk,
                                                      residual_precision=precision, return_mass=True, path="gluon")
    assert torch.equal(out3, out) and all(a is None and b is None or torch.equal(a, b) for a, b in zip(res3, res))
    live = (want[2][..., 1] > math.log(1e-3)) & (res[2][..., 1] > math.log(1e-3))
    assert live.float().mean() > 0.5 and not torch.isnan(res[2]).any()
    assert (res[2] - want[2])[live].abs().max() < 2e-2
    # kernels.api: this pass from GLUON_MIN_TOKENS query tokens on, at any density
    calls = []
    real = anchor_gluon.anchor
    monkeypatch.setattr(anchor_gluon, "anchor", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    out2, res2 = K.block_anchor_attention(q, k, v, idx, cnt, block_q=bq, block_k=bk, residual_precision=precision,
                                          density=0.05)
    assert calls == ([1] if n >= _hopper.GLUON_MIN_TOKENS else []) and "gluon_anchor" not in _hopper.broken()
    assert rel(out2, out) <= 1e-3 and rel(decoded(res2), decoded(res[:2])) <= (1e-3 if calls else 6e-2)


def dense_torch_lse(q, k, v):
    """fp32 reference dense output and row LSE (B, H, N) of q (B, H, N, D) against k, v, one head at a time."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        for hh in range(q.shape[1]):
            s = (q[b, hh].float() @ k[b, hh].float().T) * q.shape[-1] ** -0.5
            lses.append(torch.logsumexp(s, -1))
            outs.append(torch.softmax(s, -1) @ v[b, hh].float())
            del s
    shape = q.shape
    return torch.stack(outs).view(shape), torch.stack(lses).view(shape[:3])


def gluon_mass_reuse(q, k, v, idx, cnt, bq, path="gluon"):
    """An anchor's fp8 residual with its mass (the twin's), then a reuse call on queries moved by 10 %: (the Gluon
    kernel's output (``path``: "gluon" or "gluon_persistent"), the twin's, the twin's with the residual
    unweighted)."""
    from comfyui_sparse_attention.kernels import anchor_torch, block_sparse_torch, block_sparse_triton
    twin = anchor_torch.block_anchor_attention(q, k, v, idx, cnt, block_q=bq, block_k=bq, residual_precision="fp8",
                                               return_mass=True)
    q2 = (q.float() * 1.1).to(q.dtype)
    kw = dict(block_q=bq, block_k=bq)
    got = block_sparse_triton.block_sparse_attention(q2, k, v, idx, cnt, residual=twin[1], path=path, **kw)
    want = block_sparse_torch.block_sparse_attention(q2, k, v, idx, cnt, residual=twin[1], **kw)
    fixed = block_sparse_torch.block_sparse_attention(q2, k, v, idx, cnt, residual=twin[1][:2], **kw)
    return got, want, fixed


@needs_hopper
@pytest.mark.parametrize("layout,dtype,d,lists,res_kind,b,n", [
    ("bhnd", torch.bfloat16, 128, "int32", "none", 1, 20011),
    ("bnhd", torch.float16, 64, "compact", "fp8", 2, 40009),
    ("bhnd", torch.bfloat16, 128, "compact", "bf16", 1, 75600),
    ("bnhd", torch.bfloat16, 128, "compact", "fp8", 2, 33001),  # the engine's own call: CFG batch, ComfyUI's views
])
@pytest.mark.parametrize("off32", [False, True])
@pytest.mark.parametrize("path", ["gluon", "gluon_persistent"])
def test_gluon_token_kernel_matches_twin(layout, dtype, d, lists, res_kind, b, n, off32, path, monkeypatch):
    """kernels/token_sparse_gluon.py (cp.async gathers, the block kernel's consumers) against the twin and the pointer
    kernel: ragged N (the last group padded with -1), lists of every length (empty, one token, the whole sequence,
    129 = one tile and one slot, and random lengths), int32 and compact int16 lists (two segments past 32 768 tokens),
    each residual kind, ComfyUI's transposed (B, N, H, D) views, a batch of two, D 64 and 128, fp16 and bf16, the
    loader's row offsets in 64 and in 32 bits (OFF32); rows of an empty list get exactly the residual (or 0). On its
    own grid and on the persistent one, where each program takes several rows of these lengths in turn (one ring and
    one query buffer carried across them)."""
    from comfyui_sparse_attention.kernels import token_sparse_gluon, token_sparse_triton
    monkeypatch.setattr(token_sparse_gluon, "OFF32", {"int32": off32, "compact": off32})
    from comfyui_sparse_attention.kernels.compact_torch import decode_lists
    h = 2
    parts = [qkv(h, n, d, seed=n + s, dtype=dtype) for s in range(b)]
    q, k, v = (torch.cat([p[i] for p in parts]) for i in range(3))
    if layout == "bnhd":
        q, k, v = _bnhd(q), _bnhd(k), _bnhd(v)
    groups = K.group_queries(q, 128)
    g = groups.shape[2]
    gen = torch.Generator(device=DEV).manual_seed(n)
    p = torch.rand(b, h, g, 1, device=DEV, generator=gen) * 0.3
    keep = torch.rand(b, h, g, n, device=DEV, generator=gen) < p
    keep[:, :, 0] = False
    keep[:, :, 1] = False
    keep[:, :, 1, n // 2] = True
    keep[:, :, 2] = True
    keep[:, :, 3] = False
    keep[:, :, 3, :129] = True
    low, ends, cnt = K.compact_keep(keep)
    res = make_residual(res_kind, q.shape, seed=n)
    kw = dict(residual=res, validate=False)
    if lists == "compact":
        got = token_sparse_triton.token_sparse_attention_compact(q, k, v, groups, low, ends, cnt, path=path, **kw)
        ptr = token_sparse_triton.token_sparse_attention_compact(q, k, v, groups, low, ends, cnt, path="pointer", **kw)
    toks = decode_lists(low, ends).to(torch.int32).contiguous()
    if lists == "int32":
        got = token_sparse_triton.token_sparse_attention(q, k, v, groups, toks, cnt, path=path, **kw)
        ptr = token_sparse_triton.token_sparse_attention(q, k, v, groups, toks, cnt, path="pointer", **kw)
    twin = K.token_sparse_attention(q, k, v, groups, toks, cnt, backend="torch", residual=res)
    assert not torch.isnan(got).any()
    for bi in range(b):
        assert rel(got[bi], twin[bi]) <= 1e-2 and rel(got[bi], ptr[bi]) <= 1e-2
    rows = groups[0, 1, 0].long()
    want = torch.zeros_like(got[0, 1, rows]) if res is None else decoded(res)[0, 1, rows].to(got.dtype)
    assert torch.equal(got[0, 1, rows], want)


@needs_hopper
def test_auto_takes_the_gluon_token_kernel_for_groups_of_128(monkeypatch):
    """``auto`` runs token-sparse calls of 128-query groups on the Gluon kernel from GLUON_MIN_TOKENS query tokens
    on, and the pointer kernel for groups of 64, below that size and under SPARSE_ATTN_GLUON=0."""
    from comfyui_sparse_attention.kernels import _hopper, token_sparse_gluon
    if _hopper.gluon_problem("gluon_token", *qkv(1, 16, 64, seed=0), block_q=128, auto=False):
        pytest.skip(f"no Gluon token kernel here: {_hopper.gluon_import_problem('token_sparse_gluon')}")
    calls = []
    real = token_sparse_gluon.attention
    monkeypatch.setattr(token_sparse_gluon, "attention", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])

    def run(n, c):
        q, k, v = qkv(2, n, 128, seed=n)
        groups = K.group_queries(q, c)
        keep = torch.rand(1, 2, groups.shape[2], n, device=DEV) < 0.1
        low, ends, cnt = K.compact_keep(keep)
        out = K.token_sparse_attention_compact(q, k, v, groups, low, ends, cnt)
        assert not torch.isnan(out).any()
    run(_hopper.GLUON_MIN_TOKENS, 128)
    assert calls == [1]
    run(_hopper.GLUON_MIN_TOKENS, 64)
    run(_hopper.GLUON_MIN_TOKENS - 1, 128)
    monkeypatch.setenv("SPARSE_ATTN_GLUON", "0")
    run(_hopper.GLUON_MIN_TOKENS, 128)
    assert calls == [1] and not _hopper.broken()


@needs_hopper
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_gluon_persistent_matches_twin(layout):
    """The persistent Gluon kernel (one program per SM over the rows heaviest first, one K/V ring and Q buffer across
    a program's rows) on skewed lists (full and empty rows) of a batch of two: output and LSE bit-identical to the
    non-persistent kernel's (each row runs the same instructions; a stale tile from a wrong ring phase would show
    in a few rows), also in index order (an empty row followed by more rows of its program); and a reuse call with
    an fp8 residual weighted by the mass against the twin."""
    from comfyui_sparse_attention.kernels import attention_gluon, block_sparse_triton
    h, n, d, bq = 3, 40000, 128, 128
    parts = [qkv(h, n, d, seed=s) for s in (81, 82)]
    q, k, v = (torch.cat([p[i] for p in parts]) for i in range(3))
    if layout == "bnhd":
        q, k, v = _bnhd(q), _bnhd(k), _bnhd(v)
    nb = math.ceil(n / bq)
    idx, cnt = skewed_lists(h, nb, nb, max(2, nb // 8), seed=5)
    idx, cnt = torch.cat([idx, idx.flip(1)]), torch.cat([cnt, cnt.flip(1)])
    kw = dict(block_q=bq, block_k=bq, return_lse=True)
    out, lse = block_sparse_triton.block_sparse_attention(q, k, v, idx, cnt, path="gluon_persistent", **kw)
    ref, ref_lse = block_sparse_triton.block_sparse_attention(q, k, v, idx, cnt, path="gluon", **kw)
    assert not torch.isnan(out).any() and torch.equal(out, ref) and torch.equal(lse, ref_lse)
    in_order = attention_gluon.attention(q, k, v, torch.empty_like(out), scale=d ** -0.5, idx=idx, cnt=cnt,
                                         persistent=True)  # order None: the rows in index order
    assert torch.equal(in_order, ref)
    empty = (cnt == 0).nonzero()[0].tolist()  # a row with nothing to attend: zeros
    rows = out[empty[0], empty[1], empty[2] * bq:(empty[2] + 1) * bq]
    assert torch.equal(rows, torch.zeros_like(rows))
    got, want, _ = gluon_mass_reuse(q, k, v, idx, cnt, bq, path="gluon_persistent")
    assert rel(got[0], want[0]) <= 1e-2 and rel(got[1], want[1]) <= 1e-2


@pytest.mark.parametrize("b,n", [(1, 16384), (2, 10001), (1, 32760)])
def test_grouping_graph_replays_the_eager_groups(b, n, monkeypatch):
    """kernels/grouping_graph.py: the first call of a shape runs as it is, the second captures, later calls replay;
    every call gives the groups of the partition run as it is, for new queries too (a ragged N, B = 2); release()
    frees the graphs; SPARSE_ATTN_GROUPING_GRAPH=0 captures nothing, nor does a sequence beyond MAX_TOKENS. Under
    either allocator (under cudaMallocAsync the graph holds PyTorch's gathers: grouping_graph.graph_gather)."""
    from comfyui_sparse_attention.kernels import gather_triton, grouping_graph, grouping_torch
    grouping_graph.release()
    graphed = n <= grouping_graph.MAX_TOKENS and grouping_graph.enabled()
    h = 8 if n > 20000 else 3
    qs = [qkv(h, n, 128, seed=20 + i)[0].expand(b, h, n, 128).contiguous() for i in range(3)]
    if b == 2:
        for i, q in enumerate(qs):
            qs[i] = torch.cat([q[:1], torch.flip(q[1:], dims=[2])])

    def eager(q):
        return grouping_torch.group_queries(q, 128, 16, gather=gather_triton.gather_rows)

    wants = [eager(q) for q in qs]
    for i, q in enumerate([qs[0], qs[0], qs[1], qs[2], qs[0]]):
        got = K.group_queries(q, 128, dims=16)
        assert torch.equal(got, wants[[0, 0, 1, 2, 0][i]]), f"call {i}"
        # a batch of two is grouped a sample at a time: its second sample is the shape's second call (a capture)
        assert len(grouping_graph._graphs) == (0 if (i == 0 and b == 1) or not graphed else 1)
    # under cudaMallocAsync the graph holds PyTorch's gathers (graph_gather)
    assert all(key[3] is grouping_graph.graph_gather(gather_triton.gather_rows) for key in grouping_graph._graphs)
    grouping_graph.release()
    assert not grouping_graph._graphs
    monkeypatch.setenv("SPARSE_ATTN_GROUPING_GRAPH", "0")
    for _ in range(3):
        assert torch.equal(K.group_queries(qs[1], 128, dims=16), wants[1])
    assert not grouping_graph._graphs


@pytest.mark.parametrize("n", [16384, 75600])
def test_cond_and_uncond_group_alike_batched_or_apart(n):
    """The grouping on 16 leading directions on the GPU (batched cuBLAS and cuSOLVER calls, the Triton row gather, the
    graph up to its MAX_TOKENS): cond and uncond in one call group their queries as each does alone. Batched, the
    partition's operators rounded with the number of heads in the call and 32-66 % of groups matched
    (docs/bench-runs/mass-pack-2/grouping-batched.json); each sample is now grouped alone."""
    q = torch.cat([qkv(4, n, 128, seed=30)[0], qkv(4, n, 128, seed=31)[0]])
    for _ in range(3):  # as it is, captured, replayed (below MAX_TOKENS)
        both = K.group_queries(q, 128, dims=16)
        apart = torch.cat([K.group_queries(q[:1], 128, dims=16), K.group_queries(q[1:], 128, dims=16)])
        assert torch.equal(both, apart)


def test_grouping_graph_failed_capture_no_room_and_eviction_run_as_they_are(monkeypatch, caplog):
    """kernels/grouping_graph.py's other paths: a capture that fails logs a warning, refuses the shape for the run and
    gives the eager groups (a new run tries again); no room for a graph: the call runs as it is; beyond MAX_GRAPHS
    shapes the oldest graph goes and its shape captures again at its next call. Every call gives the eager groups."""
    import logging

    from comfyui_sparse_attention.kernels import gather_triton, grouping_graph, grouping_torch
    if not grouping_graph.enabled():
        pytest.skip("no grouping graphs under SPARSE_ATTN_GROUPING_GRAPH=0 (grouping_graph.enabled())")
    grouping_graph.release()
    qa, qb = qkv(3, 10001, 128, seed=40)[0], qkv(2, 9000, 128, seed=41)[0]
    want = {id(q): grouping_torch.group_queries(q, 128, 16, gather=gather_triton.gather_rows) for q in (qa, qb)}

    def check(q):
        assert torch.equal(K.group_queries(q, 128, dims=16), want[id(q)])

    real = grouping_torch._group

    def failing(*a, **kw):
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a capture that fails")
        return real(*a, **kw)

    monkeypatch.setattr(grouping_torch, "_group", failing)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            check(qa)
    assert not grouping_graph._graphs and len(grouping_graph._refused) == 1
    assert "runs without a CUDA graph" in caplog.text
    monkeypatch.setattr(grouping_torch, "_group", real)
    grouping_graph.release()  # the next run tries again
    for _ in range(3):
        check(qa)
    assert len(grouping_graph._graphs) == 1
    grouping_graph.release()
    monkeypatch.setattr(grouping_graph, "_room", lambda points: False)
    for _ in range(3):
        check(qa)
    assert not grouping_graph._graphs
    monkeypatch.undo()
    grouping_graph.release()
    monkeypatch.setattr(grouping_graph, "MAX_GRAPHS", 1)
    for q in (qa, qa, qb, qb, qa, qb):  # a captures, b captures (a goes), a captures again (b goes), b again
        check(q)
        assert len(grouping_graph._graphs) <= 1
    assert len(grouping_graph._graphs) == 1
    grouping_graph.release()


@pytest.mark.parametrize("b,n,dens", [(1, 75600, None), (2, 16384, None), (1, 16384, (0.5, 1.5, 1.0, 1.0))])
def test_side_stream_anchor_as_in_order(b, n, dens, monkeypatch):
    """kernels/side_stream.py: the query grouping made on a side stream, after a dense call launched between the mark
    and the launch, gives the groups made in order, replayed from its graph too (below grouping_graph.MAX_TOKENS); the
    mc_sparse anchor that makes them beside its dense call (the default) caches the selection and gives the outputs of
    the anchor made in order (SPARSE_ATTN_SIDE_STREAM=0), for cond and uncond batched and for per-head densities (the
    prepared groups sliced by head)."""
    from comfyui_sparse_attention.engine import CallContext, SparseConfig, SparseEngine, TokenLayout
    from comfyui_sparse_attention.kernels import grouping_graph
    h = 4
    grid = (16, 32, 32) if n == 16384 else (21, 45, 80)
    layout = TokenLayout(text_len=0, grid=grid)
    q, k, v = (x.expand(b, h, n, 128).contiguous() for x in qkv(h, n, 128, seed=50))
    q1, k1, v1 = (x.expand(b, h, n, 128).contiguous() for x in qkv(h, n, 128, seed=51))
    grouping_graph.release()
    want = K.group_queries(q, 128, dims=16)
    for _ in range(3):  # as it is, captured, replayed
        late = torch.zeros_like(q)
        torch.cuda._sleep(int(2e8))  # the queries are written late: the side stream must wait for the mark
        late.copy_(q)
        pending = K.beside(lambda x=late: K.group_queries(x, 128, dims=16), late)
        dense = K.attention_dense(q, k, v)
        assert pending.on_side_stream
        assert torch.equal(pending.result(), want) and not pending.on_side_stream
        del dense
    grouping_graph.release()
    got = {}
    for side in ("1", "0"):
        monkeypatch.setenv("SPARSE_ATTN_SIDE_STREAM", side)
        eng = SparseEngine(SparseConfig(method="mc_sparse", density=0.15, min_tokens=0, residual=True,
                                        layer_densities=() if dens is None else {0: list(dens)}))
        eng.begin_run()
        outs = [eng.attend(q, k, v, CallContext(layer=0, step=0, layout=layout))]
        sel = eng.cache.on_device[CallContext(layer=0, step=0, layout=layout).key(n)].selection
        outs += [eng.attend(q1, k1, v1, CallContext(layer=0, step=s, layout=layout)) for s in (1, 2)]
        torch.cuda.synchronize()
        got[side] = (outs, sel.q_groups.clone(), sel.kv_counts.clone())
        eng.end_run()
    assert torch.equal(got["1"][1], got["0"][1]) and torch.equal(got["1"][2], got["0"][2])
    for a, b_ in zip(got["1"][0], got["0"][0]):
        assert torch.equal(a, b_)


@pytest.mark.parametrize("h,n,dims", [(40, 75600, 16), (8, 75600, 0), (12, 32760, 16), (40, 300000, 64)])
def test_grouping_scratch_bounds_its_peak_and_the_side_stream_needs_room(h, n, dims, monkeypatch):
    """kernels.group_queries_scratch bounds what the grouping allocates at its peak, run eagerly as the side stream
    runs it at Wan 14B (no graph; the last shape's chunks of heads are smaller than its heads, so the points of every
    head stay beside a chunk's working tensors); kernels.beside sends work whose scratch the device has no room for
    (kernels/side_stream.py, ROOM_FACTOR; under the native allocator) to the current stream, where it gives the same
    groups, and work of a few bytes to the side stream."""
    monkeypatch.setenv("SPARSE_ATTN_GROUPING_GRAPH", "0")
    q = qkv(h, n, 128, seed=52)[0]
    need = K.group_queries_scratch(tuple(q.shape), 128, dims)
    want = K.group_queries(q, 128, dims=dims)  # first use of cuBLAS and the sorts: their workspaces stay allocated
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    assert torch.equal(K.group_queries(q, 128, dims=dims), want)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert 0 < peak <= need, (peak, need)
    total = torch.cuda.get_device_properties(q.device).total_memory
    pending = K.beside(lambda: K.group_queries(q, 128, dims=dims), q, need_bytes=total)
    pooled = torch.cuda.get_allocator_backend() == "cudaMallocAsync"  # one pool for every stream: always room
    assert pending.on_side_stream == pooled and torch.equal(pending.result(), want)
    pending = K.beside(lambda: K.group_queries(q, 128, dims=dims), q, need_bytes=1)
    assert pending.on_side_stream and torch.equal(pending.result(), want)


def test_residual_of_kernel_matches_twin_on_gpu():
    """kernels/residual_encode_triton.py on the GPU (the hardware's fp8 cast): R in the model's dtype equal to the
    twin's, the same row scales, the fp8 bytes the twin's but where a value lies at a rounding boundary (Triton's fp32
    division on the GPU rounds within 2 ulp, not correctly: one byte in 37 000 was one fp8 step off), the sums within
    rounding (tests/residual_of_check.py), an inf or NaN of the dense output NaN in its own element of R alone; and at
    Wan 14B's size (40 x 75 600, bf16, (B, N, H, D) views as the attention kernels write them)."""
    import residual_of_check
    r = residual_of_check.check("cuda", (torch.float16, torch.bfloat16, torch.float32))
    big = residual_of_check.check("cuda", (torch.bfloat16,), shapes=((1, 40, 75600, 128),))
    for checked in (r, big):
        nonfinite = checked.pop("nonfinite")
        assert all(nonfinite.values()), nonfinite
    r.update(big)
    assert len(r) == 3 * 3 * 2 + 2
    for case, e in r.items():
        assert e["triton"] and e["shape_ok"] and e["model_equal"] and e["scale_rel"] <= 1e-6, (case, e)
        assert e["codes_equal"] >= 0.9999 and e["max_steps"] <= 1, (case, e)
        assert e["sums_rel"] <= 1e-3, (case, e)
