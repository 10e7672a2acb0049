"""Small cards (CPU): the cache plans with an installed memory probe (ComfyUI's view), keeps the residuals that
matter most when room runs out and says which were dropped, and an out-of-memory error in the model moves the
run's cache off the device and runs the forward again instead of ending the run."""

import dataclasses
import weakref
from types import SimpleNamespace

import pytest
import torch
from test_patch_runs import model_attention, qkv, sample_with

from comfyui_sparse_attention.engine import SparseConfig, TokenLayout, cache as cache_mod
from comfyui_sparse_attention.engine.cache import Entry, SelectionCache
from comfyui_sparse_attention.engine.policy_static import build_static
from comfyui_sparse_attention.engine.residual import Residual
from comfyui_sparse_attention.engine.stats import RunStats
from comfyui_sparse_attention.nodes.patch import SparseAttentionPatch


def entry(seed, importance, n=4096):
    g = torch.Generator().manual_seed(seed)
    sel = build_static(1, 2, n, TokenLayout(grid=(4, 32, 32)), SparseConfig(block_q=64, block_k=64), "cpu")
    return Entry(sel, Residual(torch.randn(1, 2, n, 64, generator=g)), importance=importance)


@pytest.mark.parametrize("as_tensor", [False, True])
def test_the_residuals_that_matter_most_are_kept(monkeypatch, caplog, as_tensor):
    """as_tensor: importances handed over as 0-d tensors, as the engine does (read by the cache only once room runs
    out, docs/kernel_notes.md, "v26")."""
    monkeypatch.setattr(cache_mod, "host_memory", lambda: None)
    wrap = torch.tensor if as_tensor else float
    small, big = entry(0, wrap(0.01)), entry(1, wrap(0.30))
    room = small.nbytes + small.selection.nbytes + 10  # one full entry and one selection
    cache = SelectionCache(device_budget=room, cpu_budget=0, offload=False)
    assert cache.put((3, True, (), 4096), small) == "device"
    assert isinstance(cache.on_device[(3, True, (), 4096)].importance, torch.Tensor) == as_tensor  # not read yet
    with caplog.at_level("WARNING"):
        assert cache.put((7, True, (), 4096), big) == "device"  # the less important residual gave way
    assert cache.on_device[(7, True, (), 4096)].priority == pytest.approx(0.30)
    assert cache.on_device[(3, True, (), 4096)].residual is None
    assert cache.on_device[(7, True, (), 4096)].residual is not None
    assert cache.info()["dropped_residual_layers"] == [3] and cache.counters["residual_dropped"] == 1
    assert any("residuals" in r.message for r in caplog.records)
    # a less important newcomer does not push a more important residual out
    # (no room on the device even for its selection, no host side: it is not stored)
    assert cache.put((9, True, (), 4096), entry(2, 0.001)) == "none"
    assert cache.on_device[(7, True, (), 4096)].residual is not None
    merged = RunStats.merged([RunStats().finish(cache.info()), RunStats().finish({"dropped_residual_layers": [12]})])
    assert set(merged.cache["dropped_residual_layers"]) == {3, 12}


def test_a_full_card_and_host_budget_keep_the_selection_in_host_memory(monkeypatch, caplog):
    """A 16 GB card with the small-VRAM preset: no room on the device, the host budget full of residuals that matter
    more. The newcomer's residual is dropped and its selection kept in host memory past the budget (the layer stays
    sparse, without residual), instead of the layer falling back to dense attention at every reuse step."""
    monkeypatch.setattr(cache_mod, "host_memory", lambda: None)
    kept = entry(0, 0.30)
    cache = SelectionCache(device_budget=0, cpu_budget=kept.nbytes + 10, offload=True)
    assert cache.put((3, True, (), 4096), kept) == "cpu"
    newcomer = entry(1, 0.01)
    with caplog.at_level("WARNING"):
        assert cache.put((7, True, (), 4096), newcomer) == "cpu-no-residual"
    assert any("residuals" in r.message for r in caplog.records)
    assert cache.on_cpu[(3, True, (), 4096)].residual is not None  # the more important residual stays
    bare = cache.get((7, True, (), 4096), "cpu")
    assert bare.residual is None and torch.equal(bare.selection.kv_indices, newcomer.selection.kv_indices)
    # host memory holds the selections' lists as int16 (Entry.pinned)
    held = kept.residual.nbytes + kept.selection.host_form().nbytes + newcomer.selection.host_form().nbytes
    assert cache.cpu_bytes == held > cache.cpu_budget
    assert cache.counters["fallbacks"] == 0 and cache.info()["dropped_residual_layers"] == [7]
    # the host reserve still holds: with no host memory to spare the layer falls back
    monkeypatch.setattr(cache_mod, "host_memory", lambda: (1 << 30, 64 << 30))
    assert cache.put((9, True, (), 4096), entry(2, 0.001)) == "none" and cache.counters["fallbacks"] == 1
    # without offloading nothing goes to the host
    off = SelectionCache(device_budget=0, cpu_budget=1 << 30, offload=False)
    assert off.put((3, True, (), 4096), entry(3, 0.1)) == "none"
    # an entry without a residual (residual off) gets the same slack for its selection
    monkeypatch.setattr(cache_mod, "host_memory", lambda: None)
    bare = Entry(entry(4, 0.1).selection, None)
    full = SelectionCache(device_budget=0, cpu_budget=bare.host_nbytes * 2 - 1, offload=True)
    assert full.put((1, True, (), 4096), bare) == "cpu" and full.put((2, True, (), 4096), bare) == "cpu"
    assert full.cpu_bytes > full.cpu_budget and full.counters["residual_dropped"] == 0


def test_residuals_are_not_dropped_for_a_newcomer_that_still_would_not_fit(monkeypatch):
    """A more important newcomer takes the room of less important residuals only when that makes room: if dropping
    every lesser residual would still leave it out, they stay and the newcomer keeps its selection alone."""
    monkeypatch.setattr(cache_mod, "host_memory", lambda: None)
    small = entry(0, 0.01)
    big = Entry(entry(1, 0.30).selection, Residual(torch.randn(1, 2, 4096, 256)), importance=0.30)  # 4x the residual
    cache = SelectionCache(device_budget=0, cpu_budget=small.nbytes + 10, offload=True)
    assert cache.put((3, True, (), 4096), small) == "cpu"
    assert cache.put((7, True, (), 4096), big) == "cpu-no-residual"
    assert cache.on_cpu[(3, True, (), 4096)].residual is not None  # kept: dropping it would not have made room
    assert cache.info()["dropped_residual_layers"] == [7] and cache.counters["residual_dropped"] == 1


def test_a_spill_without_host_room_keeps_the_selections(monkeypatch):
    """After the model runs out of memory, device entries move to the host; where the host budget has no room for a
    whole entry, its selection alone goes (the layer stays sparse without its residual) instead of the entry being
    dropped (its layer would anchor again)."""
    monkeypatch.setattr(cache_mod, "host_memory", lambda: None)
    a, b = entry(0, 0.2), entry(1, 0.1)
    cache = SelectionCache(device_budget=1 << 30, cpu_budget=a.nbytes + 10, offload=True)
    assert cache.put((1, True, (), 4096), a) == "device" and cache.put((2, True, (), 4096), b) == "device"
    assert cache.spill(1.0) == a.nbytes + b.nbytes and not cache.on_device
    assert cache.on_cpu[(1, True, (), 4096)].residual is not None  # the first moved whole
    kept = cache.on_cpu[(2, True, (), 4096)]
    assert kept.residual is None and torch.equal(kept.selection.kv_indices, b.selection.kv_indices)
    assert cache.counters["residual_dropped"] == 1 and cache.info()["dropped_residual_layers"] == [2]


def test_the_memory_probe_replaces_the_drivers_view(monkeypatch):
    seen = []

    def probe(dev):
        seen.append(dev)
        return (10 << 30, 16 << 30)  # what ComfyUI says: 10 GiB free of a 16 GiB card
    cache_mod.set_device_probe(probe)
    try:
        assert cache_mod.device_memory(torch.device("cuda", 0)) == (10 << 30, 16 << 30) and seen
        # the auto budget plans with it: 10 GiB free, reserve max(8 GiB, 25 % of 16) = 8 GiB -> 2 GiB of room
        cache = SelectionCache(device_budget=None, cpu_budget=0, offload=False)
        e = entry(0, 0.1)
        cuda0 = torch.device("cuda", 0)

        def tensors_on(dev, nbytes):
            return lambda _: [SimpleNamespace(device=dev, numel=lambda: nbytes, element_size=lambda: 1)]
        # a host entry (a prefetch) brings all its bytes: 2 GiB fit, a byte more does not
        monkeypatch.setattr(cache_mod, "_tensors", tensors_on(torch.device("cpu"), 1 << 30))
        assert cache._device_fits(1 << 30, e, cuda0) and cache._device_fits(2 << 30, e, cuda0)
        assert not cache._device_fits((2 << 30) + 1, e, cuda0)
        # a newcomer computed on the card already holds 1 GiB there, which the free memory no longer counts:
        # storing 3 GiB of it takes 2 GiB more
        monkeypatch.setattr(cache_mod, "_tensors", tensors_on(cuda0, 1 << 30))
        assert cache._device_fits(3 << 30, e) and not cache._device_fits((3 << 30) + 1, e)
        # only what it stores counts: its selection alone (0.5 GiB, all of it resident) takes nothing more
        assert cache._device_fits(1 << 29, e)
    finally:
        cache_mod.set_device_probe(None)


def test_an_out_of_memory_error_drops_the_prefetched_copies_and_stops_prefetching(monkeypatch):
    """A reuse step holds the entry in use and the next layer's prefetched copy on the device; when the model
    runs out of memory with every entry already in host memory, the prefetched copy is what can be freed: spill
    frees it, counts it, and the rest of the run fetches each entry only when its call comes."""
    monkeypatch.setattr(cache_mod, "host_memory", lambda: None)
    cache = SelectionCache(device_budget=0, cpu_budget=1 << 30, offload=True)
    keys = [(layer, True, (), 4096) for layer in range(3)]
    for i, key in enumerate(keys):
        assert cache.put(key, entry(i, 0.1)) == "cpu"
    cache.new_step()  # the anchor step's order predicts the reuse step's
    assert cache.get(keys[0], "cpu") is not None and keys[1] in cache.prefetched
    size = cache.prefetched[keys[1]][0].nbytes
    assert size > 0 and cache.spill(1.0, stop_prefetch=True) == size
    assert not cache.prefetched and cache.info()["prefetch_off"]
    assert cache.get(keys[1], "cpu") is not None and not cache.prefetched  # fetched, nothing prefetched
    assert cache.counters["fetched"] == 2 and cache.counters["prefetched"] == 1  # layers 0 and 1 fetched
    cache.reset()
    assert not cache.prefetch_off  # a new run prefetches again


def test_relieve_frees_prefetched_copies_and_the_whole_device_cache(monkeypatch):
    """The model's out-of-memory handler (DeviceEngines.relieve) frees a prefetched copy even when no entry lives
    on the device, and empties the device cache even when the prefetched copies alone outweigh it; an anchor's
    own spill (share 0.5, engine._anchor_with_room) leaves prefetching on."""
    from comfyui_sparse_attention.engine.engines import DeviceEngines
    monkeypatch.setattr(cache_mod, "host_memory", lambda: None)
    engines = DeviceEngines(SparseConfig(method="block_topk", min_tokens=0, backend="torch"))
    cache = engines.engine("cpu").cache
    cache.cpu_budget, cache.offload = 1 << 30, True
    big = entry(1, 0.1)
    small = Entry(entry(0, 0.1).selection, None, importance=0.1)  # a selection without its residual
    cache.on_device[(0, True, (), 1024)] = small  # a small entry on the device, a larger prefetched copy
    cache.on_cpu[(1, True, (), 4096)] = big
    cache.prefetched[(1, True, (), 4096)] = (big, None)
    assert big.nbytes > small.nbytes
    assert engines.relieve() == small.nbytes + big.nbytes
    assert not cache.on_device and not cache.prefetched and cache.prefetch_off
    assert (0, True, (), 1024) in cache.on_cpu  # moved, not lost
    cache.reset()
    cache.prefetched[(1, True, (), 4096)] = (big, None)  # only a prefetched copy: still something to free
    assert engines.relieve() == big.nbytes
    cache.reset()
    cache.prefetched[(1, True, (), 4096)] = (big, None)
    assert cache.spill(0.5) == big.nbytes and not cache.prefetch_off
    # the flag of a two-GPU run: set when either device set it, and still a flag
    merged = RunStats.merged([RunStats().finish({"prefetch_off": False}), RunStats().finish({"prefetch_off": True})])
    assert merged.cache["prefetch_off"] is True


def test_an_out_of_memory_model_step_moves_the_cache_and_runs_again(caplog):
    patch = SparseAttentionPatch(SparseConfig(method="block_topk", density=0.25, min_tokens=0, backend="torch",
                                              block_q=64, block_k=64))
    failed, outs = [], []

    def model(x, t, transformer_options, step):
        activation = torch.zeros(8)  # stands for the forward's activations on the GPU
        if failed:  # the retry: the failed attempt's activations are gone (not kept by its traceback)
            assert failed[0]() is None
        for layer in range(2):
            q, k, v = qkv(layer, step)
            outs.append(patch(model_attention, q, k, v, 2, transformer_options=transformer_options,
                              skip_reshape=True, skip_output_reshape=True))
        if step == 2 and not failed:  # the model runs out of memory after the attention calls of step 2
            failed.append(weakref.ref(activation))
            raise torch.OutOfMemoryError("CUDA out of memory (test)")

    sample_with(patch, model)
    assert failed and len(outs) == 2 * 5  # step 2 ran twice
    assert patch.fallbacks.get("the model ran out of GPU memory: the cache moved to host memory") == 1
    assert patch.last_stats.cache["spills"] >= 1
    # the warning says what the error said and where the model raised it
    warned = [r.getMessage() for r in caplog.records if "the model ran out of GPU memory" in r.getMessage()]
    assert len(warned) == 1 and "(CUDA out of memory (test); raised at test_small_cards.py:" in warned[0]
    assert " in model)" in warned[0]
    assert all(torch.isfinite(o).all() for o in outs)


def test_layers_whose_residual_found_no_room_run_dense_at_reuse_steps():
    """Engine: with room for one layer's residual, the other layer's residual is dropped, and that layer runs dense
    at its reuse steps (exactly the dense output) while the layer that kept its residual runs sparse with it."""
    from sparse_ref import rel_l2

    from comfyui_sparse_attention.engine import CallContext, SparseEngine
    from comfyui_sparse_attention.engine.synthetic import SyntheticVideoAttention
    problem = SyntheticVideoAttention(frames=4, height=16, width=16, text=32, heads=2, head_dim=64, steps=8, seed=3)
    base = dict(method="block_topk", density=0.15, warmup_steps=0, anchor_steps="", min_tokens=0, backend="torch",
                block_q=64, block_k=64, residual_precision="fp8", offload=False)
    probe = SparseEngine(SparseConfig(**base))
    probe.begin_run()
    q, k, v = problem.qkv(0)
    probe.attend(q, k, v, CallContext(layer=0, step=0, layout=problem.layout))
    one = next(iter(probe.cache.on_device.values()))
    probe.end_run()
    room_mb = (one.nbytes + one.selection.nbytes * 2) / 2**20  # one whole entry and a second selection
    eng = SparseEngine(SparseConfig(cache_budget_mb=room_mb, **base))
    eng.begin_run()
    outs = {}
    for step in range(3):
        q, k, v = problem.qkv(step)
        for layer in (0, 1):
            outs[layer, step] = eng.attend(q, k, v, CallContext(layer=layer, step=step, layout=problem.layout))
    stats = eng.end_run()
    dropped = stats.cache["dropped_residual_layers"]
    assert len(dropped) == 1, stats.cache
    kept = 1 - dropped[0]
    q, k, v = problem.qkv(2)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    exact = probe._dense(q, k, v, None, None)
    assert torch.equal(outs[dropped[0], 2], exact)  # dense, not sparse without its residual
    assert not torch.equal(outs[kept, 2], exact) and rel_l2(outs[kept, 2], dense) < 0.5  # sparse, with its residual
    rows = stats.as_dict()["layers"]
    assert rows[dropped[0]]["dense"] == 2 and rows[kept]["reuses"] == 2


@pytest.mark.parametrize("diffuse_first", [True, False])
def test_the_layer_furthest_from_dense_is_the_one_that_runs_dense(diffuse_first):
    """Engine: with room for one layer's residual, the layer whose anchor's sparse output is further from dense
    (attention spread over every key, which a 15 % selection captures worst) loses its residual and runs dense at
    reuse steps, whichever layer anchors first; the layer kept sparse is the one nearest dense (on the testbed this
    order kept 35.6 dB against 33.0 dB for the opposite one: docs/benchmarks.md, "Which layers run dense when
    residuals find no room")."""
    from comfyui_sparse_attention.engine import CallContext, SparseEngine
    from comfyui_sparse_attention.engine.synthetic import SyntheticVideoAttention
    problem = SyntheticVideoAttention(frames=4, height=16, width=16, text=32, heads=2, head_dim=64, steps=8, seed=3)
    base = dict(method="block_topk", density=0.15, warmup_steps=0, anchor_steps="", min_tokens=0, backend="torch",
                block_q=64, block_k=64, residual_precision="fp8", offload=False)
    g = torch.Generator().manual_seed(0)
    q0, _, _ = problem.qkv(0)
    diffuse = [torch.randn(q0.shape, generator=g) * 0.05 for _ in range(3)]  # near-uniform attention
    probe = SparseEngine(SparseConfig(**base))
    probe.begin_run()
    probe.attend(*problem.qkv(0), CallContext(layer=0, step=0, layout=problem.layout))
    one = next(iter(probe.cache.on_device.values()))
    probe.end_run()
    eng = SparseEngine(SparseConfig(cache_budget_mb=(one.nbytes + one.selection.nbytes * 2) / 2**20, **base))
    diffuse_layer, local_layer = (0, 1) if diffuse_first else (1, 0)
    eng.begin_run()
    for step in range(2):
        calls = {local_layer: problem.qkv(step), diffuse_layer: diffuse}
        for layer in (0, 1):
            eng.attend(*calls[layer], CallContext(layer=layer, step=step, layout=problem.layout))
    stats = eng.end_run()
    rows = stats.as_dict()["layers"]
    assert rows[diffuse_layer]["fidelity"] > rows[local_layer]["fidelity"]  # further from dense at the anchor
    assert stats.cache["dropped_residual_layers"] == [diffuse_layer]
    assert rows[diffuse_layer]["dense"] == 1 and rows[local_layer]["reuses"] == 1


def test_auto_budget_without_room_does_not_prefetch(monkeypatch):
    """Under the "auto" budget the next layer's host entry is copied ahead only where the device has room for it:
    on a small card a prefetched copy crowded the model's own forward into an out-of-memory error."""
    monkeypatch.setattr(cache_mod, "host_memory", lambda: None)
    keys = [(layer, True, (), 4096) for layer in range(3)]

    def run(non_cuda_room):
        monkeypatch.setattr(cache_mod, "AUTO_NON_CUDA_BYTES", non_cuda_room)
        cache = SelectionCache(device_budget=None, cpu_budget=1 << 30, offload=True)
        for i, key in enumerate(keys):
            cache.on_cpu[key] = entry(i, 0.1)  # as after a run whose device had no room
        cache.order_now = list(keys)
        cache.new_step()
        assert cache.get(keys[0], "cpu") is not None  # fetched when used, either way
        return cache.counters["prefetched"]
    assert run(1 << 30) == 1  # room: the next entry is copied ahead
    assert run(1024) == 0  # no room: nothing is copied ahead


def test_prefetch_asks_for_room_for_the_widened_copy(monkeypatch):
    """A host entry's block lists are int16 and its device copy's int32: the prefetch asks the device for the copy's
    size, so room for the host entry's bytes alone copies nothing ahead."""
    monkeypatch.setattr(cache_mod, "host_memory", lambda: None)
    keys = [(layer, True, (), 4096) for layer in range(2)]
    host = [entry(i, 0.1).pinned() for i in range(2)]
    assert host[1].device_nbytes == host[1].to("cpu").nbytes > host[1].nbytes

    def prefetched(room):
        monkeypatch.setattr(cache_mod, "AUTO_NON_CUDA_BYTES", room)
        cache = SelectionCache(device_budget=None, cpu_budget=1 << 30, offload=True)
        cache.on_cpu.update(zip(keys, host))
        cache.order_now = list(keys)
        cache.new_step()
        assert cache.get(keys[0], "cpu") is not None
        return cache.counters["prefetched"]
    assert prefetched(host[1].nbytes) == 0
    assert prefetched(host[1].device_nbytes) == 1


def test_host_entries_keep_block_lists_as_int16_and_give_back_int32(monkeypatch):
    """An offloaded block selection's lists are int16 in host memory (half their bytes, so a capped host holds more
    layers' entries), and an entry fetched back has the int32 lists the kernels take, equal to the stored ones; lists
    whose indices could pass int16's range stay int32."""
    monkeypatch.setattr(cache_mod, "host_memory", lambda: None)
    e = entry(0, 0.1)
    sel = e.selection
    host = e.pinned()
    assert host.selection.kv_indices.dtype == torch.int16 and host.selection.kv_counts.dtype == torch.int32
    assert host.selection.nbytes == sel.nbytes - sel.kv_indices.numel() * 2
    back = host.to("cpu")
    assert back.selection.kv_indices.dtype == torch.int32 and torch.equal(back.selection.kv_indices, sel.kv_indices)
    assert torch.equal(back.selection.kv_counts, sel.kv_counts) and back.selection.density == sel.density
    # the cache's host side counts the narrower lists; a fetched entry runs as the original does
    cache = SelectionCache(device_budget=0, cpu_budget=1 << 30, offload=True)
    assert cache.put((3, True, (), 4096), e) == "cpu"
    assert cache.cpu_bytes == e.residual.nbytes + host.selection.nbytes == e.host_nbytes
    got = cache.get((3, True, (), 4096), "cpu")
    assert got.selection.kv_indices.dtype == torch.int32 and torch.equal(got.selection.kv_indices, sel.kv_indices)
    q, k, v = (torch.randn(1, 2, 4096, 64, generator=torch.Generator().manual_seed(i)) for i in range(3))
    assert torch.equal(got.selection.run(q, k, v, backend="torch"), sel.run(q, k, v, backend="torch"))
    # lists whose key blocks could number more than 32 767 (64 query blocks of 1 024 tokens, 1-token key blocks)
    wide = dataclasses.replace(sel, block_q=1024, block_k=1)
    assert wide.host_form() is wide and wide.device_form() is wide
