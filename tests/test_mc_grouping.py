"""mc_sparse grouping options and edge cases: cuboid groups of the latent grid, calls with no image tokens."""

import pytest
import torch

from comfyui_sparse_attention.engine import CallContext, SparseConfig, SparseEngine, TokenLayout
from comfyui_sparse_attention.engine.policy_mc_sparse import cuboid_groups, cuboid_shape
from comfyui_sparse_attention.engine.synthetic import SyntheticVideoAttention, rel_l2


def test_cuboid_tiles():
    assert cuboid_shape((16, 32, 32), 64) == (1, 8, 8)
    assert cuboid_shape((21, 45, 80), 128) == (2, 8, 8)
    assert cuboid_shape((1, 64, 64), 128) == (1, 8, 16)
    assert cuboid_shape(None, 64) == (1, 1, 64)


def test_cuboid_groups_partition_the_image_into_neighbourhoods():
    grid = (3, 10, 12)
    g = cuboid_groups(TokenLayout(grid=grid), 360, 64, "cpu")
    flat = g.view(-1)
    assert g.shape == (1, 1, 6, 64) and sorted(flat[flat >= 0].tolist()) == list(range(360))
    first = g[0, 0, 0].long()  # an 8x8 tile of frame 0: rows 0-7, cols 0-7
    rows, cols, frames = first // 12 % 10, first % 12, first // 120
    assert frames.max() == 0 and rows.max() - rows.min() == 7 and cols.max() - cols.min() == 7
    one_d = cuboid_groups(TokenLayout(), 100, 64, "cpu")
    assert one_d[0, 0, 0].tolist() == list(range(64)) and one_d[0, 0, 1, 36:].eq(-1).all()


def test_cuboid_grouping_runs_and_tracks_dense():
    pr = SyntheticVideoAttention(frames=4, height=16, width=16, text=32, heads=2, head_dim=64, steps=4, seed=3)
    eng = SparseEngine(SparseConfig(method="mc_sparse", grouping="cuboid", density=0.25, min_tokens=0,
                                    backend="torch", group_size=64))
    eng.begin_run()
    errs = []
    for s in range(4):
        q, k, v = pr.qkv(s)
        out = eng.attend(q, k, v, CallContext(layer=0, step=s, layout=pr.layout))
        errs.append(rel_l2(out, torch.nn.functional.scaled_dot_product_attention(q, k, v)))
    stats = eng.end_run().totals()
    assert stats["anchors"] == 1 and stats["reuses"] == 3
    assert errs[0] < 1e-5 and max(errs) < 0.2  # the anchor is exact


def test_mc_sparse_with_no_image_tokens_goes_dense_not_wrong():
    q, k, v = (torch.randn(1, 2, 100, 64, generator=torch.Generator().manual_seed(i)) for i in range(3))
    eng = SparseEngine(SparseConfig(method="mc_sparse", density=0.15, min_tokens=0, backend="torch", group_size=64))
    eng.begin_run()
    lay = TokenLayout(text_len=100)
    outs = [eng.attend(q, k, v, CallContext(layer=0, step=s, layout=lay)) for s in range(2)]
    t = eng.end_run().totals()
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert t["anchors"] == 1 and t["reuses"] == 1
    assert all(rel_l2(o, dense) < 1e-5 for o in outs)


def test_the_grouping_products_are_einsums_batched_matmuls_bit_for_bit():
    """kernels/grouping_torch.py's _project and _back replace two einsums by the batched matmul einsum itself makes
    (for host time); the grouping must not change by a bit."""
    from comfyui_sparse_attention.kernels import grouping_torch as g
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 300, 64, generator=gen)
    vec, w = torch.randn(5, 64, generator=gen), torch.randn(5, 300, generator=gen)
    assert torch.equal(g._project(x, vec), torch.einsum("sld,sd->sl", x, vec))
    assert torch.equal(g._back(x, w), torch.einsum("sld,sl->sd", x, w))


def test_narrow_points_iterate_on_their_covariance(monkeypatch):
    """Points of at most COVARIANCE_DIMS coordinates find their leading direction by multiplying with the covariance:
    the vector of the two-product iteration up to rounding, and group_queries(dims=16) keeps its groups as tight."""
    from comfyui_sparse_attention.kernels import grouping_torch as g
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 700, 16, generator=gen) * torch.linspace(3, 0.5, 16)
    xc = x - x.mean(1, keepdim=True)
    xc[:, 600:] = 0.0  # zeroed padding slots, as _principal_order passes them
    cov = g._leading_direction(xc)
    monkeypatch.setattr(g, "COVARIANCE_DIMS", 0)
    products = g._leading_direction(xc)
    assert torch.allclose(cov, products, atol=1e-5)
    from test_token_and_selection import low_rank_queries, within_scatter
    q = low_rank_queries(5000, 128, 24, seed=9)
    two = g.group_queries(q, 64, dims=16)
    monkeypatch.undo()
    assert within_scatter(q, g.group_queries(q, 64, dims=16)) <= 1.02 * within_scatter(q, two)


def test_pass_two_ranks_keys_by_a_subset_of_each_group(monkeypatch):
    """mass_queries: pass 2 gets every (group_size / mass_queries)-th query of each group (0: all of them); the
    selection still covers every query of the group."""
    from comfyui_sparse_attention import kernels
    from comfyui_sparse_attention.engine.policy_mc_sparse import build_mc_sparse
    pr = SyntheticVideoAttention(frames=4, height=16, width=16, text=0, heads=2, head_dim=64, steps=1, seed=2)
    q, k, v = pr.qkv(0)
    _, lse = kernels.attention_dense(q, k, v, return_lse=True, backend="torch")
    seen, real = [], kernels.group_kv_mass
    monkeypatch.setattr(kernels, "group_kv_mass", lambda q, k, lse, groups, **kw: seen.append(groups) or real(
        q, k, lse, groups, **kw))
    for mq, width in ((16, 16), (32, 32), (0, 64)):
        seen.clear()
        cfg = SparseConfig(method="mc_sparse", density=0.2, group_size=64, mass_queries=mq)
        sel = build_mc_sparse(q, k, lse, pr.layout, cfg, backend="torch")
        assert seen[0].shape[-1] == width
        assert torch.equal(seen[0], sel.q_groups[..., ::64 // width])
        assert sel.q_groups.shape[-1] == 64
    with pytest.raises(ValueError, match="mass_queries"):
        SparseConfig(method="mc_sparse", mass_queries=8)
    with pytest.raises(ValueError, match="mass_queries"):
        SparseConfig(method="mc_sparse", group_size=64, mass_queries=64)
    with pytest.raises(ValueError, match="mass_queries"):
        SparseConfig(method="mc_sparse", mass_queries=16.0)


def test_grouping_dims_reach_the_grouping(monkeypatch):
    """grouping_dims: the policy groups each span's queries on that many leading directions; checked values."""
    from comfyui_sparse_attention import kernels
    from comfyui_sparse_attention.engine.policy_mc_sparse import build_mc_sparse
    pr = SyntheticVideoAttention(frames=4, height=16, width=16, text=0, heads=2, head_dim=64, steps=1, seed=2)
    q, k, v = pr.qkv(0)
    _, lse = kernels.attention_dense(q, k, v, return_lse=True, backend="torch")
    seen, real = [], kernels.group_queries
    monkeypatch.setattr(kernels, "group_queries", lambda q, c, **kw: seen.append(kw["dims"]) or real(q, c, **kw))
    for dims in (0, 16, 32):
        cfg = SparseConfig(method="mc_sparse", density=0.2, group_size=64, grouping_dims=dims)
        sel = build_mc_sparse(q, k, lse, pr.layout, cfg, backend="torch")
        assert seen[-1] == dims and sel.q_groups.shape[-1] == 64
        flat = sel.q_groups[0, 0].reshape(-1)
        assert torch.equal(torch.sort(flat[flat >= 0]).values, torch.arange(q.shape[2], dtype=torch.int32))
    assert SparseConfig().grouping_dims == 16
    for bad in (8, 32.0, True, "32"):
        with pytest.raises(ValueError, match="grouping_dims"):
            SparseConfig(method="mc_sparse", grouping_dims=bad)


def test_each_sample_is_grouped_alone(monkeypatch):
    """A batch of samples (cond and uncond) is grouped one sample at a time, the same calls a separate call makes, so
    its groups never depend on the samples beside it (on the GPU batched operators round with the whole shape:
    docs/kernel_notes.md, "v22")."""
    from comfyui_sparse_attention import kernels
    from comfyui_sparse_attention.kernels import grouping_torch
    q = torch.randn(3, 2, 500, 64, generator=torch.Generator().manual_seed(5))
    shapes = []
    real = grouping_torch.project_leading

    def spy(x, dims):
        shapes.append(tuple(x.shape))
        return real(x, dims)

    monkeypatch.setattr(grouping_torch, "project_leading", spy)
    both = kernels.group_queries(q, 64, dims=16, backend="torch")
    assert shapes == [(1, 2, 500, 64)] * 3
    apart = torch.cat([kernels.group_queries(q[i:i + 1], 64, dims=16, backend="torch") for i in range(3)])
    assert torch.equal(both, apart) and both.shape == (3, 2, 8, 64)
