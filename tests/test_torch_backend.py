"""PyTorch backend built on scaled_dot_product_attention: chunk planning, empty rows, ragged blocks, skewed
lists, dtypes, the memory bound, the log-once backend message and NaN-free group mass."""

import logging
import math

import pytest
import torch
from sparse_ref import (block_allow, random_block_lists, ref_attention, rel_l2, structured_qkv,
                        token_allow)
from torch.utils._python_dispatch import TorchDispatchMode

from comfyui_sparse_attention.kernels import (_torch_softmax, attention_dense, backend, block_sparse_attention,
                                               group_kv_mass, group_queries, token_sparse_attention)

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def skewed_block_lists(b, h, nqb, nkb, seed):
    """Counts from 0 to nkb: a few empty and a few full rows, many lengths, some repeated."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.full((b, h, nqb, nkb), -1, dtype=torch.int32)
    cnt = torch.zeros((b, h, nqb), dtype=torch.int32)
    for bi in range(b):
        for hi in range(h):
            for r in range(nqb):
                c = [0, nkb, 1, nkb // 2][r] if r < 4 else int(torch.randint(0, nkb + 1, (1,), generator=gen))
                idx[bi, hi, r, :c] = torch.sort(torch.randperm(nkb, generator=gen)[:c]).values.int()
                cnt[bi, hi, r] = c
    return idx, cnt


def skewed_token_lists(b, h, g, nk, seed):
    gen = torch.Generator().manual_seed(seed)
    toks = torch.full((b, h, g, nk), -1, dtype=torch.int32)
    cnt = torch.zeros((b, h, g), dtype=torch.int32)
    for bi in range(b):
        for hi in range(h):
            for gi in range(g):
                c = 0 if gi == 1 else int(torch.randint(1, nk + 1, (1,), generator=gen)) // (1 + gi % 3)
                toks[bi, hi, gi, :c] = torch.sort(torch.randperm(nk, generator=gen)[:c]).values.int()
                cnt[bi, hi, gi] = c
    return toks, cnt


def test_plan_chunks_covers_rows_and_masks_only_mixed_chunks(monkeypatch):
    monkeypatch.setattr(_torch_softmax, "MIN_RUN_ROWS", 3)
    lengths = [40] * 7 + [39, 38, 30, 12, 11, 11, 5] + [3] * 3 + [1]
    chunks = _torch_softmax.plan_chunks(lengths, lambda length: 4)
    pos = 0
    for start, stop, longest, mixed in chunks:
        assert start == pos and stop > start and stop - start <= 4  # in order, contiguous, within max_rows
        pos = stop
        assert longest == lengths[start] and mixed == (len(set(lengths[start:stop])) > 1)
        if mixed:  # merged short runs waste at most MERGE_SLACK of the longest row
            assert min(lengths[start:stop]) >= (1 - _torch_softmax.MERGE_SLACK) * longest
    assert pos == len(lengths)
    # a run of MIN_RUN_ROWS equal lengths is never merged with other lengths
    assert all(not m for s, e, _, m in chunks if lengths[s] in (40, 3))


@pytest.mark.parametrize("matmul", [True, False])
@pytest.mark.parametrize("min_run,slack", [(1, 0.125), (8, 0.125), (10**9, 1.0)])
@pytest.mark.parametrize("n,bq,bk", [(700, 128, 64), (333, 64, 128)])
def test_block_sparse_skewed_ragged_lists_match_reference(monkeypatch, matmul, min_run, slack, n, bq, bk):
    """Every row length from empty to full, ragged last query and KV blocks; chunks exact-length only
    (min_run 1), the default plan, or everything merged into masked chunks (slack 1); fp32 rows through
    the CPU matmul path or through SDPA."""
    monkeypatch.setattr(_torch_softmax, "CPU_FP32_MATMUL", matmul)
    monkeypatch.setattr(_torch_softmax, "MATMUL_SCORE_ELEMS", 2 * bq * n)  # sub-chunks of ~2 rows
    monkeypatch.setattr(_torch_softmax, "MIN_RUN_ROWS", min_run)
    monkeypatch.setattr(_torch_softmax, "MERGE_SLACK", slack)
    monkeypatch.setitem(_torch_softmax.GATHER_ELEMS, "cpu", 3 * 2 * 64 * 640)  # several chunks per length
    q, k, v = structured_qkv(2, 2, n, 64, seed=n + bq)
    nqb, nkb = -(-n // bq), -(-n // bk)
    idx, cnt = skewed_block_lists(2, 2, nqb, nkb, seed=n)
    assert bool((cnt == nkb).any()) and bool((cnt == 0).any())
    assert bool((idx == nkb - 1).any())  # the ragged last KV block is listed
    out = block_sparse_attention(q, k, v, idx, cnt, block_q=bq, block_k=bk, backend="torch")
    ref, _ = ref_attention(q, k, v, block_allow(idx, cnt, n, n, bq, bk))
    assert torch.isfinite(out).all()
    assert rel_l2(out, ref) <= 1e-5
    assert torch.equal(out[:, :, :bq], torch.zeros_like(out[:, :, :bq]))  # query block 0 of each head: empty


@pytest.mark.parametrize("matmul,c", [(True, 128), (False, 128), (True, 64)])
@pytest.mark.parametrize("min_run,slack", [(1, 0.125), (8, 0.125), (10**9, 1.0)])
def test_token_sparse_skewed_lists_match_reference(monkeypatch, matmul, c, min_run, slack):
    monkeypatch.setattr(_torch_softmax, "CPU_FP32_MATMUL", matmul)
    monkeypatch.setattr(_torch_softmax, "MIN_RUN_ROWS", min_run)
    monkeypatch.setattr(_torch_softmax, "MERGE_SLACK", slack)
    monkeypatch.setitem(_torch_softmax.GATHER_ELEMS, "cpu", 2 * 64 * 300)
    n = 300
    q, k, v = structured_qkv(1, 2, n, 64, seed=5)
    groups = group_queries(q, c)
    toks, cnt = skewed_token_lists(1, 2, groups.shape[2], n, seed=5)
    out = token_sparse_attention(q, k, v, groups, toks, cnt, backend="torch")
    ref, _ = ref_attention(q, k, v, token_allow(groups, toks, cnt, n, n))
    assert torch.isfinite(out).all()
    assert rel_l2(out, ref) <= 1e-5
    empty_q = groups[0, 0, 1].long()
    assert torch.equal(out[0, 0, empty_q[empty_q >= 0]], torch.zeros(int((empty_q >= 0).sum()), 64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_rows_empty_give_zeros_in_every_dtype(dtype):
    q, k, v = structured_qkv(1, 2, 200, 64, dtype=dtype)
    idx = torch.zeros(1, 2, 4, 3, dtype=torch.int32)
    cnt = torch.zeros(1, 2, 4, dtype=torch.int32)
    out = block_sparse_attention(q, k, v, idx, cnt, block_q=64, block_k=64, backend="torch")
    assert out.dtype == dtype and torch.equal(out, torch.zeros_like(out))
    groups = group_queries(q, 64)
    toks = torch.zeros(1, 2, groups.shape[2], 5, dtype=torch.int32)
    out = token_sparse_attention(q, k, v, groups, toks, torch.zeros(1, 2, groups.shape[2], dtype=torch.int32),
                                 backend="torch")
    assert out.dtype == dtype and torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtypes_match_reference_and_keep_dtype(dtype):
    n = 333
    q, k, v = structured_qkv(1, 2, n, 64, dtype=dtype, seed=11)
    out, lse = attention_dense(q, k, v, return_lse=True, backend="torch")
    ref, ref_lse = ref_attention(q, k, v, torch.ones(1, 2, n, n, dtype=torch.bool))
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert rel_l2(out, ref) <= TOL[dtype] and torch.allclose(lse.double(), ref_lse, atol=1e-3, rtol=1e-4)
    idx, cnt = random_block_lists(1, 2, 6, 6, 4, seed=3, empty_rows=(2,))
    out = block_sparse_attention(q, k, v, idx, cnt, block_q=64, block_k=64, backend="torch")
    ref, _ = ref_attention(q, k, v, block_allow(idx, cnt, n, n, 64, 64))
    assert out.dtype == dtype and torch.isfinite(out).all() and rel_l2(out, ref) <= TOL[dtype]
    groups = group_queries(q, 64)
    toks, tcnt = skewed_token_lists(1, 2, groups.shape[2], n, seed=3)
    out = token_sparse_attention(q, k, v, groups, toks, tcnt, backend="torch")
    ref, _ = ref_attention(q, k, v, token_allow(groups, toks, tcnt, n, n))
    assert out.dtype == dtype and torch.isfinite(out).all() and rel_l2(out, ref) <= TOL[dtype]
    mass = group_kv_mass(q, k, lse, groups, backend="torch")
    p = torch.softmax(q.double() @ k.double().transpose(-1, -2) / 8.0, -1)
    ref_mass = torch.stack([p[0, hi, groups[0, hi, gi][groups[0, hi, gi] >= 0].long()].sum(0)
                            for hi in range(2) for gi in range(groups.shape[2])]).view(mass.shape)
    assert mass.dtype == torch.float32 and torch.allclose(mass.double(), ref_mass, atol=1e-3, rtol=1e-2)


def test_unfused_sdpa_path_chunks_and_matches(monkeypatch):
    """Devices whose SDPA may build the scores (e.g. Apple MPS) take the chunked path: dense in query
    chunks with the LSE from fp32 logsumexp, sparse chunks capped by CHUNK_ELEMS; run here on CPU."""
    n = 300
    q, k, v = structured_qkv(1, 2, n, 64, seed=2)
    fused_out, fused_lse = attention_dense(q, k, v, return_lse=True, backend="torch")
    idx, cnt = random_block_lists(1, 2, 5, 5, 5, seed=1, empty_rows=(1,), full_rows=(0,))
    fused_bs = block_sparse_attention(q, k, v, idx, cnt, block_q=64, block_k=64, backend="torch")
    monkeypatch.setattr(_torch_softmax, "FUSED_SDPA_DEVICES", ())
    monkeypatch.setattr(_torch_softmax, "CHUNK_ELEMS", 2 * n * 7)  # 7 query rows per dense chunk
    out, lse = attention_dense(q, k, v, return_lse=True, backend="torch")
    assert rel_l2(out, fused_out) <= 1e-6 and torch.allclose(lse, fused_lse, atol=1e-5)
    assert rel_l2(block_sparse_attention(q, k, v, idx, cnt, block_q=64, block_k=64, backend="torch"),
                  fused_bs) <= 1e-6


class LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        res = func(*args, **(kwargs or {}))
        for t in res if isinstance(res, (tuple, list)) else (res,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return res


def test_no_primitive_materialises_the_score_matrix(monkeypatch):
    """With the chunk budgets set small, no op of the PyTorch backend produces a tensor anywhere near
    N x N elements per head (the tracker itself sees a naive q @ k^T)."""
    n, d = 2048, 64
    monkeypatch.setattr(_torch_softmax, "CHUNK_ELEMS", 1 << 16)
    monkeypatch.setitem(_torch_softmax.GATHER_ELEMS, "cpu", 1 << 16)
    monkeypatch.setattr(_torch_softmax, "FUSED_SDPA_DEVICES", ())  # the most memory-hungry path
    q, k, v = structured_qkv(1, 2, n, d, seed=1)
    bound = n * n // 8
    with LargestTensor() as naive:
        torch.matmul(q, k.transpose(-1, -2))
    assert naive.largest >= 2 * n * n
    idx, cnt = random_block_lists(1, 2, n // 128, n // 128, n // 128, seed=0, full_rows=(0, 1))
    groups = group_queries(q, 128)
    toks = torch.arange(n, dtype=torch.int32).expand(1, 2, groups.shape[2], n).contiguous()
    tcnt = torch.full((1, 2, groups.shape[2]), n, dtype=torch.int32)
    with LargestTensor() as tracker:
        _, lse = attention_dense(q, k, v, return_lse=True, backend="torch")
        block_sparse_attention(q, k, v, idx, cnt, block_q=128, block_k=128, backend="torch")
        token_sparse_attention(q, k, v, groups, toks, tcnt, backend="torch")
        group_kv_mass(q, k, lse, groups, backend="torch")
    assert tracker.largest <= max(bound, groups.shape[2] * n * 2), tracker.largest


def test_backend_choice_is_logged_once_per_primitive_and_device(monkeypatch, caplog):
    monkeypatch.setattr(backend, "_announced", set())
    q, k, v = structured_qkv(1, 1, 128, 64)
    idx = torch.zeros(1, 1, 1, 1, dtype=torch.int32)
    cnt = torch.ones(1, 1, 1, dtype=torch.int32)
    with caplog.at_level(logging.INFO, logger=backend.log.name):
        for _ in range(3):
            block_sparse_attention(q, k, v, idx, cnt, block_q=128, block_k=128)
            attention_dense(q, k, v, backend="torch")
            group_queries(q, 64)
    msgs = [r.getMessage() for r in caplog.records if r.name == backend.log.name]
    for name in ("block_sparse_attention", "attention_dense", "group_queries"):
        mine = [m for m in msgs if f" {name} on cpu " in m]
        assert len(mine) == 1 and "PyTorch backend" in mine[0], msgs


def test_group_kv_mass_inconsistent_lse_gives_no_nan():
    """Keys scoring far above an LSE that is too small (or -inf / NaN rows) must not give inf or NaN:
    each query contributes at most 1 per key, -inf and NaN rows nothing."""
    n = 256
    q, k, v = structured_qkv(1, 2, n, 64, seed=4)
    q = q * 6.0  # scores well beyond exp's fp32 range once the LSE is lowered
    _, lse = attention_dense(q, k, v, return_lse=True, backend="torch")
    groups = group_queries(q, 64)
    bad = lse - 200.0
    bad[0, 0, :20] = float("-inf")
    bad[0, 1, :5] = float("nan")
    mass = group_kv_mass(q, k, bad, groups, backend="torch")
    assert torch.isfinite(mass).all()
    real = (groups >= 0).sum(-1, keepdim=True)
    assert (mass >= 0).all() and (mass <= real).all()
    skipped = torch.isneginf(bad) | torch.isnan(bad)
    only_skipped = groups.clone()
    only_skipped[~torch.gather(skipped, 2, groups.clamp(min=0).long().view(1, 2, -1)).view(groups.shape)] = -1
    assert torch.equal(group_kv_mass(q, k, bad, only_skipped, backend="torch"), torch.zeros_like(mass))
    assert math.isclose(float(group_kv_mass(q, k, lse, groups, backend="torch").sum()), 2 * n, rel_tol=1e-4)


@pytest.mark.parametrize("budget", [64 * 300 * 3, 64 * 100, 1])
def test_group_kv_mass_chunking_is_exact(monkeypatch, budget):
    """Chunks of several groups, of key ranges within one group, and of single keys give the same mass."""
    q, k, v = structured_qkv(1, 2, 300, 64, seed=6)
    _, lse = attention_dense(q, k, v, return_lse=True, backend="torch")
    groups = group_queries(q, 64)
    whole = group_kv_mass(q, k, lse, groups, backend="torch")
    monkeypatch.setitem(_torch_softmax.SCORE_ELEMS, "cpu", budget)
    assert torch.allclose(group_kv_mass(q, k, lse, groups, backend="torch"), whole, atol=1e-6, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_torch_backend_on_cuda_matches_reference(dtype):
    """The PyTorch backend on CUDA (SDPA's flash / memory-efficient kernels, bmm with fp32 output) against
    float64 references: skewed ragged block lists, skewed token lists, dense + LSE, group mass."""
    n, bq, bk = 700, 128, 64
    q, k, v = structured_qkv(2, 2, n, 64, dtype=dtype, seed=21)
    idx, cnt = skewed_block_lists(2, 2, -(-n // bq), -(-n // bk), seed=2)
    groups = group_queries(q, 128)
    toks, tcnt = skewed_token_lists(2, 2, groups.shape[2], n, seed=2)
    cu = [t.cuda() for t in (q, k, v, idx, cnt, groups, toks, tcnt)]
    tol = TOL[dtype] if dtype != torch.float32 else 1e-4  # CUDA fp32 matmuls may use TF32
    out = block_sparse_attention(*cu[:5], block_q=bq, block_k=bk, backend="torch").cpu()
    assert rel_l2(out, ref_attention(q, k, v, block_allow(idx, cnt, n, n, bq, bk))[0]) <= tol
    out = token_sparse_attention(*cu[:3], *cu[5:], backend="torch").cpu()
    assert rel_l2(out, ref_attention(q, k, v, token_allow(groups, toks, tcnt, n, n))[0]) <= tol
    out, lse = attention_dense(*cu[:3], return_lse=True, backend="torch")
    ref, ref_lse = ref_attention(q, k, v, torch.ones(2, 2, n, n, dtype=torch.bool))
    assert rel_l2(out.cpu(), ref) <= tol and torch.allclose(lse.cpu().double(), ref_lse, atol=2e-3, rtol=1e-3)
    mass = group_kv_mass(cu[0], cu[1], lse, cu[5], backend="torch").cpu()
    assert torch.isfinite(mass).all()
    assert torch.allclose(mass.double().sum(-1), (groups >= 0).sum(-1).double(), rtol=1e-2)


@pytest.mark.parametrize("value,on", [("1", True), ("true", True), ("ON", True), (" True ", True), ("0", False),
                                      ("false", False), ("", False), ("off", False), (None, False)])
def test_the_interpreter_switch_reads_as_triton_reads_it(monkeypatch, value, on):
    """TRITON_INTERPRET as Triton reads it (1 / true / on): "false" must not make the kernels take CPU tensors and
    the fp8 store round in software while Triton compiles for the GPU."""
    if value is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", value)
    assert backend.interpreting() is on
