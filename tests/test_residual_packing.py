"""Residuals packed to 4 bits (engine/residual.py; residual_precision "int4" and "auto"): the levels, the moves, the
engine's reuse with them, and the cache packing residuals before it drops any (docs/decisions.md, "Residuals at 4
bits")."""

import argparse
import json

import pytest
import torch
from sparse_ref import rel_l2

from comfyui_sparse_attention.engine import CallContext, SparseConfig, SparseEngine, TokenLayout
from comfyui_sparse_attention.engine import cache as cache_mod
from comfyui_sparse_attention.engine.cache import Entry, SelectionCache
from comfyui_sparse_attention.engine.policy_static import build_static
from comfyui_sparse_attention.engine.residual import PACK_STEP, Residual, residual_precision
from comfyui_sparse_attention.engine.synthetic import SyntheticVideoAttention

FP8 = getattr(torch, "float8_e4m3fn", None)
pytestmark = pytest.mark.skipif(FP8 is None, reason="needs torch.float8_e4m3fn")


def residual(seed=0, shape=(2, 3, 40, 64)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.rand(shape[:3] + (1,), generator=g) * 5


def test_packing_keeps_the_nearest_level_on_the_row_scale():
    x = residual()
    x[0, 1, 3, 7] = float("nan")
    x[1, 2, 5] = 0.0  # an all-zero row
    fp8 = Residual.encode(x, "fp8")
    packed = fp8.pack()
    assert packed.packed and packed.data.dtype == torch.uint8 and tuple(packed.data.shape) == (2, 3, 40, 32)
    assert packed.shape == tuple(x.shape) == fp8.shape and packed.scale.dtype == torch.bfloat16
    assert packed.nbytes == fp8.nbytes - x.numel() // 2 - fp8.scale.numel() * 2 == fp8.nbytes - fp8.packing_frees
    given = []  # buffers the caller allocates (page-locked ones in the cache)

    def empty(shape, dtype):
        given.append(torch.empty(shape, dtype=dtype))
        return given[-1]
    into = fp8.pack(work=torch.device("cpu"), empty=empty)
    assert [t.dtype for t in given] == [torch.uint8, torch.bfloat16] and into.data is given[0]
    assert into.scale is given[1] and torch.equal(given[0], packed.data)
    back = packed.unpacked()
    assert not back.packed and back.data.dtype == FP8 and back.scale.dtype == torch.float32
    # the scale comes back within bf16's rounding (2^-8 of it; the 4-bit levels round by up to 1/14 of the row's max)
    assert torch.allclose(back.scale, fp8.scale, rtol=2 ** -8, atol=0)
    v8, v4 = fp8.data.float(), back.data.float()
    nan = torch.isnan(v8)
    assert torch.equal(torch.isnan(v4), nan) and nan.sum() == 1
    # each value is the nearest level k x 64 of the fp8 value (ties to even), and fp8 holds every level exactly
    want = torch.round(v8 / PACK_STEP).clamp(-7, 7) * PACK_STEP
    assert torch.equal(v4[~nan], want[~nan])
    assert ((v4[~nan] - v8[~nan]).abs() <= PACK_STEP / 2).all()
    assert torch.equal(back.decode(torch.float32)[1, 2, 5], torch.zeros(64))
    # what a packed residual adds is the unpacked one's, and its norm
    out = torch.zeros_like(x)
    torch.testing.assert_close(packed.add_to(out.clone()), back.add_to(out.clone()), equal_nan=True)
    assert packed.norm() == back.norm() or (torch.isnan(torch.tensor(packed.norm())) and
                                            torch.isnan(torch.tensor(back.norm())))
    # levels that are already multiples of 64 pass unchanged
    exact = Residual(torch.tensor([[[[-448.0, -64.0, 0.0, 192.0]]]]).to(FP8), torch.ones(1, 1, 1, 1))
    assert torch.equal(exact.pack().unpacked().data.float(), exact.data.float())


def test_a_packed_residual_keeps_its_mass_in_fp16_about_each_heads_median():
    """The mass rows (log Z_C, log beta) of a mass-weighted residual: packed, log Z_C is kept less its head's median
    in fp16 (the rows of a head span a few units where Z_C itself may be tens), log beta as is; unpacked, both come
    back in fp32 within fp16's rounding of what was kept, infinities and NaN as they were, and a row far beyond fp16's
    range from its head's median saturates without costing the other rows their precision; moves and batch slices
    keep the base; packing frees exactly the bytes ``packing_frees`` says."""
    g = torch.Generator().manual_seed(5)
    fp8 = Residual.encode(residual(3), "fp8")
    b, h, n, _ = fp8.data.shape
    head_level = torch.tensor([[12.0, 35.0, -4.0], [60.0, 0.5, 21.0]]).view(b, h, 1)
    log_c = head_level + 3 * torch.randn(b, h, n, generator=g)
    log_beta = -torch.rand(b, h, n, generator=g) * 12
    log_c[0, 1, 4], log_beta[0, 1, 4] = float("-inf"), float("-inf")  # a row the anchor left nothing out of
    log_c[1, 0, 7] = float("nan")
    log_c[1, 2, 9] = 1e8  # pathological logits in one row of a head
    fp8.mass = torch.stack((log_c, log_beta), -1)
    packed = fp8.pack()
    assert packed.mass.dtype == torch.float16 and packed.mass_base.shape == (b, h, 1, 1)
    assert packed.nbytes == fp8.nbytes - fp8.packing_frees
    back = packed.unpacked().mass
    assert back.dtype == torch.float32 and back.shape == fp8.mass.shape
    finite = torch.isfinite(fp8.mass)
    finite[1, 2, 9, 0] = False  # the outlier saturates (its weight's limit); its head's rows keep their precision
    assert torch.equal(torch.isfinite(back), finite) and torch.equal(torch.isnan(back), torch.isnan(fp8.mass))
    assert back[0, 1, 4, 0] == back[0, 1, 4, 1] == float("-inf")
    assert back[1, 2, 9, 0] == float("inf")
    # fp16 keeps 11 significant bits of what is left about the head's median (|x| < 16 here: within 2^-7)
    assert torch.isfinite(back[finite]).all() and (back[finite] - fp8.mass[finite]).abs().max() <= 2 ** -7
    moved = packed.map(lambda t: t.clone())
    assert moved.mass_base is not packed.mass_base and torch.equal(moved.mass_base, packed.mass_base)
    torch.testing.assert_close(moved.unpacked().mass, back, equal_nan=True, rtol=0, atol=0)
    part = packed.batch_slice(1, 2)
    torch.testing.assert_close(part.unpacked().mass, back[1:2], equal_nan=True)


def test_packing_in_small_chunks_gives_the_same_bytes(monkeypatch):
    from comfyui_sparse_attention.engine import residual as residual_mod
    fp8 = Residual.encode(residual(2, (3, 5, 24, 64)), "fp8")
    whole = fp8.pack()
    whole_back = whole.unpacked().data.view(torch.uint8)  # one chunk each way
    monkeypatch.setattr(residual_mod, "CHUNK_ELEMS", 24 * 64 * 2 + 7)  # two (batch, head) rows a chunk
    monkeypatch.setattr(residual_mod, "UNPACK_CHUNK_ELEMS", 24 * 32 * 3)  # three packed rows a chunk
    chunked = fp8.pack()
    assert torch.equal(chunked.data, whole.data)
    assert torch.equal(chunked.unpacked().data.view(torch.uint8), whole_back)


def test_int4_is_fp8_then_packed_and_other_storage_is_not_packed():
    x = residual(1)
    int4 = Residual.encode(x, "int4")
    assert int4.packed and torch.equal(int4.data, Residual.encode(x, "fp8").pack().data)
    assert not Residual.encode(x, "auto").packed  # "auto" stores fp8; the cache packs it when room is short
    model = Residual.encode(x, "model")
    assert not model.can_pack() and model.stored_as("int4") is model
    with pytest.raises(ValueError, match="fp8"):
        model.pack()
    assert not int4.can_pack()  # packed already
    assert residual_precision("int4", torch.device("cpu")) == residual_precision("auto", torch.device("cpu")) == "fp8"
    with pytest.raises(ValueError, match="residual precision"):
        Residual.encode(x, "int3")
    # moves and batch slices keep the form
    moved = int4.map(lambda t: t.clone())
    assert moved.packed and torch.equal(moved.decode(torch.float32), int4.decode(torch.float32))
    part = int4.batch_slice(1, 2)
    assert part.packed and part.shape == (1, 3, 40, 64)
    torch.testing.assert_close(part.decode(torch.float32), int4.decode(torch.float32)[1:2])
    for p in ("int4", "auto"):
        assert SparseConfig(residual_precision=p).residual_precision == p
    assert SparseConfig().residual_precision == "auto"  # the default packs only where room runs short
    with pytest.raises(ValueError, match="residual_precision"):
        SparseConfig(residual_precision="int8")


BASE = dict(method="block_topk", density=0.15, warmup_steps=0, anchor_steps="", min_tokens=0, backend="torch",
            block_q=64, block_k=64, offload=False)


def run_engine(problem, steps=3, layers=(0,), **over):
    eng = SparseEngine(SparseConfig(**{**BASE, **over}))
    eng.begin_run()
    outs = {}
    for step in range(steps):
        q, k, v = problem.qkv(step)
        for layer in layers:
            outs[layer, step] = eng.attend(q, k, v, CallContext(layer=layer, step=step, layout=problem.layout))
    entries = {key[0]: e for key, e in list(eng.cache.on_device.items()) + list(eng.cache.on_cpu.items())}
    return outs, eng.end_run(), entries


@pytest.fixture(scope="module")
def problem():
    return SyntheticVideoAttention(frames=4, height=16, width=16, text=32, heads=2, head_dim=64, steps=8, seed=3)


def test_the_engine_stores_int4_residuals_packed_and_reuses_them(problem):
    fp8, _, fp8_entries = run_engine(problem, residual_precision="fp8")
    int4, stats, int4_entries = run_engine(problem, residual_precision="int4")
    stored = int4_entries[0].residual
    assert stored.packed and not fp8_entries[0].residual.packed
    assert stored.nbytes < 0.6 * fp8_entries[0].residual.nbytes
    assert torch.equal(int4[0, 0], fp8[0, 0])  # the anchor's output is the dense one either way
    q, k, v = problem.qkv(2)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    for step in (1, 2):  # reuse: the residual differs by at most half a level of its row's scale, and the scale by
        # bf16's rounding (2^-8 of it) at fp8's largest value
        bound = ((PACK_STEP / 2 + 448 * 2 ** -8) * fp8_entries[0].residual.scale).expand_as(dense) + 1e-5
        assert ((int4[0, step] - fp8[0, step]).abs() <= bound).all()
        assert not torch.equal(int4[0, step], fp8[0, step])
    assert rel_l2(int4[0, 2], dense) < rel_l2(fp8[0, 2], dense) + 0.02
    assert stats.as_dict()["layers"][0]["reuses"] == 2 and not stats.cache["packed_residual_layers"]


def test_a_reuse_call_out_of_memory_while_unpacking_moves_the_cache_and_goes_on(problem, monkeypatch, caplog):
    """Unpacking a 4-bit residual needs an fp8 copy on the GPU at a reuse step, beside the model. When that runs out
    of memory, the cache moves part of itself off the GPU and the call unpacks again: same output, no error, and
    the log says so, once a run (an out-of-memory error the cache causes must not end a run, nor send a layer
    dense). Here both layers' first unpacking runs out of memory."""
    want, _, _ = run_engine(problem, steps=2, layers=(0, 1), residual_precision="int4", offload=True)
    real, calls = Residual.unpacked, []

    def first_tries_out_of_memory(self):
        calls.append(self.packed)
        if self.packed and len(calls) in (1, 3):  # layer 0's first try, then layer 1's (each retried once)
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(self)

    monkeypatch.setattr(Residual, "unpacked", first_tries_out_of_memory)
    eng = SparseEngine(SparseConfig(**{**BASE, "residual_precision": "int4", "offload": True}))
    eng.begin_run()
    with caplog.at_level("WARNING"):
        got = {(layer, step): eng.attend(*problem.qkv(step), CallContext(layer=layer, step=step, layout=problem.layout))
               for step in range(2) for layer in (0, 1)}
    assert len(calls) == 4 and eng.cache.counters["spills"] == 2
    assert eng.cache.on_cpu  # moved to host memory, still reused from there
    assert eng.cache.prefetch_off  # a prefetched copy of the next layer's entry would crowd the next unpacking
    stats = eng.end_run().as_dict()["layers"]
    assert all(row["reuses"] == 1 and row["dense"] == 0 for row in stats.values())
    warned = [r for r in caplog.records if "out of memory at a reuse call" in r.message]
    assert [r.levelname for r in warned] == ["WARNING"]
    assert "(CUDA out of memory (simulated); raised at test_residual_packing.py:" in warned[0].message
    for key, out in want.items():
        assert torch.equal(got[key], out)


def test_out_of_memory_with_no_cache_on_the_gpu_reaches_the_caller_named(problem, monkeypatch):
    """With nothing of the cache on the GPU to move, the out-of-memory error reaches the caller (the nodes then run
    the call dense), with a note saying where it happened."""
    def out_of_memory(self):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    eng = SparseEngine(SparseConfig(**{**BASE, "residual_precision": "int4", "offload": True}))
    eng.begin_run()
    eng.attend(*problem.qkv(0), CallContext(layer=0, step=0, layout=problem.layout))
    eng.cache.spill(1.0)  # every entry in host memory: a spill has nothing left to move
    monkeypatch.setattr(Residual, "unpacked", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError) as err:
        eng.attend(*problem.qkv(1), CallContext(layer=0, step=1, layout=problem.layout))
    assert any("reuse call unpacking its residual" in note for note in err.value.__notes__)
    eng.end_run()


def entry(seed, importance, n=4096):
    g = torch.Generator().manual_seed(seed)
    sel = build_static(1, 2, n, TokenLayout(grid=(n // 1024, 32, 32)), SparseConfig(block_q=64, block_k=64), "cpu")
    return Entry(sel, Residual.encode(torch.randn(1, 2, n, 64, generator=g), "fp8"), importance=importance)


@pytest.mark.parametrize("side", ["device", "cpu"])
def test_auto_packs_residuals_before_it_drops_any(monkeypatch, caplog, side):
    """Room for two fp8 entries: the third residual is packed, then the stored ones (least important first) until it
    fits; only when packing cannot make room are residuals dropped, as with fp8."""
    monkeypatch.setattr(cache_mod, "host_memory", lambda: None)
    # the fourth entry is twice as long: packing one stored residual cannot make room for its packed one
    es = [entry(i, imp, n=8192 if i == 3 else 4096) for i, imp in enumerate((0.2, 0.1, 0.3, 0.05, 0.4))]
    # two fp8 entries and two more selections (the third's and the fourth's): the third fits once one stored residual
    # is packed with it, the fourth's selection fits where its residual does not
    size = (lambda e: e.nbytes) if side == "device" else (lambda e: e.host_nbytes)  # host lists are int16
    room = 2 * size(es[0]) + size(Entry(es[0].selection, None)) + size(Entry(es[3].selection, None)) + 100
    budgets = dict(device_budget=room, cpu_budget=0, offload=False) if side == "device" else \
        dict(device_budget=0, cpu_budget=room, offload=True)
    cache = SelectionCache(pack_when_short=True, **budgets)
    store = cache.on_device if side == "device" else cache.on_cpu
    assert [cache.put((i, True, (), 4096), es[i]) for i in range(2)] == [side, side]
    with caplog.at_level("INFO"):
        assert cache.put((2, True, (), 4096), es[2]) == side
    assert any("4 bits" in r.message for r in caplog.records)
    packed = {k[0]: e.residual.packed for k, e in store.items()}
    # the newcomer is packed, and one stored residual with it: the less important of the two (layer 1)
    assert packed == {0: False, 1: True, 2: True}
    assert cache.counters["residual_dropped"] == 0 and cache.info()["packed_residual_layers"] == [1, 2]
    for i in range(3):  # what a packed entry holds is the fp8 residual's nearest levels; the other is untouched
        got = store[(i, True, (), 4096)].residual
        want = es[i].residual.pack() if packed[i] else es[i].residual
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(got.scale, want.scale)
    # a fourth would not fit even with layer 0 packed too: nothing is packed for nothing, and the least important
    # residual (the newcomer's) is dropped, as with fp8
    assert cache.put((3, True, (), 4096), es[3]) == f"{side}-no-residual"
    assert not store[(0, True, (), 4096)].residual.packed and cache.info()["dropped_residual_layers"] == [3]
    # a more important newcomer: the last fp8 residual is packed, and the one that matters least (layer 1's) gives
    # way for the rest
    assert cache.put((4, True, (), 4096), es[4]) == side
    assert store[(4, True, (), 4096)].residual.packed and store[(1, True, (), 4096)].residual is None
    assert store[(0, True, (), 4096)].residual.packed and store[(2, True, (), 4096)].residual.packed
    assert cache.info()["dropped_residual_layers"] == [1, 3] and cache.info()["packed_residual_layers"] == [0, 1, 2, 4]
    assert cache.device_bytes + cache.cpu_bytes <= room + 5 * es[0].selection.nbytes
    # without "auto" the same budget drops instead of packing
    plain = SelectionCache(**budgets)
    for i in range(3):
        plain.put((i, True, (), 4096), es[i])
    assert plain.counters["residual_packed"] == 0 and plain.counters["residual_dropped"] == 1


def test_auto_packs_only_on_the_side_where_packing_makes_room(monkeypatch):
    """A small fp8 residual on the device (the least important, so the first to pack were sides ignored) and a large
    one in host memory: a newcomer that finds room only once the host's residual is packed packs that one alone. The
    device's is kept at fp8, since packing it could not make room there."""
    monkeypatch.setattr(cache_mod, "host_memory", lambda: None)
    small, big, new = entry(0, 0.01, n=1024), entry(1, 0.2), entry(2, 0.1)
    frees = big.residual.packing_frees  # what packing the host's residual frees
    packed_new = new.nbytes - new.residual.packing_frees
    cache = SelectionCache(device_budget=small.nbytes, cpu_budget=big.nbytes + packed_new - frees + 1000,
                           offload=True, pack_when_short=True)
    assert cache.put((0, True, (), 1024), small) == "device"
    assert cache.put((1, True, (), 4096), big) == "cpu"
    assert cache.put((2, True, (), 4096), new) == "cpu"
    assert not cache.on_device[(0, True, (), 1024)].residual.packed
    assert cache.on_cpu[(1, True, (), 4096)].residual.packed and cache.on_cpu[(2, True, (), 4096)].residual.packed
    assert cache.info()["packed_residual_layers"] == [1, 2] and cache.counters["residual_dropped"] == 0
    assert cache.cpu_bytes <= cache.cpu_budget


def test_packing_spares_the_host_buffers_of_the_sizes_the_host_copy_asks_for(monkeypatch):
    """Before storing a packed entry the cache frees the host buffers it released, keeping those of the sizes it asks
    for next: the host copy's, whose block lists are int16 (asking with the device entry's int32 sizes freed the
    buffer of the packed entry it replaces at a later anchor, and page-locked a new one)."""
    monkeypatch.setattr(cache_mod, "host_memory", lambda: None)
    asked = []
    real = cache_mod.POOL.free_released
    monkeypatch.setattr(cache_mod.POOL, "free_released",
                        lambda owner, keep=(): asked.append(list(keep)) or real(owner, keep=keep))
    small, big, new = entry(0, 0.01, n=1024), entry(1, 0.2), entry(2, 0.1)
    packed_new = new.nbytes - new.residual.packing_frees
    cache = SelectionCache(device_budget=small.nbytes, cpu_budget=big.nbytes + packed_new - big.residual.packing_frees
                           + 1000, offload=True, pack_when_short=True)
    cache.put((0, True, (), 1024), small)
    cache.put((1, True, (), 4096), big)
    assert cache.put((2, True, (), 4096), new) == "cpu"
    stored = cache.on_cpu[(2, True, (), 4096)]
    assert stored.selection.kv_indices.dtype == torch.int16
    assert asked == [[t.numel() * t.element_size() for t in cache_mod._tensors(stored)]]


def test_a_host_packing_that_fails_gives_its_pool_buffer_back(monkeypatch):
    """Packing a host residual takes a page-locked buffer from the pool for the result; when packing raises (out of
    GPU memory for a chunk, say) the buffer goes back to the pool, owned by this cache, and the error propagates."""
    taken, released = [], []
    fake_pool = type("FakePool", (), {
        "empty": lambda self, shape, dtype, device=None: taken.append(torch.empty(shape, dtype=dtype)) or taken[-1],
        "release": lambda self, t, streams=(), owner=None: released.append((t, owner)),
        "forget": lambda self, tensors, owner: None})()
    monkeypatch.setattr(cache_mod, "POOL", fake_pool)

    def fail(self, work=None, empty=None):
        empty((1, 2, 4096, 32), torch.uint8)  # the packed data's buffer, then no GPU memory for a chunk
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(Residual, "pack", fail)
    cache = SelectionCache(device_budget=0, cpu_budget=1 << 30, offload=True, pack_when_short=True)
    cache._cuda_device = torch.device("cpu")  # as if the residual had come from a GPU
    with pytest.raises(torch.OutOfMemoryError):
        cache._packed(entry(0, 0.1).residual, host=True)
    assert len(taken) == 1 and len(released) == 1
    assert released[0][0] is taken[0] and released[0][1] is cache._pool_token


def test_auto_keeps_every_layer_sparse_where_fp8_sends_one_dense(problem):
    """Engine: room for one fp8 residual, a second selection and a row scale. fp8 drops a residual (that layer runs
    dense at its reuse steps); "auto" packs both residuals and both layers reuse sparsely."""
    _, _, probe = run_engine(problem, steps=1, residual_precision="fp8")
    one = probe[0]
    scale_bytes = one.residual.nbytes - one.residual.data.numel()  # the row scale (and the mass, if any)
    room_mb = (one.nbytes + one.selection.nbytes * 2 + scale_bytes) / 2**20
    _, fp8_stats, _ = run_engine(problem, layers=(0, 1), residual_precision="fp8", cache_budget_mb=room_mb)
    outs, stats, entries = run_engine(problem, layers=(0, 1), residual_precision="auto", cache_budget_mb=room_mb)
    assert len(fp8_stats.cache["dropped_residual_layers"]) == 1
    assert stats.cache["dropped_residual_layers"] == [] and stats.cache["packed_residual_layers"]
    rows = stats.as_dict()["layers"]
    assert rows[0]["reuses"] == rows[1]["reuses"] == 2 and rows[0]["dense"] == rows[1]["dense"] == 0
    assert any(e.residual.packed for e in entries.values())
    q, k, v = problem.qkv(2)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert all(rel_l2(outs[layer, 2], dense) < 0.5 for layer in (0, 1))


def test_the_report_names_the_layers_whose_residuals_were_packed():
    from test_segments import _Model, _run_patch, qkv

    from comfyui_sparse_attention.nodes.families import BY_NAME
    from comfyui_sparse_attention.nodes.patch import SparseAttentionPatch
    from comfyui_sparse_attention.nodes.report import render_report
    flux = BY_NAME["flux"].bind(_Model("comfy.ldm.flux.model", patch_size=2))
    patch = SparseAttentionPatch(SparseConfig(min_tokens=0, group_size=64, backend="torch",
                                              residual_precision="auto"), family=flux)
    _run_patch(patch, (1, 16, 8, 8), [qkv(7 + 16, h=2, d=32)] * 2)
    assert "4 bits" not in render_report(patch, -1)[0]  # room for every residual: none packed
    patch.last_run.stats.cache["packed_residual_layers"] = [1]
    text = render_report(patch, -1)[0]
    assert "residuals stored at 4 bits for lack of room at fp8 at layer(s) [1]" in text


def test_the_storage_bench_ranks_the_ways_to_keep_a_residual(tmp_path, bench_import):
    """bench/residual_storage.py on a small recording whose reuse step sees its anchor's inputs again: fp8 leaves only
    its rounding, 4 bits more, no residual the whole sparse error; every variant and extra density gets a row."""
    from safetensors.torch import save_file
    bench = bench_import("residual_storage")
    problem = SyntheticVideoAttention(frames=2, height=8, width=8, text=0, heads=2, head_dim=32, steps=4, seed=5)
    q, k, v = problem.qkv(0)
    rec = {f"layer{lay:02d}.step{s:02d}.{n}": t[0].half().contiguous() for lay in (0, 1) for s in (0, 1)
           for n, t in zip("qkv", (q, k, v))}
    save_file(rec, str(tmp_path / "qkv.safetensors"))
    def args(out, variants, densities):
        return argparse.Namespace(recording=str(tmp_path / "qkv.safetensors"), out=str(tmp_path / out), grid="2,8,8",
                                  anchors="0", total_steps=4, method="block_topk", density=0.25, size=64,
                                  weighting="fixed", variants=variants, densities=densities)
    doc = bench.run(args("out", ",".join(bench.VARIANTS), "0.5"))
    rows = {(r["variant"], r["density"]): r for r in doc["rows"]}
    assert set(rows) == {(v, 0.25) for v in bench.VARIANTS} | {("fp8", 0.5)}
    err = {key: r["mean_sq_rel_err"][1] for key, r in rows.items()}  # step 1 reuses step 0's anchor
    assert err["fp8", 0.25] < err["int4", 0.25] < err["none", 0.25]
    assert err["int4-g32", 0.25] < err["none", 0.25] and err["fp8", 0.25] < 1e-3
    assert set(rows["int4", 0.25]["per_layer"]) == {0, 1}
    saved = json.loads((tmp_path / "out" / "residual_storage.json").read_text())
    assert len(saved["rows"]) == len(doc["rows"]) and "| int4 | 0.25 |" in bench.table(doc)
    with pytest.raises(SystemExit, match="unknown"):
        bench.run(args("o2", "fp4", ""))


@pytest.mark.gpu
def test_a_host_residual_is_packed_on_its_gpu_into_page_locked_memory(monkeypatch):
    """residual_precision "auto" with the residuals in host memory (the small-VRAM preset's case): a stored host entry
    is packed on the GPU it came from (its bytes there and back, not a pass of the host's CPU) into page-locked
    memory, and equals the residual packed where it lies; reuse reads it back on the GPU."""
    monkeypatch.setattr(cache_mod, "host_memory", lambda: None)
    dev = torch.device("cuda")
    es = [entry(i, imp) for i, imp in enumerate((0.2, 0.1, 0.3))]
    cuda = [e.to(dev) for e in es]
    room = 2 * es[0].nbytes + 2 * es[0].selection.nbytes + es[0].residual.scale.numel() * 4 + 1000
    cache = SelectionCache(device_budget=0, cpu_budget=room, offload=True, pack_when_short=True)
    assert [cache.put((i, True, (), 4096), cuda[i]) for i in range(3)] == ["cpu"] * 3
    stored = {k[0]: e.wait() for k, e in cache.on_cpu.items()}
    assert not stored[0].residual.packed and stored[1].residual.packed and stored[2].residual.packed
    for i in (1, 2):
        data, scale = stored[i].residual.data, stored[i].residual.scale
        assert data.device.type == "cpu" and data.is_pinned() and scale.is_pinned()
        assert torch.equal(data, es[i].residual.pack().data) and torch.equal(scale, es[i].residual.pack().scale)
    back = cache.get((1, True, (), 4096), dev)
    assert back.residual.data.is_cuda and torch.equal(back.residual.unpacked().data.view(torch.uint8).cpu(),
                                                      es[1].residual.pack().unpacked().data.view(torch.uint8))


def test_a_cache_filled_at_the_first_anchor_keeps_every_residual_when_later_anchors_add_the_mass(problem):
    """Step-0 anchors write no mass; later ones do (mass-weighted reuse). A budget that holds the two layers' packed
    residuals without a mass and with one in its compact form (fp16 mass, bf16 scale): every layer stays sparse at
    every step, where a packed residual keeping fp32 scale and mass would not fit at the second anchor (on a 16 GB card
    with 16 GB of host memory that sent 4 of Wan 14B's 40 layers dense after every later anchor: docs/benchmarks.md,
    "4-bit residuals on a 16 GB card")."""
    over = dict(residual_precision="auto", residual_weighting="mass", anchor_steps="0,2")
    _, _, probe = run_engine(problem, steps=3, **over)  # room to spare: the second anchor's entry, as stored
    later = probe[0]
    assert later.residual.mass is not None and not later.residual.packed
    fp8 = later.residual
    packed_bytes = later.nbytes - fp8.packing_frees
    wide_bytes = later.selection.nbytes + fp8.data.numel() // 2 + fp8.scale.nbytes + fp8.mass.nbytes
    assert packed_bytes < wide_bytes
    room_mb = (2 * packed_bytes + 64) / 2**20
    assert 2 * wide_bytes > room_mb * 2**20  # the wide form would not fit both
    outs, stats, entries = run_engine(problem, steps=4, layers=(0, 1), cache_budget_mb=room_mb, **over)
    assert stats.cache["dropped_residual_layers"] == [] and sorted(stats.cache["packed_residual_layers"]) == [0, 1]
    rows = stats.as_dict()["layers"]
    assert rows[0]["reuses"] == rows[1]["reuses"] == 2 and rows[0]["dense"] == rows[1]["dense"] == 0
    assert all(e.residual.packed and e.residual.mass is not None for e in entries.values())
    q, k, v = problem.qkv(3)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert all(rel_l2(outs[layer, 3], dense) < 0.5 for layer in (0, 1))
