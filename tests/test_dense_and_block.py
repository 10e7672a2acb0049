"""PyTorch backend: dense and block-sparse attention against float64 references."""

import pytest
import torch
from sparse_ref import block_allow, random_block_lists, ref_attention, rel_l2, structured_qkv

from comfyui_sparse_attention.kernels import attention_dense, block_sparse_attention

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,d", [(1000, 64), (257, 80), (130, 96), (200, 128)])
def test_dense_matches_reference(dtype, n, d):
    q, k, v = structured_qkv(2, 2, n, d, dtype=dtype, seed=n + d)
    out, lse = attention_dense(q, k, v, return_lse=True, backend="torch")
    ref, ref_lse = ref_attention(q, k, v, torch.ones(2, 2, n, n, dtype=torch.bool))
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    assert rel_l2(out, ref) <= TOL[dtype]
    assert torch.allclose(lse.double(), ref_lse, atol=1e-4, rtol=1e-5)


def test_dense_cross_lengths_and_scale():
    q, k, v = structured_qkv(2, 3, 150, 64, nk=77, seed=3)
    out, lse = attention_dense(q, k, v, return_lse=True, scale=0.2)
    ref, ref_lse = ref_attention(q, k, v, torch.ones(2, 3, 150, 77, dtype=torch.bool), scale=0.2)
    assert rel_l2(out, ref) <= 1e-5
    assert torch.allclose(lse.double(), ref_lse, atol=1e-4, rtol=1e-5)


def test_dense_chunking_is_exact(monkeypatch):
    from comfyui_sparse_attention.kernels import _torch_softmax
    q, k, v = structured_qkv(1, 2, 300, 64, seed=9)
    full = attention_dense(q, k, v)
    monkeypatch.setattr(_torch_softmax, "CHUNK_ELEMS", 300 * 2 * 2 * 7)  # 7 query rows per chunk
    chunked = attention_dense(q, k, v)
    assert torch.allclose(full, chunked, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,bq,bk", [(1000, 64, 128), (4097, 128, 64), (700, 128, 128), (333, 64, 64)])
def test_block_sparse_matches_reference(dtype, n, bq, bk):
    d = 64
    q, k, v = structured_qkv(1, 2, n, d, dtype=dtype, seed=n)
    nqb, nkb = -(-n // bq), -(-n // bk)
    idx, cnt = random_block_lists(1, 2, nqb, nkb, max(1, nkb // 2), seed=n, empty_rows=(1,), full_rows=(0,))
    out = block_sparse_attention(q, k, v, idx, cnt, block_q=bq, block_k=bk)
    ref, _ = ref_attention(q, k, v, block_allow(idx, cnt, n, n, bq, bk))
    assert torch.isfinite(out).all()
    assert rel_l2(out, ref) <= TOL[dtype]
    empty = slice(bq, min(2 * bq, n))
    assert torch.equal(out[:, :, empty], torch.zeros_like(out[:, :, empty]))


def test_block_sparse_density_one_equals_dense():
    q, k, v = structured_qkv(2, 2, 1000, 64, seed=1)
    nqb, nkb = 8, 16
    idx = torch.arange(nkb, dtype=torch.int32).expand(2, 2, nqb, nkb).contiguous()
    cnt = torch.full((2, 2, nqb), nkb, dtype=torch.int32)
    sparse = block_sparse_attention(q, k, v, idx, cnt, block_q=128, block_k=64)
    assert rel_l2(sparse, attention_dense(q, k, v)) <= 1e-6


def test_block_sparse_bad_inputs_name_the_argument():
    q, k, v = structured_qkv(1, 1, 256, 64)
    idx = torch.zeros(1, 1, 2, 1, dtype=torch.int32)
    cnt = torch.ones(1, 1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_q"):
        block_sparse_attention(q, k, v, idx, cnt, block_q=32, block_k=128)
    with pytest.raises(ValueError, match="kv_indices"):
        block_sparse_attention(q, k, v, idx + 5, cnt, block_q=128, block_k=128)
    with pytest.raises(ValueError, match="kv_counts"):
        block_sparse_attention(q, k, v, idx, cnt + 3, block_q=128, block_k=128)
    with pytest.raises(ValueError, match="kv_indices"):
        block_sparse_attention(q, k, v, idx.float(), cnt, block_q=128, block_k=128)
    with pytest.raises(ValueError, match="kv_indices"):
        two = torch.tensor([[[[1, 0], [0, 1]]]], dtype=torch.int32)
        block_sparse_attention(q, k, v, two, cnt * 2, block_q=128, block_k=128)
    with pytest.raises(ValueError, match="dtype"):
        attention_dense(q, k.half(), v)
    with pytest.raises(ValueError, match="q must have layout"):
        attention_dense(q[0], k, v)
    with pytest.raises(ValueError, match="backend"):
        attention_dense(q, k, v, backend="cuda")
    with pytest.raises(ValueError, match="triton"):
        attention_dense(q, k, v, backend="triton")  # CPU tensors: Triton cannot run here


def test_kernel_inputs_beyond_32bit_offsets_are_made_contiguous(monkeypatch):
    """q/k/v viewed out of a fused QKV+MLP projection (HunyuanVideo's single blocks) have a token stride of
    the whole projection width; at ~119k tokens their offsets pass 2**31, which the kernels' 32-bit pointer
    arithmetic cannot address: such views are copied contiguous, small ones are passed as they are."""
    from comfyui_sparse_attention.kernels import api
    monkeypatch.setattr(api, "INT32_SPAN", 4096)
    b, n, h, d = 1, 64, 2, 16
    fused = torch.randn(b, n, 3 * h * d + 96)  # qkv + an MLP part, as linear1 of a single-stream block
    q, k, v = (fused[..., i * h * d:(i + 1) * h * d].view(b, n, h, d).transpose(1, 2) for i in range(3))
    small = torch.randn(1, 2, 8, 16)
    q2, k2, small2 = api._addressable(q, k, small)
    assert q2.is_contiguous() and k2.is_contiguous() and torch.equal(q2, q) and torch.equal(k2, k)
    assert small2.data_ptr() == small.data_ptr()
    assert api._addressable(torch.randn(2, 3, 4).transpose(1, 2))[0].is_contiguous()  # strided last dim
    with pytest.raises(ValueError, match="32-bit"):
        api._addressable(torch.randn(1, 1, 4097, 1))


def test_heavy_first_row_order_is_remembered_until_the_counts_change():
    """The Triton wrapper's row order (longest list first) is sorted once per cached selection, and again after
    an in-place change of the counts (the tensor's version counter)."""
    from comfyui_sparse_attention.kernels.block_sparse_triton import heavy_first_order
    counts = torch.tensor([[[1, 3, 2], [3, 0, 2]]], dtype=torch.int32)
    first = heavy_first_order(counts)
    assert first.dtype == torch.int32 and first.tolist() == [1, 3, 2, 5, 0, 4]
    assert heavy_first_order(counts) is first  # remembered: no new sort
    counts[0, 0, 0] = 9
    again = heavy_first_order(counts)
    assert again is not first and again.tolist() == [0, 1, 3, 2, 5, 4]
    other = counts.clone()  # another tensor: its own order
    assert heavy_first_order(other) is not again and heavy_first_order(other).tolist() == again.tolist()
    with torch.inference_mode():  # as ComfyUI samples: inference tensors have no version counter
        frozen = torch.tensor([[[2, 5, 1]]], dtype=torch.int32)
        order = heavy_first_order(frozen)
        assert order.tolist() == [1, 0, 2] and heavy_first_order(frozen) is order
    assert heavy_first_order(frozen) is order  # outside inference mode too
