"""PyTorch backend: residuals fused into the sparse primitives, and the anchor primitive."""

import pytest
import torch
from sparse_ref import block_allow, random_block_lists, ref_attention, rel_l2, structured_qkv, token_allow

from comfyui_sparse_attention.kernels import (attention_dense, block_anchor_attention, block_sparse_attention,
                                              group_queries, token_sparse_attention)
from comfyui_sparse_attention.kernels._residual import encode_residual

FP8 = getattr(torch, "float8_e4m3fn", None)


def _decode(res):
    data, scale = res
    return data.double() if scale is None else data.double() * scale.double()


def _lists(n, bq, bk, seed):
    nqb, nkb = -(-n // bq), -(-n // bk)
    return random_block_lists(1, 2, nqb, nkb, max(1, nkb // 2), seed=seed, empty_rows=(1,), full_rows=(0,))


@pytest.mark.parametrize("precision", ["model", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_sparse_adds_the_residual(precision, dtype):
    if precision == "fp8" and FP8 is None:
        pytest.skip("torch has no float8_e4m3fn")
    n, bq, bk = 333, 64, 64
    q, k, v = structured_qkv(1, 2, n, 64, dtype=dtype, seed=4)
    idx, cnt = _lists(n, bq, bk, seed=4)
    res = encode_residual(torch.randn(q.shape, generator=torch.Generator().manual_seed(1)) * 0.2, precision, dtype)
    out = block_sparse_attention(q, k, v, idx, cnt, block_q=bq, block_k=bk, residual=res, backend="torch")
    ref, _ = ref_attention(q, k, v, block_allow(idx, cnt, n, n, bq, bk))
    ref = ref + _decode(res)
    assert out.dtype == dtype and rel_l2(out, ref) <= (1e-5 if dtype == torch.float32 else 1e-2)
    empty = slice(bq, 2 * bq)  # query block 1 has an empty list: exactly the residual, cast once
    assert torch.equal(out[:, :, empty], _decode(res)[:, :, empty].to(dtype))


def test_token_sparse_adds_the_residual_also_to_ungrouped_queries():
    n, d = 200, 64
    q, k, v = structured_qkv(1, 2, n, d, seed=6)
    groups = group_queries(q, 64)
    g = groups.shape[2]
    gen = torch.Generator().manual_seed(2)
    toks = torch.stack([torch.sort(torch.randperm(n, generator=gen)[:40]).values for _ in range(2 * g)])
    toks = toks.view(1, 2, g, 40).int()
    cnt = torch.full((1, 2, g), 40, dtype=torch.int32)
    cnt[0, 0, 1] = 0
    lost = groups.clone()
    lost[0, 1, 0] = -1
    res = encode_residual(torch.randn(q.shape, generator=gen) * 0.2, "model", q.dtype)
    out = token_sparse_attention(q, k, v, lost, toks, cnt, residual=res, backend="torch")
    ref, _ = ref_attention(q, k, v, token_allow(lost, toks, cnt, n, n))
    assert rel_l2(out, ref + _decode(res)) <= 1e-5
    gone = groups[0, 1, 0].long()
    gone = gone[gone >= 0]
    assert torch.equal(out[0, 1, gone], res[0][0, 1, gone])


@pytest.mark.parametrize("bad,match", [
    (lambda q: q, "pair"),
    (lambda q: (q[:, :1], None), "shape"),
    (lambda q: (q.double(), None), "dtype"),
    (lambda q: (q, torch.ones(*q.shape[:3], 1)), "scale must be None"),
    (lambda q: (q.to(FP8), None), "fp32 tensor of shape"),
    (lambda q: (q, None, None, None), "pair"),
    (lambda q: (q, None, torch.zeros(2)), "residual mass"),
])
def test_bad_residuals_are_refused(bad, match):
    if FP8 is None and "fp32 tensor" in match:
        pytest.skip("torch has no float8_e4m3fn")
    q, k, v = structured_qkv(1, 2, 100, 64, seed=1)
    idx, cnt = _lists(100, 64, 64, seed=1)
    with pytest.raises(ValueError, match=match):
        block_sparse_attention(q, k, v, idx, cnt, block_q=64, block_k=64, residual=bad(q), backend="torch")


@pytest.mark.parametrize("precision", ["model", "fp8"])
def test_anchor_is_dense_plus_the_residual_of_the_sparse_output(precision):
    if precision == "fp8" and FP8 is None:
        pytest.skip("torch has no float8_e4m3fn")
    n, bq, bk = 300, 64, 128
    q, k, v = structured_qkv(1, 2, n, 64, seed=8)
    idx, cnt = _lists(n, bq, bk, seed=8)
    out, lse, res = block_anchor_attention(q, k, v, idx, cnt, block_q=bq, block_k=bk, residual_precision=precision,
                                           return_lse=True, backend="torch")
    dense, dense_lse = attention_dense(q, k, v, return_lse=True, backend="torch")
    sparse = block_sparse_attention(q, k, v, idx, cnt, block_q=bq, block_k=bk, backend="torch")
    assert torch.equal(out, dense) and torch.equal(lse, dense_lse)
    tol = 1e-6 if precision == "model" else 2 ** -4
    assert rel_l2(_decode(res), dense.double() - sparse.double()) <= tol
    # the reuse step rebuilds the dense output from the sparse one and the residual
    again = block_sparse_attention(q, k, v, idx, cnt, block_q=bq, block_k=bk, residual=res, backend="torch")
    r_norm = float((dense.double() - sparse.double()).norm())
    assert float((again.double() - dense.double()).norm()) <= (1e-6 if precision == "model" else 2 ** -4) * r_norm
    assert block_anchor_attention(q, k, v, idx, cnt, block_q=bq, block_k=bk, backend="torch")[0].shape == q.shape
    with pytest.raises(ValueError, match="residual_precision"):
        block_anchor_attention(q, k, v, idx, cnt, block_q=bq, block_k=bk, residual_precision="fp16", backend="torch")


def test_residual_of_a_given_dense_output_equals_the_anchors():
    """anchor_torch.block_residual (the composed anchor's second half: R and the mass from a dense output computed
    before) gives the anchor primitive's residual and mass; the Triton wrapper refuses a dense output of another shape
    or dtype, and a mass request without the dense LSE, before launching anything."""
    from comfyui_sparse_attention.kernels import anchor_torch
    n, bq, bk = 300, 64, 128
    q, k, v = structured_qkv(1, 2, n, 64, seed=9)
    idx, cnt = _lists(n, bq, bk, seed=9)
    out, lse, want = block_anchor_attention(q, k, v, idx, cnt, block_q=bq, block_k=bk, return_lse=True,
                                            return_mass=True, backend="torch")
    got = anchor_torch.block_residual(q, k, v, idx, cnt, out, lse, block_q=bq, block_k=bk, return_mass=True)
    assert len(got) == 3 and got[1] is None
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    assert anchor_torch.block_residual(q, k, v, idx, cnt, out, None, block_q=bq, block_k=bk)[0].shape == q.shape
    pytest.importorskip("triton")
    from comfyui_sparse_attention.kernels import anchor_triton
    with pytest.raises(ValueError, match="dense must be"):
        anchor_triton.block_residual(q, k, v, idx, cnt, out[:, :1], lse, block_q=bq, block_k=bk)
    with pytest.raises(ValueError, match="dense must be"):
        anchor_triton.block_residual(q, k, v, idx, cnt, out.half(), lse, block_q=bq, block_k=bk)
    with pytest.raises(ValueError, match="dense LSE"):
        anchor_triton.block_residual(q, k, v, idx, cnt, out, None, block_q=bq, block_k=bk, return_mass=True)


def test_block_selection_states_its_density_to_the_anchor(monkeypatch):
    """The engine's block anchor passes the selection's exact density, which picks the anchor path in kernels.api (a
    dense text row makes the lists as wide as the KV blocks, so their width cannot tell)."""
    from comfyui_sparse_attention import kernels
    from comfyui_sparse_attention.engine.selection import BlockSelection
    seen = {}
    monkeypatch.setattr(kernels, "block_anchor_attention", lambda *a, **kw: seen.update(kw) or "done")
    idx, cnt = _lists(300, 64, 64, seed=1)
    sel = BlockSelection(idx, cnt, 64, 64, 0.0625)
    q = torch.zeros(1, 2, 300, 64)
    assert sel.anchor(q, q, q, mass=True) == "done"
    assert seen["density"] == 0.0625 and seen["return_mass"] is True and seen["validate"] is False


@pytest.mark.parametrize("precision", ["model", "fp8"])
def test_residual_of_works_a_few_heads_at_a_time(precision, monkeypatch):
    """The composed anchor's PyTorch residual (anchor_torch.residual_of) forms dense - sparse in fp32 a few heads at a
    time instead of from full fp32 copies of both: the same pair as encoding the full fp32 difference, a non-finite
    element kept to itself; operands of different shapes are refused."""
    if precision == "fp8" and FP8 is None:
        pytest.skip("torch has no float8_e4m3fn")
    from comfyui_sparse_attention.kernels import _residual, anchor_torch
    g = torch.Generator().manual_seed(3)
    dense = torch.randn(2, 5, 70, 64, generator=g).to(torch.bfloat16)
    sparse = (dense.float() + 0.1 * torch.randn(2, 5, 70, 64, generator=g)).to(torch.bfloat16)
    dense[1, 3, 7, 9] = float("inf")
    want = encode_residual(dense.float() - sparse.float(), precision, dense.dtype)
    monkeypatch.setattr(_residual, "CHUNK_ELEMS", 2 * 70 * 64 * 2)  # two heads of both batch rows per slice: 3 slices
    got = anchor_torch.residual_of(dense, sparse, precision)
    assert got[0].dtype == want[0].dtype and got[0].shape == dense.shape
    assert torch.equal(got[0].float().nan_to_num(7.0), want[0].float().nan_to_num(7.0))
    assert (got[1] is None) == (want[1] is None) and (got[1] is None or torch.equal(got[1], want[1]))
    bad = got[0][1, 3, 7].float()
    assert not torch.isfinite(bad[9]) and torch.isfinite(torch.cat([bad[:9], bad[10:]])).all()
    with pytest.raises(ValueError, match="minus must have"):
        encode_residual(dense, precision, dense.dtype, minus=sparse[:, :4])


def test_complement_lists_in_chunks():
    """kernels/attention_hopper.py's complement lists (the fused anchors walk them after the selected blocks): each
    row's KV blocks not in its list, sorted, padded with -1, with their counts; built a few rows at a time, the same
    lists as all rows at once."""
    from comfyui_sparse_attention.kernels.attention_hopper import complement_lists
    gen = torch.Generator().manual_seed(11)
    nkb = 7
    idx = torch.full((2, 3, 5, nkb), -1, dtype=torch.int32)
    cnt = torch.zeros((2, 3, 5), dtype=torch.int32)
    for row in range(30):
        keep = torch.sort(torch.randperm(nkb, generator=gen)[:row % (nkb + 1)]).values
        idx.view(30, nkb)[row, :len(keep)] = keep.to(torch.int32)
        cnt.view(30)[row] = len(keep)  # empty rows to full ones
    lists, counts = complement_lists(idx, cnt, nkb)
    assert lists.shape == (2, 3, 5, nkb) and lists.dtype == counts.dtype == torch.int32
    for row in range(30):
        kept = set(idx.view(30, nkb)[row, :cnt.view(30)[row]].tolist())
        want = [b for b in range(nkb) if b not in kept]
        assert counts.view(30)[row] == len(want)
        assert lists.view(30, nkb)[row].tolist() == want + [-1] * (nkb - len(want))
    chunked = complement_lists(idx, cnt, nkb, chunk_rows=4)
    assert torch.equal(chunked[0], lists) and torch.equal(chunked[1], counts)

