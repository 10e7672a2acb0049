"""bench/reuse_combine.py: the exact study of how a reuse step combines its sparse output with the anchor's cache."""

import sys

import pytest
import torch
from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import reuse_combine as rc  # noqa: E402

FAKE_TESTBED = ROOT / "tests" / "quality_testbed_fake"


def _case(seed=0, n=96, d=16):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, n, d, generator=g) for _ in range(3))
    keep = torch.rand(1, 2, n, n, generator=g) < 0.3
    keep[0, 0, 5] = False  # a row that keeps nothing
    keep[0, 1, 7] = True   # a row that keeps everything
    return q, k, v, (lambda bi, hi, r0, r1: keep[bi, hi, r0:r1])


def test_attend_matches_masked_softmax():
    q, k, v, rows = _case()
    od, ld, os_, ls = rc.attend(q, k, v, rows)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    assert torch.allclose(od, torch.softmax(s, -1) @ v, atol=1e-5)
    assert torch.allclose(ld, torch.logsumexp(s, -1), atol=1e-5)
    keep = torch.stack([torch.stack([rows(0, h, 0, s.shape[-1]) for h in range(2)])])
    sm = s.masked_fill(~keep, float("-inf"))
    ok = keep.any(-1)
    want = torch.where(ok.unsqueeze(-1), torch.softmax(torch.where(ok.unsqueeze(-1), sm, 0.0), -1) @ v, 0.0)
    assert torch.allclose(os_, want, atol=1e-5)
    assert torch.equal(torch.isneginf(ls), ~ok) and torch.allclose(ls[ok], torch.logsumexp(sm, -1)[ok], atol=1e-5)


@pytest.mark.parametrize("mode", rc.MODES)
def test_every_mode_is_exact_when_nothing_moved(mode):
    """At the anchor's own inputs every rule returns the dense output (rows keeping nothing or everything too)."""
    q, k, v, rows = _case(1)
    od, ld, os_, ls = rc.attend(q, k, v, rows)
    out = rc.combine(mode, rc.complement(od, ld, os_, ls), os_, ls)
    assert torch.allclose(out, od, atol=1e-4)


def test_lse_rule_follows_the_sparse_mass():
    """When the sparse part's mass grows while the complement stays as it was, ``lse`` and ``merge`` give the true
    output and ``add`` does not."""
    q, k, v, rows = _case(2)
    od, ld, os_, ls = rc.attend(q, k, v, rows)
    cache = rc.complement(od, ld, os_, ls)
    ls2 = ls + 0.7  # Z_S grows by e^0.7, O_S unchanged, complement unchanged
    beta = torch.exp(cache["lc"] - torch.logaddexp(ls2, cache["lc"]))
    truth = (1 - beta).unsqueeze(-1) * os_ + beta.unsqueeze(-1) * cache["oc"]
    assert torch.allclose(rc.combine("lse", cache, os_, ls2), truth, atol=1e-4)
    assert torch.allclose(rc.combine("merge", cache, os_, ls2), truth, atol=1e-4)
    assert not torch.allclose(rc.combine("add", cache, os_, ls2), truth, atol=1e-3)


def test_schedules_parse_and_reject():
    assert rc.parse_schedule("w2 a2,10") == (2, [2, 10]) and rc.parse_schedule("a0") == (0, [0])
    for bad in ("w2", "x3", "w3 a1"):
        with pytest.raises(ValueError):
            rc.parse_schedule(bad)


def test_runs_end_to_end_on_a_stand_in_testbed(tmp_path):
    doc = rc.run(rc.argparse.Namespace(
        testbed=str(FAKE_TESTBED), out=str(tmp_path), methods="block_topk,mc_sparse", densities="0.15",
        schedules="w1 a1", modes="add,merge", size=64, steps=4, shift=3.0, seeds="0,1", batch=2, budget_s=1e9,
        device="cpu", random_init_small=True, video="", tf32=False))
    rows = doc["rows"]
    assert [(r["method"], r["mode"]) for r in rows] == [("block_topk", "add"), ("block_topk", "merge"),
                                                         ("mc_sparse", "add"), ("mc_sparse", "merge")]
    assert all(r["psnr_mean"] > 30 and set(r["reuse_rel_l2"]) == set(rc.MODES) for r in rows)
    assert (tmp_path / "reuse_combine.md").read_text().count("| block_topk |") == 2
