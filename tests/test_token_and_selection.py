"""PyTorch backend: token-sparse attention, grouping, pooled scores, group KV mass, top-k."""

import pytest
import torch
from sparse_ref import ref_attention, rel_l2, structured_qkv, token_allow

from comfyui_sparse_attention.kernels import (attention_dense, group_kv_mass, group_queries, pooled_block_scores,
                                               token_sparse_attention)


def random_token_lists(b, h, g, nk, max_k, seed=0, empty=()):
    gen = torch.Generator().manual_seed(seed)
    toks = torch.full((b, h, g, max_k), -1, dtype=torch.int32)
    cnt = torch.zeros((b, h, g), dtype=torch.int32)
    for bi in range(b):
        for hi in range(h):
            for gi in range(g):
                c = 0 if gi in empty else int(torch.randint(1, max_k + 1, (1,), generator=gen))
                toks[bi, hi, gi, :c] = torch.sort(torch.randperm(nk, generator=gen)[:c]).values.int()
                cnt[bi, hi, gi] = c
    return toks, cnt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,c,d", [(1000, 64, 64), (257, 128, 80), (4097, 128, 128)])
def test_token_sparse_matches_reference(dtype, n, c, d):
    q, k, v = structured_qkv(1, 2, n, d, dtype=dtype, seed=n)
    groups = group_queries(q, c)
    g = groups.shape[2]
    toks, cnt = random_token_lists(1, 2, g, n, min(n, 300), seed=n, empty=(1,))
    out = token_sparse_attention(q, k, v, groups, toks, cnt)
    ref, _ = ref_attention(q, k, v, token_allow(groups, toks, cnt, n, n))
    assert torch.isfinite(out).all()
    assert rel_l2(out, ref) <= (1e-5 if dtype == torch.float32 else 1e-2)
    empty_q = groups[0, 0, 1].long()
    empty_q = empty_q[empty_q >= 0]
    assert torch.equal(out[0, 0, empty_q], torch.zeros_like(out[0, 0, empty_q]))


def test_token_sparse_all_tokens_equals_dense():
    q, k, v = structured_qkv(2, 2, 300, 64, seed=4)
    groups = group_queries(q, 64)
    g = groups.shape[2]
    toks = torch.arange(300, dtype=torch.int32).expand(2, 2, g, 300).contiguous()
    cnt = torch.full((2, 2, g), 300, dtype=torch.int32)
    assert rel_l2(token_sparse_attention(q, k, v, groups, toks, cnt), attention_dense(q, k, v)) <= 1e-6


def test_token_sparse_bad_inputs():
    q, k, v = structured_qkv(1, 1, 128, 64)
    groups = group_queries(q, 64)
    toks = torch.tensor([[[[0, 1], [2, 3]]]], dtype=torch.int32)
    cnt = torch.full((1, 1, 2), 2, dtype=torch.int32)
    token_sparse_attention(q, k, v, groups, toks, cnt)
    with pytest.raises(ValueError, match="kv_tokens"):
        token_sparse_attention(q, k, v, groups, toks.flip(-1), cnt)
    with pytest.raises(ValueError, match="kv_tokens"):
        token_sparse_attention(q, k, v, groups, toks + 200, cnt)
    dup = groups.clone()
    dup[0, 0, 1, 0] = dup[0, 0, 0, 0]
    with pytest.raises(ValueError, match="q_groups"):
        token_sparse_attention(q, k, v, dup, toks, cnt)
    with pytest.raises(ValueError, match="kv_counts"):
        token_sparse_attention(q, k, v, groups, toks, cnt[..., :1])


@pytest.mark.parametrize("n,c", [(1000, 64), (4097, 128), (128, 128), (50, 64), (9000, 64), (8192, 128)])
def test_group_queries_is_an_equal_partition(n, c):
    q, _, _ = structured_qkv(2, 2, n, 64, seed=n)
    groups = group_queries(q, c)
    g = -(-n // c)
    assert groups.shape == (2, 2, g, c) and groups.dtype == torch.int32
    for bi in range(2):
        for hi in range(2):
            flat = groups[bi, hi].reshape(-1)
            real = flat[flat >= 0]
            assert torch.equal(torch.sort(real).values, torch.arange(n, dtype=torch.int32))
            full = (groups[bi, hi] >= 0).sum(-1)
            assert (full[:-1] == c).all()  # only the last group is padded
            assert int(full[-1]) == n - (g - 1) * c
    assert torch.equal(groups, group_queries(q, c))  # deterministic


def test_group_queries_lowers_within_group_variance():
    # queries drawn from 16 clusters, shuffled along the sequence: contiguous tiles mix clusters
    gen = torch.Generator().manual_seed(0)
    n, d, c = 2048, 64, 128
    centers = torch.randn(16, d, generator=gen) * 3
    labels = torch.randint(0, 16, (n,), generator=gen)
    q = (centers[labels] + 0.3 * torch.randn(n, d, generator=gen)).view(1, 1, n, d)

    def within(groups):
        x = q[0, 0][groups.reshape(-1, c).long()]
        return float(((x - x.mean(1, keepdim=True)) ** 2).sum())

    ours = within(group_queries(q, c))
    contiguous = within(torch.arange(n).view(1, 1, n // c, c))
    assert ours < 0.5 * contiguous


def clustered_queries(n, d, clusters, seed, heads=1):
    """(1, heads, n, d) fp32 queries drawn around ``clusters`` centres, shuffled along the sequence."""
    gen = torch.Generator().manual_seed(seed)
    centers = torch.randn(heads, clusters, d, generator=gen) * 3
    labels = torch.randint(0, clusters, (heads, n), generator=gen)
    return (torch.gather(centers, 1, labels.unsqueeze(-1).expand(heads, n, d))
            + 0.3 * torch.randn(heads, n, d, generator=gen)).unsqueeze(0)


def within_scatter(q, groups):
    """Summed squared distance of each full group's queries to their mean (all heads)."""
    c = groups.shape[-1]
    total = 0.0
    for hi in range(q.shape[1]):
        full = groups[0, hi][(groups[0, hi] >= 0).all(-1)].long()
        x = q[0, hi][full.reshape(-1)].view(-1, c, q.shape[-1])
        total += float(((x - x.mean(1, keepdim=True)) ** 2).sum())
    return total


def low_rank_queries(n, d, rank, seed, heads=2):
    """(1, heads, n, d) fp32 queries: a random ``rank``-dimensional subspace per head with decaying variances (20 down
    to 2 standard deviations), an offset, and isotropic noise of 0.1."""
    gen = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(heads, d, rank, generator=gen))[0]  # (heads, d, rank) orthonormal
    coef = torch.randn(heads, n, rank, generator=gen) * torch.linspace(20, 2, rank)
    return (coef @ basis.transpose(1, 2) + torch.randn(heads, 1, d, generator=gen)
            + 0.1 * torch.randn(heads, n, d, generator=gen)).unsqueeze(0)


@pytest.mark.parametrize("rank,dims", [(24, 32), (12, 16), (100, 32)])
def test_leading_subspace_holds_as_much_variance_as_the_eigenvectors(rank, dims):
    """grouping_dims: project_leading's subspace iteration (no eigendecomposition) keeps about as much of each head's
    variance as its ``dims`` leading eigenvectors, with a clear gap after them (rank < dims) and without (rank 100)."""
    from comfyui_sparse_attention.kernels.grouping_torch import project_leading
    q = low_rank_queries(6000, 128, rank, seed=rank)
    proj = project_leading(q, dims)
    assert proj.shape == (1, 2, 6000, dims) and proj.dtype == torch.float32
    for h in range(2):
        x = q[0, h] - q[0, h].mean(0)
        eig = torch.linalg.eigh(x.T.double() @ x.double())[0]
        best = float(eig[-dims:].sum() / eig.sum())  # the largest share any dims directions can hold
        p = proj[0, h] - proj[0, h].mean(0)
        ours = float((p.double() ** 2).sum() / (x.double() ** 2).sum())
        assert ours <= best + 1e-4 and ours >= best - (0.002 if rank < dims else 0.02), (ours, best)


def test_grouping_on_leading_directions_is_an_equal_partition_as_tight_as_all_of_them():
    """group_queries(dims=32) partitions exactly like dims 0 (ragged N, deterministic) and its groups are as tight in
    the full space when the queries' structure lives in a few directions; dims of at least D is D; bad dims raise."""
    n, c = 5000, 64
    q = low_rank_queries(n, 128, 24, seed=7)
    groups = group_queries(q, c, dims=32)
    g = -(-n // c)
    assert groups.shape == (1, 2, g, c) and groups.dtype == torch.int32
    for h in range(2):
        flat = groups[0, h].reshape(-1)
        assert torch.equal(torch.sort(flat[flat >= 0]).values, torch.arange(n, dtype=torch.int32))
    assert torch.equal(groups, group_queries(q, c, dims=32))
    full = group_queries(q, c)
    assert within_scatter(q, groups) <= 1.05 * within_scatter(q, full)
    contiguous = torch.arange(g * c).view(1, 1, g, c).expand(1, 2, g, c)
    assert within_scatter(q, groups) < 0.8 * within_scatter(q, torch.where(contiguous < n, contiguous, -1))
    small = q[..., :32].to(torch.bfloat16)  # D = 32: dims 32 is every coordinate
    assert torch.equal(group_queries(small, c, dims=32), group_queries(small, c))
    assert group_queries(q.to(torch.bfloat16), c, dims=16).shape == (1, 2, g, c)
    for bad in (8, 32.0, True, -1, "16"):
        with pytest.raises(ValueError, match="dims"):
            group_queries(q, c, dims=bad)
    with pytest.raises(ValueError, match="q must"):
        group_queries(None, c)
    from comfyui_sparse_attention.kernels.grouping_torch import subspace_device
    assert subspace_device(torch.device("mps")) == torch.device("cpu")  # no float64 there: the iteration on the CPU
    assert subspace_device(torch.device("cpu")) == torch.device("cpu")


def _group_from_original_order(q, c):
    """The grouping as it was before the points followed the permutation (kernels/grouping_torch.py, _group): every
    level gathers its points from the queries' original order. int32 (B, H, G, c)."""
    import math
    from comfyui_sparse_attention.kernels import grouping_torch as gt
    b, h, n, d = q.shape
    g = math.ceil(n / c)
    n_pad = g * c
    rows = q.reshape(b * h * n, d).float()
    base = (torch.arange(b * h) * n).view(b * h, 1, 1)
    perm = torch.arange(n_pad).expand(b * h, n_pad).clone()
    for level in gt._level_positions(n_pad, c, q.device):
        for length, pos, n_segs in level:
            ids = perm[:, pos].view(b * h, n_segs, length)
            pts = rows.index_select(0, (ids.clamp(max=n - 1) + base).view(-1))
            real = (ids < n).view(-1, length) if n_pad > n else None
            order = gt._principal_order(pts.view(b * h * n_segs, length, d), real)
            perm[:, pos] = torch.gather(ids.view(-1, length), 1, order).view(b * h, -1)
    return torch.where(perm < n, perm, -1).view(b, h, g, c).to(torch.int32)


@pytest.mark.parametrize("n,c,sliced", [(1000, 64, False), (4097, 128, False), (9000, 64, True), (8192, 128, True)])
def test_points_following_the_permutation_give_the_same_groups(n, c, sliced):
    """The grouping reorders each level's points inside their segment (kernels/grouping_torch.py, kernel_notes "v21")
    instead of gathering them from the original order: the same groups bit for bit, fp32 q (contiguous, or a slice
    along N as the policy passes a segment) left untouched."""
    gen = torch.Generator().manual_seed(n)
    full = torch.randn(2, 2, n + (500 if sliced else 0), 64, generator=gen)
    q = full[:, :, 250:250 + n] if sliced else full
    before = q.clone()
    assert torch.equal(group_queries(q, c), _group_from_original_order(q, c))
    assert torch.equal(q, before)
    # on 16 leading directions the projection is the grouping's own scratch, reordered in place
    from comfyui_sparse_attention.kernels.grouping_torch import project_leading
    assert torch.equal(group_queries(q, c, dims=16), _group_from_original_order(project_leading(q, 16), c))
    assert torch.equal(q, before)


def test_keep_at_threshold_checks_its_arguments():
    from comfyui_sparse_attention.kernels import keep_at_threshold
    scores = torch.rand(3, 100)
    with pytest.raises(ValueError, match="thresh"):
        keep_at_threshold(scores, torch.rand(3), 10)
    with pytest.raises(ValueError, match="scores"):
        keep_at_threshold(scores > 0.5, torch.rand(3, 1), 10)
    with pytest.raises(ValueError, match="k must"):
        keep_at_threshold(scores, torch.rand(3, 1), -1)
    with pytest.raises(ValueError, match="thresh"):  # another precision would compare differently in the kernel
        keep_at_threshold(scores, torch.rand(3, 1, dtype=torch.float64), 10)
    t = torch.full((3, 1), 0.5)
    assert torch.equal(keep_at_threshold(scores, t, 100), scores > 0.5)


@pytest.mark.parametrize("n", [16384, 12345])  # ragged: padding slots inside the subsampled segments
def test_subsampled_directions_group_as_tightly_as_exact_ones(monkeypatch, n):
    """Segments longer than 2 x SUBSAMPLE take their direction from a subsample (kernels/grouping_torch.py)."""
    from comfyui_sparse_attention.kernels import grouping_torch
    q = clustered_queries(n, 64, 40, seed=n, heads=2)
    sub = group_queries(q, 64)
    monkeypatch.setattr(grouping_torch, "SUBSAMPLE", 1 << 30)  # every segment the exact way
    exact = group_queries(q, 64)
    assert not torch.equal(sub, exact)  # the subsampled path ran
    assert within_scatter(q, sub) <= 1.05 * within_scatter(q, exact)
    contiguous = torch.arange(-(-n // 64) * 64).view(1, 1, -1, 64).expand(1, 2, -1, 64)
    assert within_scatter(q, sub) < 0.5 * within_scatter(q, torch.where(contiguous < n, contiguous, -1))


@pytest.mark.parametrize("length", [2049, 3000, 4096])  # the subsampled path (> 2 x SUBSAMPLE points)
def test_padding_slots_neither_steer_nor_join_the_order_of_a_long_segment(length):
    """Padding slots (ragged N) must not move the mean or the direction of a segment, and must sort last: filled
    with huge values, the real points keep exactly the order they have with harmless padding."""
    from comfyui_sparse_attention.kernels.grouping_torch import _principal_order
    x = clustered_queries(length, 16, 6, seed=length, heads=2)[0]  # (2, L, 16)
    real = torch.rand(2, length, generator=torch.Generator().manual_seed(1)) > 0.1
    calm = torch.where(real.unsqueeze(-1), x, x[:, :1])  # padding: copies of a real point
    wild = torch.where(real.unsqueeze(-1), x, torch.full_like(x, 1e4))
    a, b = _principal_order(calm, real), _principal_order(wild, real)
    assert torch.equal(a, b)
    for s in range(2):
        n_real = int(real[s].sum())
        assert real[s][a[s, :n_real]].all() and not real[s][a[s, n_real:]].any()


def test_grouping_ignores_autocast():
    """The grouping's products run in fp32 inside an autocast region too (the testbed samples under bf16 autocast;
    ComfyUI does not): the same groups either way."""
    q = clustered_queries(5000, 64, 10, seed=1)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        inside = group_queries(q, 64)
    assert torch.equal(inside, group_queries(q, 64))


def test_pooled_block_scores_match_definition():
    q, k, _ = structured_qkv(1, 2, 300, 64, nk=200, seed=2)
    scores = pooled_block_scores(q, k, block_q=128, block_k=64)
    assert scores.shape == (1, 2, 3, 4) and scores.dtype == torch.float32
    qm = torch.stack([q[:, :, 0:128].mean(2), q[:, :, 128:256].mean(2), q[:, :, 256:300].mean(2)], 2).double()
    km = torch.stack([k[:, :, i:i + 64].mean(2) for i in range(0, 200, 64)], 2).double()
    ref = torch.softmax(qm @ km.transpose(-1, -2) / 8.0, -1)
    assert torch.allclose(scores.double(), ref, atol=1e-6)
    assert torch.allclose(scores.sum(-1), torch.ones(1, 2, 3))


def test_group_kv_mass_matches_reference():
    n = 1000
    q, k, v = structured_qkv(1, 2, n, 64, seed=8)
    _, lse = attention_dense(q, k, v, return_lse=True)
    groups = group_queries(q, 128)
    mass = group_kv_mass(q, k, lse, groups)
    s = (q.double() @ k.double().transpose(-1, -2)) / 8.0
    p = torch.softmax(s, -1)
    ref = torch.zeros(1, 2, groups.shape[2], n, dtype=torch.float64)
    for hi in range(2):
        for gi in range(groups.shape[2]):
            rows = groups[0, hi, gi].long()
            ref[0, hi, gi] = p[0, hi, rows[rows >= 0]].sum(0)
    assert torch.allclose(mass.double(), ref, atol=1e-5, rtol=1e-4)
    # every query's probabilities sum to one: total mass per group = its number of real queries
    real = (groups >= 0).sum(-1).double()
    assert torch.allclose(mass.double().sum(-1), real, rtol=1e-4)


def test_group_kv_mass_ignores_empty_rows_and_bounds_memory(monkeypatch):
    from comfyui_sparse_attention.kernels import _torch_softmax
    q, k, v = structured_qkv(1, 1, 500, 64, seed=1)
    _, lse = attention_dense(q, k, v, return_lse=True)
    lse[0, 0, :10] = float("-inf")
    groups = group_queries(q, 64)
    full = group_kv_mass(q, k, lse, groups)
    monkeypatch.setattr(_torch_softmax, "CHUNK_ELEMS", 64 * 500 * 2)  # one group per chunk
    assert torch.allclose(group_kv_mass(q, k, lse, groups), full)
    assert torch.isfinite(full).all()


def test_token_list_bucket_caps_long_lists():
    """The token kernel's autotune key buckets the list width by powers of two up to 4096: lists whose longest
    row follows the data (11 340 at one anchor, 20 000 at the next) share one tuning instead of re-tuning the kernel
    in the middle of a run; short lists keep their own buckets."""
    pytest.importorskip("triton")
    from comfyui_sparse_attention.kernels._triton_common import LIST_BUCKET_CAP, list_bucket

    assert LIST_BUCKET_CAP == 4096
    assert list_bucket(11_340) == list_bucket(20_000) == list_bucket(40_000) == list_bucket(4096) == 4096
    assert [list_bucket(n) for n in (1, 90, 128, 129, 3000)] == [1, 128, 128, 256, 4096]


def _compact_case(n, d, seed, dtype=torch.float32):
    """q/k/v of n tokens, query groups of 16 and compact lists (kernels.compact_keep) of a random keep mask with an
    empty and a full group; with n > 65 536 the lists span two segments."""
    from comfyui_sparse_attention.kernels import compact_keep
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, n, d, generator=g).to(dtype) for _ in range(3))
    perm = torch.stack([torch.randperm(n, generator=g)[:64] for _ in range(2)]).view(1, 2, 4, 16).to(torch.int32)
    perm[0, 0, 3, 10:] = -1  # a padded group
    keep = torch.rand(1, 2, 4, n, generator=g) < 40 / n
    keep[0, 0, 1] = False           # a group with nothing to attend
    keep[0, 1, 2, n - 70:] = True   # the last tokens (the second segment when n > 65 536)
    low, ends, cnt = compact_keep(keep, backend="torch")
    return q, k, v, perm, low, ends, cnt


@pytest.mark.parametrize("n", [3000, 70_000])
def test_compact_token_lists_give_the_decoded_lists_result(n):
    """token_sparse_attention_compact (the engine's cached int16 lists) equals token_sparse_attention on the decoded
    int32 lists, with and without an fp8 residual; bad compact lists are ValueErrors naming the argument."""
    from comfyui_sparse_attention.kernels import token_sparse_attention_compact
    from comfyui_sparse_attention.kernels.compact_torch import decode_lists
    q, k, v, groups, low, ends, cnt = _compact_case(n, 64, seed=n)
    assert low.shape[-1] % 16 == 0 and ends.shape[-1] == (2 if n > 65536 else 1)
    toks = decode_lists(low, ends)
    ref = token_sparse_attention(q, k, v, groups, toks, cnt)
    out = token_sparse_attention_compact(q, k, v, groups, low, ends, cnt)
    assert torch.equal(out, ref) and out[0, 1].abs().sum() > 0
    res = (torch.randn(q.shape).to(torch.float8_e4m3fn), torch.rand(1, 2, n, 1))
    assert torch.equal(token_sparse_attention_compact(q, k, v, groups, low, ends, cnt, residual=res),
                       token_sparse_attention(q, k, v, groups, toks, cnt, residual=res))
    with pytest.raises(ValueError, match="kv_low"):
        token_sparse_attention_compact(q, k, v, groups, low.int(), ends, cnt)
    with pytest.raises(ValueError, match="seg_ends"):
        token_sparse_attention_compact(q, k, v, groups, low, ends[..., :0], cnt)
    bad = cnt.clone()
    bad[0, 0, 0] = low.shape[-1] + 1
    with pytest.raises(ValueError, match="kv_counts"):
        token_sparse_attention_compact(q, k, v, groups, low, ends, bad)


def test_token_kernel_launch_keys_follow_no_data(monkeypatch):
    """The token kernel's launch (recorded, not run) gets the capped list bucket and a 16-aligned row stride for
    lists of any longest row: compact lists of two anchors with different widths share one tuning key and one
    integer specialisation (docs/kernel_notes.md, "v7")."""
    pytest.importorskip("triton")
    from comfyui_sparse_attention.kernels import compact_keep, token_sparse_triton
    real = token_sparse_triton._token_fwd
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append({**dict(zip(real.arg_names, args)), **kw})
    monkeypatch.setattr(token_sparse_triton, "_token_fwd", Recorder())
    g = torch.Generator().manual_seed(0)
    n = 70_000
    q, k, v = (torch.randn(1, 1, n, 64, generator=g) for _ in range(3))
    groups = torch.randperm(n, generator=g)[:32].view(1, 1, 2, 16).to(torch.int32)
    for longest in (5_001, 20_003):  # one anchor's longest list, then a later anchor's
        keep = torch.zeros(1, 1, 2, n, dtype=torch.bool)
        keep[..., :longest] = True
        keep[0, 0, 1] = torch.rand(n, generator=g) < 0.01
        low, ends, cnt = compact_keep(keep, backend="torch")
        token_sparse_triton.token_sparse_attention_compact(q, k, v, groups, low, ends, cnt, validate=False)
    assert [a["K_BUCKET"] for a in launches] == [4096, 4096]
    assert all(a["MAX_K"] % 16 == 0 and a["N_SEG"] == 2 for a in launches)


def test_a_selection_with_nothing_sparse_runs_at_long_sequences():
    """mc_sparse at density 1 (or a layer factor that reaches it) selects nothing sparse: its empty compact lists
    must run at more than 65 536 tokens (a segment count check once rejected them), giving dense attention."""
    from comfyui_sparse_attention.engine import SparseConfig, TokenLayout
    from comfyui_sparse_attention.engine.policy_mc_sparse import build_mc_sparse
    g = torch.Generator().manual_seed(1)
    n = 70_000
    q, k, v = (torch.randn(1, 1, n, 16, generator=g) for _ in range(3))
    sel = build_mc_sparse(q, k, None, TokenLayout(grid=(1, 1, n)), SparseConfig(method="mc_sparse", density=1.0),
                          backend="torch")
    assert sel.kv_low.shape[2] == 0 and sel.seg_ends.shape[-1] == 2
    rows = torch.arange(0, n, 9973)
    out = sel.run(q, k, v)[:, :, rows]
    ref = torch.softmax((q[:, :, rows] @ k.transpose(-1, -2)) / 4.0, -1) @ v
    assert rel_l2(out, ref) <= 1e-4


def test_token_selection_runs_on_its_compact_lists(monkeypatch):
    """TokenSelection.run hands the cached int16 lists to the kernels (no int32 decode on the reuse path)."""
    from comfyui_sparse_attention import kernels
    from comfyui_sparse_attention.engine.selection import TokenSelection
    q, k, v, groups, low, ends, cnt = _compact_case(3000, 64, seed=5)
    sel = TokenSelection(groups, low, ends, cnt, None, 0.1)
    want = token_sparse_attention(q, k, v, groups, sel.kv_tokens(), cnt)

    def refuse(*_, **__):
        raise AssertionError("the reuse path decoded the lists")
    monkeypatch.setattr(TokenSelection, "kv_tokens", refuse)
    monkeypatch.setattr(kernels, "token_sparse_attention", refuse)
    assert torch.equal(sel.run(q, k, v), want)
