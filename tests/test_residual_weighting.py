"""The residual weighted by the mass (SparseConfig.residual_weighting, kernels/_residual.py): block selections'
reuse steps re-weight the cached residual by the share of the softmax mass the left-out blocks have now."""

import sys

import pytest
import torch

from comfyui_sparse_attention import kernels as K
from comfyui_sparse_attention.engine import CallContext, SparseConfig, SparseEngine
from comfyui_sparse_attention.engine.residual import Residual
from comfyui_sparse_attention.engine.synthetic import SyntheticVideoAttention, rel_l2
from comfyui_sparse_attention.kernels._residual import LOG_MASS_EPS, mass_of, mass_weight
from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import reuse_combine as rc  # noqa: E402  (the exact study the weighting comes from)

BASE = dict(density=0.15, warmup_steps=1, anchor_steps="", min_tokens=0, backend="torch", block_q=64, block_k=64,
            group_size=64, residual_precision="model")


@pytest.fixture(scope="module")
def problem():
    return SyntheticVideoAttention(frames=4, height=16, width=16, text=0, heads=2, head_dim=64, steps=8, seed=5)


def _exact(q, k, v, entry, n):
    """(dense, sparse, sparse LSE) of the cached block selection, from masked fp32 attention (bench/reuse_combine)."""
    od, _, os_, ls = rc.attend(q, k, v, rc.selection_mask(entry.selection, n))
    return od, os_, ls


def test_config_accepts_the_three_weightings_only():
    assert SparseConfig().residual_weighting == "auto"
    assert SparseConfig(residual_weighting="fixed").residual_weighting == "fixed"
    assert SparseConfig(residual_weighting="mass").residual_weighting == "mass"
    with pytest.raises(ValueError, match="residual_weighting"):
        SparseConfig(residual_weighting="sometimes")


def test_mass_helpers_are_exact_where_nothing_moved_and_guard_full_rows():
    ld = torch.tensor([2.0, 1.0, 0.5, 0.0])
    # some kept, nothing kept, everything kept, all but 3e-4 of the mass kept (just above MASS_EPS)
    ls = torch.tensor([1.0, float("-inf"), 0.5, float(torch.log(torch.tensor(1 - 3e-4)))])
    mass = mass_of(ld, ls)
    w = mass_weight(ls, mass)
    assert torch.allclose(w, torch.ones(4))                          # the anchor's own mass: weight 1
    assert mass[1, 1] == 0 and mass[1, 0] == ld[1]                    # nothing kept: beta 1, Z_C = Z
    assert mass[2, 1] <= LOG_MASS_EPS < mass[3, 1]                    # everything kept: not re-weighted
    grown = mass_weight(ls + 1.0, mass)                               # the kept keys weigh e times more
    for i in (0, 3):
        beta = 1 - torch.exp(ls[i] - ld[i])
        want = torch.exp(mass[i, 0]) / (torch.exp(ls[i] + 1.0) + torch.exp(mass[i, 0])) / beta
        assert torch.isclose(grown[i], want, rtol=1e-3) and grown[i] < 1
    assert grown[1] == 1 and grown[2] == 1


@pytest.mark.parametrize("precision", ["model", "fp8"])
def test_block_topk_reuse_is_the_mass_weighted_combination(problem, precision):
    """A block_topk reuse step returns O_S(t) + w R with w from this call's sparse LSE and the anchor's mass —
    what bench/reuse_combine.py measures as "lse" — and "fixed" returns O_S(t) + R."""
    q0, k0, v0 = problem.qkv(1)
    q1, k1, v1 = problem.qkv(5)
    n = q0.shape[2]
    outs = {}
    for weighting in ("mass", "fixed"):
        eng = SparseEngine(SparseConfig(method="block_topk", residual_weighting=weighting,
                                        **{**BASE, "residual_precision": precision}))
        eng.begin_run()
        ctx = dict(layer=0, layout=problem.layout)
        eng.attend(q0, k0, v0, CallContext(step=0, **ctx))                 # warm-up (dense)
        eng.attend(q0, k0, v0, CallContext(step=1, **ctx))                 # anchor
        entry = next(iter(eng.cache.on_device.values()))
        assert (entry.residual.mass is not None) == (weighting == "mass")
        outs[weighting] = eng.attend(q1, k1, v1, CallContext(step=2, **ctx)).float()
        eng.end_run()
    od0, os0, ls0 = _exact(q0, k0, v0, entry, n)
    od1, os1, ls1 = _exact(q1, k1, v1, entry, n)
    cache = rc.complement(od0, rc.attend(q0, k0, v0)[1], os0, ls0)
    err_mass = rel_l2(outs["mass"], rc.combine("lse", cache, os1, ls1))
    err_fixed = rel_l2(outs["fixed"], rc.combine("add", cache, os1, ls1))
    assert max(err_mass, err_fixed) < (1e-4 if precision == "model" else 1e-2), (err_mass, err_fixed)
    # what the weighting changes, against what it should change (fp8 rounding of R cancels in the difference)
    moved = outs["mass"] - outs["fixed"]
    want = rc.combine("lse", cache, os1, ls1) - rc.combine("add", cache, os1, ls1)
    assert float(want.norm()) > 5 * float((outs["fixed"] - rc.combine("add", cache, os1, ls1)).norm()) or \
        precision == "fp8"
    assert rel_l2(moved, want) < (1e-3 if precision == "model" else 0.1)


def test_mass_weighting_is_exact_at_the_anchor_inputs(problem):
    q, k, v = problem.qkv(2)
    eng = SparseEngine(SparseConfig(method="block_topk", residual_weighting="mass", **BASE))
    eng.begin_run()
    dense = eng.attend(q, k, v, CallContext(layer=0, step=1, layout=problem.layout))
    assert next(iter(eng.cache.on_device.values())).residual.mass is not None
    again = eng.attend(q, k, v, CallContext(layer=0, step=2, layout=problem.layout))
    eng.end_run()
    assert rel_l2(again.float(), dense.float()) < 1e-4


def test_token_selections_and_reselection_keep_the_fixed_residual(problem):
    """mc_sparse stores no mass; block_topk with select_every_step runs its new selection with the residual as
    cached (the mass belongs to the anchor's selection)."""
    q0, k0, v0 = problem.qkv(1)
    q1, k1, v1 = problem.qkv(4)
    eng = SparseEngine(SparseConfig(method="mc_sparse", residual_weighting="mass", **BASE))
    eng.begin_run()
    eng.attend(q0, k0, v0, CallContext(layer=0, step=1, layout=problem.layout))
    assert next(iter(eng.cache.on_device.values())).residual.mass is None
    eng.end_run()
    outs = {}
    for weighting in ("mass", "fixed"):
        eng = SparseEngine(SparseConfig(method="block_topk", select_every_step=True, residual_weighting=weighting,
                                        **BASE))
        eng.begin_run()
        eng.attend(q0, k0, v0, CallContext(layer=0, step=1, layout=problem.layout))
        outs[weighting] = eng.attend(q1, k1, v1, CallContext(layer=0, step=2, layout=problem.layout))
        eng.end_run()
    assert torch.equal(outs["mass"], outs["fixed"])


def test_bad_mass_is_a_clear_error(problem):
    q, k, v = problem.qkv(1)
    nb = -(-q.shape[2] // 64)
    idx = torch.arange(nb, dtype=torch.int32).view(1, 1, 1, nb).expand(1, 2, nb, nb).contiguous()
    cnt = torch.full((1, 2, nb), nb, dtype=torch.int32)
    with pytest.raises(ValueError, match="residual mass"):
        K.block_sparse_attention(q, k, v, idx, cnt, block_q=64, block_k=64, backend="torch",
                                 residual=(torch.zeros_like(q), None, torch.zeros(2, 2)))


def test_residual_moves_its_mass_with_it():
    r = Residual(torch.zeros(2, 1, 4, 8), None, torch.ones(2, 1, 4, 2))
    assert len(r.tensors()) == 2 and r.nbytes == 2 * 4 * 8 * 4 + 2 * 4 * 2 * 4
    assert r.map(lambda t: t * 2).mass.eq(2).all() and r.batch_slice(1, 2).mass.shape == (1, 1, 4, 2)


def test_anchors_at_the_first_step_keep_the_fixed_residual(problem):
    """The weighting skips residuals anchored at step 0 (pure noise; measured worse there): no mass is stored, and
    a later anchor of the same run stores one."""
    q, k, v = problem.qkv(1)
    eng = SparseEngine(SparseConfig(method="block_topk", residual_weighting="mass",
                                    **{**BASE, "warmup_steps": 0, "anchor_steps": "0,2"}))
    eng.begin_run()
    masses = []
    for step in range(3):
        eng.attend(q, k, v, CallContext(layer=0, step=step, layout=problem.layout))
        masses.append(next(iter(eng.cache.on_device.values())).residual.mass is not None)
    eng.end_run()
    assert masses == [False, False, True]


def test_auto_weighs_where_block_sparse_runs_on_triton(problem, monkeypatch):
    """"auto" (the default) stores a mass only where the block-sparse kernels run on Triton (the twin's LSE costs a
    second score pass); the query is the kernels' own dispatch test, nothing logged."""
    q, k, v = problem.qkv(1)
    assert not K.block_sparse_on_triton(q, "auto") and not K.block_sparse_on_triton(q, "torch")
    stored = {}
    for on_triton in (False, True):
        monkeypatch.setattr(K, "block_sparse_on_triton", lambda q_, backend="auto", _v=on_triton: _v)
        eng = SparseEngine(SparseConfig(method="block_topk", **BASE))
        eng.begin_run()
        eng.attend(q, k, v, CallContext(layer=0, step=1, layout=problem.layout))
        stored[on_triton] = next(iter(eng.cache.on_device.values())).residual.mass is not None
        eng.end_run()
    assert stored == {False: False, True: True}


def test_token_kernels_refuse_a_mass_on_every_backend(problem):
    q, k, v = problem.qkv(1)
    groups = K.group_queries(q, 64)
    g, n = groups.shape[2], q.shape[2]
    toks = torch.arange(n, dtype=torch.int32).view(1, 1, 1, n).expand(1, 2, g, n).contiguous()
    cnt = torch.full((1, 2, g), n, dtype=torch.int32)
    low, ends = K.compact_keep(torch.ones(1, 2, g, n, dtype=torch.bool))[:2]
    res = (torch.zeros_like(q), None, torch.zeros((*q.shape[:3], 2)))
    for backend in ("torch", "auto", "triton"):
        with pytest.raises(ValueError, match="block-sparse attention only"):
            K.token_sparse_attention(q, k, v, groups, toks, cnt, residual=res, backend=backend)
        with pytest.raises(ValueError, match="block-sparse attention only"):
            K.token_sparse_attention_compact(q, k, v, groups, low, ends, cnt, residual=res, backend=backend)
