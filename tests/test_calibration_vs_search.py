"""bench/calibration_vs_search.py: the rank correlation between the calibration objective's predicted gains and an
output search's measured ones (docs/calibration.md, "A search on the output")."""

import subprocess
import sys

import pytest
from conftest import ROOT

BENCH = ROOT / "bench"


@pytest.fixture
def cvs(bench_import):
    return bench_import("calibration_vs_search")


def test_spearman_and_ranks(cvs):
    assert cvs.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert cvs.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert cvs.ranks([5.0, 1.0, 5.0, 3.0]) == [2.5, 0.0, 2.5, 1.0]  # ties share their mean rank
    assert cvs.spearman([1, 1, 1], [1, 2, 3]) == 0.0
    f = cvs.moved([1.0] * 4, 2, 0.5)
    assert f[2] == 1.5 and sum(f) == pytest.approx(4.0)


def _synthetic(cvs, measured_from):
    """Two layers x two heads with made-up curves; the search's measured PSNR changes are the predicted gains of
    ``measured_from`` (objective, weighted, squared) times 100."""
    dens = [0.05, 0.1, 0.2]
    curves = []
    for i, (layer, head) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        e = [0.3 / (1 + i), 0.2 / (1 + i * i), 0.1 / (1 + i)]
        curves.append(dict(method="mc_sparse", layer=layer, head=head, densities=dens, reuse=e,
                           fresh=[x * 2 for x in e[::-1]], reuse_plain=[0.5, 0.5, 0.5], weight=0.5))
    base = [1.0] * 4
    moves = []
    for i, (layer, head) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        for s, tag in ((1, "+"), (-1, "-")):
            before = cvs.cost(curves, base, 0.1, *measured_from)
            gain = before - cvs.cost(curves, cvs.moved(base, i, s * 0.5), 0.1, *measured_from)
            moves.append(dict(round=1, move=f"{layer}.{head}{tag}", psnr_mean=30.0 + 100 * gain))
    moves.append(dict(round=2, move="0.0+", psnr_mean=99.0))  # later rounds start elsewhere: ignored
    search = dict(meta=dict(method="mc_sparse", density=0.1, step=0.5, start=None), moves=moves,
                  result=dict(uniform=dict(fit=dict(psnr_mean=30.0))))
    return dict(curves=curves), search


def test_the_objective_that_made_the_measurements_ranks_them_perfectly(cvs):
    cal, search = _synthetic(cvs, ("fresh", False, True))
    rows = cvs.compare(cal, search)
    assert len(rows) == 12 and sum(r["used_by_calibration"] for r in rows) == 1
    row = next(r for r in rows if (r["objective"], r["weighted"], r["squared"]) == ("fresh", False, True))
    assert row["spearman"] == pytest.approx(1.0) and row["moves"] == 8
    flat = next(r for r in rows if r["objective"] == "reuse_plain" and not r["weighted"])
    assert flat["spearman"] < 1.0


def test_a_search_started_elsewhere_is_refused(cvs):
    cal, search = _synthetic(cvs, ("reuse", True, True))
    search["meta"]["start"] = "{0: 2}"
    with pytest.raises(SystemExit, match="started from given factors"):
        cvs.compare(cal, search)


def test_on_the_runs_in_the_repository(tmp_path):
    out = tmp_path / "t.md"
    proc = subprocess.run([sys.executable, str(BENCH / "calibration_vs_search.py"),
                           str(ROOT / "docs/bench-runs/calibration-2/calibration.json"),
                           str(ROOT / "docs/bench-runs/search-1/mc_sparse/search.json"), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    assert "32 single-head moves" in text and text.count("\n| ") == 13  # header + 12 variants
    assert "the calibration's objective" in text


class _Cfg:
    num_heads, head_dim, num_classes, dim = 2, 4, 3, 8


class _Block:
    def __init__(self, w_o, modulation):
        import torch
        self.o = torch.nn.Linear(8, 8, bias=False)
        with torch.no_grad():
            self.o.weight.copy_(w_o)
        self.modulation = modulation


class _TinyDiT:
    """What output_map_weights reads of the testbed's DiT: blocks (o, modulation), embed_conditions, cfg."""
    cfg = _Cfg()

    def __init__(self, blocks):
        self.blocks = blocks

    def embed_conditions(self, t, y):
        import torch
        e = torch.zeros(len(y), 6, 8)
        e[:, 2] = t.view(-1, 1)  # the gate grows with t (noise level)
        return None, e


def test_output_map_weights_follow_the_gated_projection(cvs):
    import torch
    w_o = torch.zeros(8, 8)
    w_o[:, :4] = 1.0   # head 0's columns
    w_o[:, 4:] = 2.0   # head 1's: twice as large, four times the squared norm
    gate_free = torch.zeros(1, 6, 8)
    gate_one = torch.zeros(1, 6, 8)
    gate_one[0, 2] = 1.0  # a constant extra gate
    w = cvs.output_map_weights(_TinyDiT([_Block(w_o, gate_free), _Block(w_o, gate_one)]), steps=4)
    assert set(w) == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert w[(0, 1)] == pytest.approx(4 * w[(0, 0)]) and w[(1, 1)] == pytest.approx(4 * w[(1, 0)])
    assert w[(1, 0)] > w[(0, 0)] > 0  # a larger gate, a larger weight
    t = torch.linspace(1, 0, 5)[:-1]
    t = 3 * t / (1 + 2 * t)
    assert w[(0, 0)] == pytest.approx(float((t ** 2).mean()) * 8 * 4)  # gate t on 8 rows x 4 columns of ones


def test_a_head_scale_adds_twelve_variants(cvs):
    cal, search = _synthetic(cvs, ("reuse", True, True))
    flat = cvs.compare(cal, search, {(0, 0): 1.0, (0, 1): 1.0, (1, 0): 1.0, (1, 1): 1.0})
    assert len(flat) == 24 and sum(r["used_by_calibration"] for r in flat) == 1
    # a scale of one everywhere ranks like no scale; a scale that silences heads changes the ranking
    for a, b in zip(flat[:12], flat[12:]):
        assert a["spearman"] == b["spearman"] and b["scaled"] and not a["scaled"]
    skewed = cvs.compare(cal, search, {(0, 0): 1.0, (0, 1): 0.0, (1, 0): 0.0, (1, 1): 5.0})
    assert [r["spearman"] for r in skewed[12:]] != [r["spearman"] for r in skewed[:12]]
    assert "× gated output map" in cvs.table(skewed, "c", "s", "gated output map")


def test_layer_sensitivity_scale_and_its_errors(cvs):
    cal, search = _synthetic(cvs, ("reuse", True, True))
    cal["sensitivity"] = [dict(method="mc_sparse", target=0.1, layer_weights={"0": 0.5, "1": 4.0}),
                          dict(method="mc_sparse", target=0.15, layer_weights={"0": 9.0, "1": 9.0})]
    scale = cvs.layer_sensitivity_scale(cal, "mc_sparse", 0.1)
    assert scale == {(0, 0): 0.5, (0, 1): 0.5, (1, 0): 4.0, (1, 1): 4.0}
    assert len(cvs.compare(cal, search, scale)) == 24
    with pytest.raises(SystemExit, match="no layer sensitivities"):
        cvs.layer_sensitivity_scale(cal, "block_topk", 0.1)


def test_on_the_runs_in_the_repository_with_layer_sensitivities(tmp_path):
    out = tmp_path / "t.md"
    proc = subprocess.run([sys.executable, str(BENCH / "calibration_vs_search.py"),
                           str(ROOT / "docs/bench-runs/calibration-2/calibration.json"),
                           str(ROOT / "docs/bench-runs/search-1/block_topk/search.json"), "--sensitivity",
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    assert "× layer sensitivity" in text and text.count("\n| ") == 25  # header + 12 variants + 12 scaled


class _JacM:
    """The testbed module's attention hook as output_jacobian_weights uses it: CONTEXT, set_attention,
    sdpa_attention, and the module-level attention every layer calls."""

    def __init__(self):
        self.CONTEXT = {"layer": None}
        self.fn = None

    @staticmethod
    def sdpa_attention(q, k, v):
        import torch
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    def set_attention(self, fn):
        prev, self.fn = self.fn, fn
        return prev

    def attention(self, q, k, v):
        return (self.fn or self.sdpa_attention)(q, k, v)


class _JacCfg:
    num_layers, num_heads, head_dim, num_classes, patch = 2, 2, 2, 3, (1, 1, 1)


class _JacNet:
    """A 'DiT' whose velocity at token n is sum over layers l, heads h and dims of c[l, h] x attention output
    (l, h, n, :): head (l, h)'s gain to the output is c[l, h]^2 per element."""
    cfg = _JacCfg()

    def __init__(self, m, c):
        import torch
        self.m, self.c = m, c
        self.w = torch.nn.Parameter(torch.ones(1))

    def parameters(self):
        return iter([self.w])

    def __call__(self, x, t, y):
        b, _, f, hh, ww = x.shape
        tokens = x.reshape(b, 1, f * hh * ww, 1).expand(b, 2, f * hh * ww, 2) * self.w
        out = 0
        for li in range(2):
            self.m.CONTEXT["layer"] = li
            o = self.m.attention(tokens, tokens, tokens)  # (B, H, N, D)
            out = out + (o * self.c[li].view(1, 2, 1, 1)).sum((1, 3))
        return out.reshape(x.shape) * (1 + 0 * t.view(-1, 1, 1, 1, 1))


class _JacEv:
    def __init__(self, m):
        self.M = m

    @staticmethod
    def time_grid(steps, shift):
        import torch
        u = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
        return shift * u / (1 + (shift - 1) * u)

    @staticmethod
    def make_noise(cfg, seeds):
        import torch
        return torch.stack([torch.randn(1, 2, 3, 3, generator=torch.Generator().manual_seed(s)) for s in seeds])


def test_output_jacobian_weights_measure_each_heads_gain_to_the_output(cvs):
    import torch
    m = _JacM()
    c = torch.tensor([[1.0, 2.0], [0.5, 0.0]])
    net = _JacNet(m, c)
    w = cvs.output_jacobian_weights(_JacEv(m), net, seeds=(0, 1), steps=6, at=(1, 3), samples=3)
    assert set(w) == {(0, 0), (0, 1), (1, 0), (1, 1)}
    # every head sees the same random directions, so the ratios are exact: c[l, h]^2
    assert w[(0, 1)] == pytest.approx(4 * w[(0, 0)]) and w[(1, 0)] == pytest.approx(0.25 * w[(0, 0)])
    assert w[(1, 1)] == 0.0 and w[(0, 0)] > 0
    assert m.fn is None  # the attention hook is restored
    assert not net.w.requires_grad  # the model's parameters are left out of the backward passes


def test_the_documented_jacobian_ranking_is_reproduced_from_its_weights(tmp_path):
    """docs/calibration.md quotes rho = +0.12 for the calibration's objective scaled by the heads' measured gains
    (docs/bench-runs/jacobian-1/weights.json); --weights recomputes it offline."""
    out = tmp_path / "t.md"
    proc = subprocess.run([sys.executable, str(BENCH / "calibration_vs_search.py"),
                           str(ROOT / "docs/bench-runs/calibration-2/calibration.json"),
                           str(ROOT / "docs/bench-runs/search-1/mc_sparse/search.json"), "--weights",
                           str(ROOT / "docs/bench-runs/jacobian-1/weights.json"), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = [r for r in out.read_text().splitlines() if r.startswith("| reuse | yes | yes | yes |")]
    assert rows == ["| reuse | yes | yes | yes | +0.12 |"]
    assert out.read_text() == (ROOT / "docs/bench-runs/jacobian-1/table.md").read_text().replace(
        "../docs/bench-runs", str(ROOT / "docs/bench-runs"))
