"""engine/device_pool.py (CPU, the CUDA allocator's counts simulated): cudaMallocAsync's idle pool memory is handed
back to the driver before an out-of-memory error costs the cache, at an anchor (engine/engine.py ``_with_room``) and
in the model's forward (nodes/patch.py ``apply_model``); the native allocator, which trims and retries itself, and
other devices are left alone."""

import logging

import pytest
import torch
from test_engine import _oom_for, problem  # noqa: F401 - the fixture is used by name
from test_patch_runs import model_attention, qkv, sample_with

from comfyui_sparse_attention.engine import CallContext, SparseConfig, SparseEngine
from comfyui_sparse_attention.engine import device_pool
from comfyui_sparse_attention.nodes import patch as patch_mod
from comfyui_sparse_attention.nodes.patch import SparseAttentionPatch

GIB = 1 << 30
CUDA = torch.device("cuda", 0)


@pytest.fixture
def fake_cuda(monkeypatch):
    """A pretend CUDA device whose allocator backend, reserved and used bytes and the driver's free and total memory
    the test sets; counts empty_cache and garbage collections."""
    state = dict(backend="cudaMallocAsync", reserved=10 * GIB, allocated=7 * GIB, trims=0, collections=0,
                 free=40 * GIB, total=80 * GIB, capturing=False,
                 fraction=1.0)

    def empty_cache():
        state["trims"] += 1
        state["reserved"] = state["allocated"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: state["backend"])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: state["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state["allocated"])
    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (state["free"], state["total"]))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: state["fraction"])
    monkeypatch.setattr(device_pool.gc, "collect", lambda: state.__setitem__("collections", state["collections"] + 1))
    return state


def test_idle_pool_memory_is_handed_back_only_under_cudamallocasync(fake_cuda):
    assert device_pool.idle_pool_bytes(CUDA) == 3 * GIB
    assert device_pool.idle_pool_bytes(torch.device("cpu")) == 0  # another device: nothing to hand back
    assert device_pool.trim_pool(CUDA) == 3 * GIB
    assert fake_cuda["trims"] == 1 and fake_cuda["collections"] == 1 and device_pool.idle_pool_bytes(CUDA) == 0
    # below the threshold a trim is not worth a device synchronisation
    fake_cuda["reserved"] = fake_cuda["allocated"] + device_pool.TRIM_MIN_BYTES - 1
    assert device_pool.trim_pool(CUDA) == 0 and fake_cuda["trims"] == 1
    # the native allocator frees its cached blocks and retries by itself before it raises
    fake_cuda.update(backend="native", reserved=20 * GIB)
    assert device_pool.idle_pool_bytes(CUDA) == 0 and device_pool.trim_pool(CUDA) == 0 and fake_cuda["trims"] == 1


class Clock:
    """time.perf_counter for engine/device_pool.py, moved by the test."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_the_watch_hands_the_pool_back_only_when_the_driver_runs_low(fake_cuda, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(device_pool.time, "perf_counter", clock)
    watch = device_pool.PoolWatch(interval_s=0.05, min_gap_s=1.0)
    # plenty free on the driver: the pool's 3 GB idle stay (it serves the next calls without asking the driver)
    assert watch.check(CUDA) == 0 and fake_cuda["trims"] == 0
    # the driver runs low (below a tenth of the card): the idle memory goes back
    fake_cuda["free"] = 6 * GIB
    clock.now += 0.1
    assert watch.check(CUDA) == 3 * GIB and fake_cuda["trims"] == 1
    # the pool regrows at once, but the next trim waits min_gap_s (a trim synchronises the device) ...
    fake_cuda["reserved"] = fake_cuda["allocated"] + 2 * GIB
    clock.now += 0.5
    assert watch.check(CUDA) == 0 and fake_cuda["trims"] == 1
    clock.now += 0.6
    assert watch.check(CUDA) == 2 * GIB and fake_cuda["trims"] == 2
    # ... and the driver is asked at most every interval_s
    fake_cuda["reserved"] = fake_cuda["allocated"] + 4 * GIB
    clock.now += 1.01
    fake_cuda["free"] = 40 * GIB
    assert watch.check(CUDA) == 0
    fake_cuda["free"] = 1 * GIB
    clock.now += 0.01
    assert watch.check(CUDA) == 0  # inside interval_s of the last look
    clock.now += 0.05
    assert watch.check(CUDA) == 4 * GIB
    # not while a CUDA graph is being recorded (a trim synchronises the device)
    clock.now += 2
    fake_cuda.update(capturing=True, reserved=fake_cuda["allocated"] + 4 * GIB)
    assert watch.check(CUDA) == 0
    fake_cuda["capturing"] = False
    # too little idle to be worth a synchronisation; the native allocator; another device
    clock.now += 2
    fake_cuda["reserved"] = fake_cuda["allocated"] + device_pool.TRIM_MIN_BYTES - 1
    assert watch.check(CUDA) == 0
    clock.now += 2
    fake_cuda.update(backend="native", reserved=30 * GIB)
    assert watch.check(CUDA) == 0 and watch.check(torch.device("cpu")) == 0 and fake_cuda["trims"] == 3
    # a new run (reset) may trim at once, though the last run's trim was under min_gap_s ago
    fake_cuda.update(backend="cudaMallocAsync", reserved=fake_cuda["allocated"] + 2 * GIB)
    assert watch.check(CUDA) == 2 * GIB and fake_cuda["trims"] == 4
    fake_cuda["reserved"] = fake_cuda["allocated"] + 2 * GIB
    assert watch.check(CUDA) == 0
    watch.reset()
    assert watch.check(CUDA) == 2 * GIB and fake_cuda["trims"] == 5


def test_under_a_per_process_cap_the_watch_counts_the_room_the_cap_leaves(fake_cuda, monkeypatch):
    """A simulated 16 GB card on an 80 GB one (bench/e2e.py --vram-gb): the driver has plenty free, but the pool may
    not grow past the cap, so what counts is the cap less the pool's reservation."""
    clock = Clock()
    monkeypatch.setattr(device_pool.time, "perf_counter", clock)
    fake_cuda.update(fraction=0.2, free=60 * GIB, allocated=10 * GIB, reserved=15 * GIB)
    assert device_pool.room(CUDA) == (1 * GIB, 16 * GIB)
    watch = device_pool.PoolWatch()
    assert watch.check(CUDA) == 5 * GIB and fake_cuda["trims"] == 1  # 1 GB left under the cap, 5 GB idle
    clock.now += 2
    fake_cuda["reserved"] = 13 * GIB  # 3 GB under the cap: above a tenth of 16 GB, nothing to do
    assert device_pool.room(CUDA) == (3 * GIB, 16 * GIB) and watch.check(CUDA) == 0


def test_the_engine_watch_counts_its_trims_in_the_run_summary(problem, monkeypatch, fake_cuda, caplog):  # noqa: F811
    clock = Clock()
    monkeypatch.setattr(device_pool.time, "perf_counter", clock)
    eng = SparseEngine(SparseConfig(method="block_topk", min_tokens=0, backend="torch", block_q=64, block_k=64))
    eng.begin_run()
    fake_cuda["free"] = 2 * GIB
    with caplog.at_level(logging.DEBUG):
        eng._watch_pool(CUDA)
        clock.now += 5
        fake_cuda["reserved"] = fake_cuda["allocated"] + 2 * GIB
        eng._watch_pool(CUDA)
    said = [r for r in caplog.records if "allocator's pool held" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.INFO, logging.DEBUG]  # told once a run, then quietly
    assert "3072 MB idle" in said[0].getMessage()
    assert eng.cache.info()["pool_trims"] == 2
    assert "allocator pool handed back 2x" in eng.end_run().summary_line()
    eng.begin_run()  # a new run counts afresh
    assert eng.cache.info()["pool_trims"] == 0


def engine_with_one_entry(problem, monkeypatch, idle):  # noqa: F811
    """An mc_sparse engine that anchored layer 0 at step 0, on a pretend device whose pool hands back ``idle`` bytes
    each time it is asked (engine/engine.py's ``trim_pool``). Returns (engine, the devices trimmed, q, k, v)."""
    import comfyui_sparse_attention.engine.engine as engine_mod
    handed = []
    monkeypatch.setattr(engine_mod, "trim_pool", lambda device: handed.append(device) or idle)
    eng = SparseEngine(SparseConfig(method="mc_sparse", min_tokens=0, backend="torch", block_q=64, block_k=64,
                                    warmup_steps=0, anchor_steps="0"))
    eng.begin_run()
    q, k, v = problem.qkv(0)
    eng.attend(q, k, v, CallContext(layer=0, step=0, layout=problem.layout))
    return eng, handed, q, k, v


def test_an_anchor_out_of_memory_hands_the_pool_back_before_it_spills_the_cache(problem, monkeypatch, caplog):  # noqa: F811
    eng, handed, q, k, v = engine_with_one_entry(problem, monkeypatch, 2 * GIB)
    calls = _oom_for(eng, monkeypatch, 1)
    with caplog.at_level(logging.WARNING):
        eng.attend(q, k, v, CallContext(layer=1, step=0, layout=problem.layout))
    # the pool's idle memory went back and the anchor ran again: the cache kept everything on the device
    assert len(calls) == 2 and len(handed) == 1 and eng.cache.info()["spills"] == 0
    assert len(eng.cache.on_device) == 2
    assert any("2048 MB idle in the allocator's pool" in r.getMessage() for r in caplog.records)
    # a second failure at the same call spills as before (the pool is handed back once a call)
    calls = _oom_for(eng, monkeypatch, 2)
    eng.attend(q, k, v, CallContext(layer=2, step=0, layout=problem.layout))
    assert len(calls) == 3 and len(handed) == 2 and eng.cache.info()["spills"] == 1
    eng.end_run()


def test_an_anchor_out_of_memory_without_idle_pool_memory_spills_at_once(problem, monkeypatch):  # noqa: F811
    eng, handed, q, k, v = engine_with_one_entry(problem, monkeypatch, 0)
    calls = _oom_for(eng, monkeypatch, 1)
    eng.attend(q, k, v, CallContext(layer=1, step=0, layout=problem.layout))
    assert len(calls) == 2 and len(handed) == 1 and eng.cache.info()["spills"] == 1
    eng.end_run()


def model_run(monkeypatch, idle, failures, oom_step=2, first=False):
    """A two-layer block_topk run of four steps whose forward at ``oom_step`` runs out of memory ``failures`` times
    (after its attention calls; ``first``: before them), on a pretend cudaMallocAsync device whose pool holds
    ``idle`` bytes (handed back once). Returns (patch, its counts: attempts at oom_step and trims, outputs); the
    run's error, if any, propagates."""
    state = dict(idle=idle, trims=0)

    def trim(device):
        state["trims"] += 1
        handed, state["idle"] = state["idle"], 0
        return handed
    monkeypatch.setattr(patch_mod, "async_pool", lambda device: True)
    monkeypatch.setattr(patch_mod, "trim_pool", trim)
    patch = SparseAttentionPatch(SparseConfig(method="block_topk", density=0.25, min_tokens=0, backend="torch",
                                              block_q=64, block_k=64))
    attempts, outs = [], []

    def model(x, t, transformer_options, step):
        if first and step == oom_step:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        for layer in range(2):
            q, k, v = qkv(layer, step)
            outs.append(patch(model_attention, q, k, v, 2, transformer_options=transformer_options,
                              skip_reshape=True, skip_output_reshape=True))
        if step == oom_step:
            attempts.append(1)
            if len(attempts) <= failures:
                raise torch.OutOfMemoryError("CUDA out of memory (test)")

    try:
        sample_with(patch, model)
    finally:
        state["attempts"] = len(attempts)
    return patch, state, outs


@pytest.mark.parametrize("failures", [1, 2])
def test_a_model_out_of_memory_hands_the_pool_back_then_moves_the_cache(monkeypatch, caplog, failures):
    """The model's forward runs out of memory at step 2 ``failures`` times: the first retry follows handing the
    pool's idle memory back (the cache stays on the device); a second failure moves the cache to host memory and
    runs the step a third time."""
    with caplog.at_level(logging.WARNING):
        patch, state, outs = model_run(monkeypatch, 3 * GIB, failures)
    assert state["attempts"] == failures + 1 and state["trims"] == 1
    assert patch.fallbacks.get("the model ran out of GPU memory: the allocator's idle memory handed back") == 1
    moved = patch.fallbacks.get("the model ran out of GPU memory: the cache moved to host memory")
    assert moved == (1 if failures == 2 else None)
    assert (patch.last_stats.cache["spills"] >= 1) == (failures == 2)
    warned = [r.getMessage() for r in caplog.records if "3072 MB idle in the allocator's pool" in r.getMessage()]
    assert len(warned) == 1 and "CUDA out of memory (test)" in warned[0]
    assert all(torch.isfinite(o).all() for o in outs)


def test_a_model_out_of_memory_with_no_idle_pool_memory_moves_the_cache_at_once(monkeypatch):
    """Nothing idle in the pool: the cache moves to host memory and the step runs once more (two attempts)."""
    patch, state, _ = model_run(monkeypatch, 0, 1)
    assert state["attempts"] == 2 and state["trims"] == 1
    assert patch.fallbacks.get("the model ran out of GPU memory: the allocator's idle memory handed back") is None
    assert patch.fallbacks.get("the model ran out of GPU memory: the cache moved to host memory") == 1


def test_a_model_out_of_memory_with_neither_idle_memory_nor_cache_reaches_the_caller(monkeypatch):
    """The first step's forward fails before any attention call: nothing is cached and the pool holds nothing idle,
    so the model's error reaches the sampler, with its message."""
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory \\(test\\)"):
        model_run(monkeypatch, 0, 1, oom_step=0, first=True)
