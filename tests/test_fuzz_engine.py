"""Fuzzed engine call sequences (docs/reliability.md): random configurations (every method, block and group sizes,
schedules as steps, shares and periods, warm-ups, dense layers, residual precisions, tiny cache budgets that
force CPU offload, packing to 4 bits and fallbacks) driven through runs with skipped, repeated and restarted steps,
several layers and batch chunks, changing token counts, batch sizes and head counts, text/grid layouts that fit or
do not, and exceptions raised inside anchors. Every call must return a finite output of the right shape (dense and
anchor calls equal to dense attention), and every run must leave no cached tensor alive. CPU, PyTorch backend."""

import gc
import random
import weakref

import pytest
import torch

from comfyui_sparse_attention.engine import CallContext, SparseConfig, SparseEngine, TokenLayout
from comfyui_sparse_attention.engine import policy as policy_mod
from comfyui_sparse_attention.engine.residual import Residual

SDPA = torch.nn.functional.scaled_dot_product_attention
RUNS = 120


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Injected(Exception):
    """Raised inside an anchor by the test (stands for an interruption or a failing kernel)."""


def random_config(r: random.Random, short_of_room: bool = False) -> SparseConfig:
    method = r.choice(("mc_sparse",) * 6 + ("block_topk",) * 4 + ("hybrid", "hybrid", "static", "static", "dense"))
    anchors = r.choice(("", "2", "every 2", "every 3", "1,4", "50%", "every 25%", "0 + every 2", "30%,70%"))
    warmup = r.choice((0, 0, 0, 1, "20%"))
    kw = dict(method=method, density=r.choice((0.05, 0.15, 0.3, 0.6, 1.0)), anchor_steps=anchors,
              warmup_steps=warmup, warmup_layers=r.choice((0, 0, 1)), dense_layers=r.choice(("", "", "1", "0,2")),
              block_q=r.choice((64, 128)), block_k=r.choice((64, 128)), group_size=r.choice((64, 128)),
              grouping=r.choice(("pca", "cuboid")), residual=r.random() < 0.8,
              residual_precision=r.choice(("fp8", "model", "auto", "int4")), select_every_step=r.random() < 0.2,
              mass=r.choice((None, None, 0.9)), sink_blocks=r.choice((0, 1, 2)),
              temporal_weight=r.choice((0.5, 1.0, 3.0)), min_tokens=r.choice((0, 0, 0, 100)), backend="torch",
              offload=r.random() < 0.8)
    budget = r.random()
    if budget < 0.2:  # nothing fits: fallbacks
        kw.update(cache_budget_mb=0.0, cpu_budget_mb=0.0)
    elif budget < 0.45:  # the device budget is tiny: entries go to the CPU side (offload) or drop the residual
        kw.update(cache_budget_mb=0.05, cpu_budget_mb=r.choice((0.2, 64.0)))
    if short_of_room:  # room for a few residuals only: "auto" packs some to 4 bits, and drops others
        kw.update(method=r.choice(("mc_sparse", "block_topk", "hybrid")), residual=True, residual_precision="auto",
                  min_tokens=0, cache_budget_mb=r.choice((0.01, 0.02, 0.04, 0.08)),
                  cpu_budget_mb=r.choice((0.0, 0.01, 0.03)))
    return SparseConfig(**kw)


def random_layout(r: random.Random, n: int) -> TokenLayout:
    u = r.random()
    if u < 0.25:
        return TokenLayout()
    text = r.choice((0, 0, 7, 33)) if n > 40 else 0
    extra = r.choice((0, 0, 5)) if n - text > 10 else 0
    rest = n - text - extra
    grids = [(f, h, rest // (f * h)) for f in (1, 2, 3) for h in (4, 8) if rest % (f * h) == 0 and rest // (f * h)]
    grid = r.choice(grids) if grids and u < 0.85 else (1, 3, 5)  # sometimes a grid that does not fit
    return TokenLayout(text_len=text, text_first=r.random() < 0.8, grid=grid, extra_len=extra)


def step_sequence(r: random.Random, total: int) -> list[int]:
    """Run steps with skips (a step cache), repeats (multi-evaluation samplers) and a restart."""
    steps = [s for s in range(total) if r.random() > 0.25]
    out = []
    for s in steps:
        out.append(s)
        if r.random() < 0.15:
            out.append(s)
    if r.random() < 0.2 and out:
        out += out[: r.randint(1, len(out))]  # the steps go back: a restart without begin_run
    return out or [0]


def tensors_of(cache):
    for entry in list(cache.on_device.values()) + list(cache.on_cpu.values()):
        yield from entry.selection.tensors()
        if entry.residual is not None:
            yield from entry.residual.tensors()


def run_one(seed: int, monkeypatch, short_of_room: bool = False) -> dict:
    r = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    cfg = random_config(r, short_of_room)
    eng = SparseEngine(cfg)
    total = r.randint(3, 9)
    sizes = r.sample((90, 150, 200, 257, 320), r.randint(1, 2))
    layers = r.randint(1, 3)
    chunks = r.choice(([()], [(0,)], [(1, 0)], [(1, 0), (0,), (1,)], [(0,), (1,)]))
    layouts = {n: random_layout(r, n) for n in sizes}
    heads, dim = r.choice((1, 2, 3)), r.choice((16, 32))
    base = {}
    refs, counts = [], dict(calls=0, raised=0)
    fail_at = r.randrange(1, 8) if r.random() < 0.3 else None

    policy = policy_mod.policy_for(cfg.method)
    if policy is not None and fail_at is not None:
        real = type(policy).select

        def flaky(self, *a, **k):
            counts["selects"] = counts.get("selects", 0) + 1
            if counts["selects"] == fail_at:
                raise Injected(f"seed {seed}")
            return real(self, *a, **k)
        monkeypatch.setattr(type(policy), "select", flaky)
    eng.begin_run()
    for step in step_sequence(r, total):
        for layer in range(layers):
            for chunk in chunks:
                n = r.choice(sizes)
                b, h = max(1, len(chunk)), heads
                if r.random() < 0.08:  # now and then another batch size or head count under the same key
                    b, h = (2 * b, h) if r.random() < 0.5 else (b, h + 1)
                key = (layer, chunk, n, b, h)
                if key not in base:
                    base[key] = [torch.randn(b, h, n, dim, generator=g) * r.choice((0.5, 1.0, 4.0)) for _ in range(3)]
                q, k, v = (t + 0.05 * step * torch.randn(t.shape, generator=g) for t in base[key])
                ctx = CallContext(layer=layer, step=step, chunk=chunk, total_steps=total, layout=layouts[n])
                before = eng.stats.totals()
                try:
                    out = eng.attend(q, k, v, ctx)
                except Injected:
                    counts["raised"] += 1
                    continue
                counts["calls"] += 1
                after = eng.stats.totals()
                assert out.shape == q.shape and out.dtype == q.dtype, f"seed {seed}: {out.shape}"
                assert torch.isfinite(out).all(), f"seed {seed}: non-finite output at step {step} layer {layer}"
                if after["reuses"] == before["reuses"]:  # dense, fallback or anchor: the exact output
                    err = float((out - SDPA(q, k, v)).abs().max())
                    assert err < 1e-4 * max(1.0, float(v.abs().max())), f"seed {seed}: {err}"
                refs += [weakref.ref(t) for t in tensors_of(eng.cache)]
    counts.update(packed=eng.cache.counters["residual_packed"], dropped=eng.cache.counters["residual_dropped"])
    stats = eng.end_run()
    gc.collect()
    assert eng.cache.device_bytes == 0 and eng.cache.cpu_bytes == 0, f"seed {seed}"
    alive = sum(ref() is not None for ref in refs)
    assert alive == 0, f"seed {seed}: {alive} cached tensors outlived the run"
    assert stats.totals()["calls"] == counts["calls"], f"seed {seed}"
    return counts


def test_fuzzed_engine_runs(monkeypatch):
    calls = raised = 0
    for seed in range(RUNS):
        with monkeypatch.context() as m:
            counts = run_one(7_000_000 + seed, m)
        calls += counts["calls"]
        raised += counts["raised"]
    assert calls > 1000 and raised > 0  # the runs made real calls, and some anchors raised


def test_fuzzed_runs_short_of_cache_room(monkeypatch):
    """The same runs with residual_precision "auto" and room for a few residuals only: residuals are packed to 4 bits,
    stored ones packed after them, others dropped, packed ones reused, under every other drawn setting; the outputs
    stay finite and exact where they must be and nothing cached outlives a run."""
    real, unpacked = Residual.unpacked, []

    def counted(self):
        unpacked.append(self.packed)
        return real(self)
    monkeypatch.setattr(Residual, "unpacked", counted)
    packed = dropped = 0
    for seed in range(RUNS // 2):
        with monkeypatch.context() as m:
            counts = run_one(8_000_000 + seed, m, short_of_room=True)
        packed += counts["packed"]
        dropped += counts["dropped"]
    assert packed > 0 and dropped > 0  # the runs packed residuals, and some still found no room
    assert any(unpacked)  # and reused packed ones


def test_a_run_after_an_exception_inside_an_anchor_is_clean(monkeypatch):
    """An exception inside an anchor (ComfyUI's interruption reaches the sampler this way) leaves nothing behind:
    the next run gives exactly what a fresh engine gives."""
    cfg = SparseConfig(method="mc_sparse", density=0.2, min_tokens=0, backend="torch", anchor_steps="every 2",
                       group_size=64)
    lay = TokenLayout(grid=(2, 8, 16))
    g = torch.Generator().manual_seed(0)
    data = [[torch.randn(1, 2, 256, 32, generator=g) for _ in range(3)] for _ in range(4)]

    def run(eng):
        eng.begin_run()
        outs = [eng.attend(*data[s], CallContext(layer=layer, step=s, layout=lay))
                for s in range(4) for layer in (0, 1)]
        eng.end_run()
        return outs
    eng = SparseEngine(cfg)
    real = type(policy_mod.policy_for("mc_sparse")).select
    calls = []

    def interrupted(self, *a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise Injected("interrupted")
        return real(self, *a, **k)
    with monkeypatch.context() as m:
        m.setattr(type(policy_mod.policy_for("mc_sparse")), "select", interrupted)
        with pytest.raises(Injected):
            run(eng)
    assert eng.cache.device_bytes + eng.cache.cpu_bytes > 0  # the interrupted run left entries ...
    again = run(eng)  # ... which the next run's begin_run drops
    fresh = run(SparseEngine(cfg))
    assert all(torch.equal(a, b) for a, b in zip(again, fresh))
    assert eng.cache.device_bytes + eng.cache.cpu_bytes == 0
