"""The pinned pool (engine/pinned_pool.py): exact-size page-locked host buffers recycled by size, and the cache
giving its forgotten host entries' buffers back. On the CPU the page-locking is a recorded fake; the real runtime
call runs in tests/test_gpu_kernels.py."""

import gc
import time

import pytest
import torch

from comfyui_sparse_attention.engine import cache as cache_mod, pinned_pool
from comfyui_sparse_attention.engine.cache import Entry, SelectionCache
from comfyui_sparse_attention.engine.pinned_pool import PinnedPool
from comfyui_sparse_attention.engine.residual import Residual

from test_small_cards import entry as cache_entry


class FakeRuntime:
    """Records page-locked ranges as cudaHostRegister / cudaHostUnregister would see them."""

    def __init__(self, fail=False):
        self.locked: dict[int, int] = {}
        self.registered = 0
        self.fail = fail

    def register(self, ptr, nbytes):
        if self.fail:
            return False
        assert ptr not in self.locked
        self.locked[ptr] = nbytes
        self.registered += 1
        return True

    def unregister(self, ptr):
        assert ptr in self.locked, "unregistering memory that was never registered"
        del self.locked[ptr]


def pool_of(rt, min_bytes=1024):
    return PinnedPool(rt.register, rt.unregister, min_bytes=min_bytes)


def test_buffers_are_exactly_the_size_asked_for_and_recycled_by_size():
    rt = FakeRuntime()
    pool = pool_of(rt)
    t = pool.empty((2, 3, 700, 5), torch.float8_e4m3fn)
    assert t.shape == (2, 3, 700, 5) and t.dtype == torch.float8_e4m3fn and t.is_contiguous()
    assert list(rt.locked.values()) == [2 * 3 * 700 * 5]  # no rounding up to a power of two
    assert pool.owns(t) and pool.held_bytes == 21000 and pool.free_bytes == 0
    t.view(torch.uint8).fill_(7)
    pool.release(t[1:])  # a view of the buffer releases it as well
    assert pool.free_bytes == 21000
    again = pool.empty((6, 3500), torch.float8_e4m3fn)  # the same byte count, another shape: the same buffer
    assert again.data_ptr() == t.data_ptr() and rt.registered == 1
    scale = pool.empty((2, 3, 700), torch.float32)  # another size: new memory, exactly its bytes
    assert rt.locked[scale.data_ptr()] == 2 * 3 * 700 * 4 and rt.registered == 2


def test_small_tensors_and_a_refusing_runtime_leave_the_work_to_torch(caplog):
    rt = FakeRuntime()
    assert pool_of(rt, min_bytes=4096).empty((10, 10), torch.float32) is None and not rt.locked
    refusing = FakeRuntime(fail=True)
    pool = pool_of(refusing)
    with caplog.at_level("INFO"):
        assert pool.empty((1000, 10), torch.float32) is None
    assert any("page-locking host memory failed" in r.message for r in caplog.records)
    assert pool.empty((1000, 10), torch.float32) is None and pool.held_bytes == 0  # asked once only


def test_idle_free_buffers_of_another_size_go_before_new_memory_is_locked(monkeypatch):
    rt = FakeRuntime()
    pool = pool_of(rt)
    a = pool.empty((4000,), torch.uint8)
    b = pool.empty((4000,), torch.uint8)
    pool.release(a)
    pool.empty((5000,), torch.uint8)  # a was released just now: another engine may be about to take it, it stays
    assert sorted(rt.locked.values()) == [4000, 4000, 5000]
    monkeypatch.setattr(pinned_pool, "STALE_S", -1.0)  # as if a had been idle for longer than STALE_S
    pool.empty((6000,), torch.uint8)  # a (free, idle) is unregistered first; b (in use) stays
    assert sorted(rt.locked.values()) == [4000, 5000, 6000] and b.data_ptr() in rt.locked
    pool.release(b)
    pool.release(b)  # twice: nothing more happens
    pool.release(torch.zeros(4000, dtype=torch.uint8))  # not the pool's: nothing happens
    assert pool.free_bytes == 4000


def test_a_slightly_larger_free_buffer_serves_a_request():
    """Token lists change length a little from one anchor to the next: a free buffer up to 1/16 larger is reused
    (the smallest that fits), a larger one is not."""
    rt = FakeRuntime()
    pool = pool_of(rt)
    big, near = pool.empty((2000, 4), torch.uint8), pool.empty((1050, 4), torch.uint8)
    pool.release(big), pool.release(near)
    t = pool.empty((1000,), torch.int32)  # 4000 bytes: near (4200) fits, big (8000) is too large
    assert t.data_ptr() == near.data_ptr() and t.shape == (1000,) and t.dtype == torch.int32 and rt.registered == 2
    t.fill_(-1)
    assert pool.free_bytes == 8000 and pool.held_bytes == 12200


def test_trim_frees_what_a_whole_run_did_not_use():
    rt = FakeRuntime()
    pool = pool_of(rt)
    kept, idle = pool.empty((3000,), torch.uint8), pool.empty((2000,), torch.uint8)
    pool.release(kept), pool.release(idle)
    run = time.monotonic()  # the next run starts
    reused = pool.empty((3000,), torch.uint8)
    assert reused.data_ptr() == kept.data_ptr()
    pool.release(reused)
    assert pool.trim(since=run) == 2000 and list(rt.locked.values()) == [3000]  # the idle buffer goes
    assert pool.trim(since=time.monotonic()) == 3000 and not rt.locked


def test_engines_of_several_devices_keep_each_others_buffers_across_runs(monkeypatch):
    """Two caches (one engine per GPU) share the pool and end their runs one after the other: after the first run
    nothing is page-locked again."""
    gc.collect()  # caches of earlier tests are collected now, not in the middle of this one
    rt = FakeRuntime()
    pool = pool_of(rt)
    monkeypatch.setattr(cache_mod, "POOL", pool)
    monkeypatch.setattr(cache_mod, "host_memory", lambda: None)
    monkeypatch.setattr(Entry, "pinned", fake_pinned(pool))
    caches = [SelectionCache(device_budget=0, cpu_budget=1 << 30, offload=True) for _ in range(2)]
    counts = []
    for run in range(3):
        for i, cache in enumerate(caches):
            for layer in range(3):
                assert cache.put((layer, True, (), 4096), cache_entry(10 * run + 3 * i + layer, 0.1)) == "cpu"
        for cache in caches:
            cache.clear()
        counts.append(rt.registered)
    assert counts[0] == counts[1] == counts[2] > 0 and pool.free_bytes == pool.held_bytes


def fake_pinned(pool):
    """Entry.pinned with the pool's buffers (on the CPU, Entry.pinned copies plainly)."""
    def pinned(self, owner=None):
        def cp(t):
            c = pool.empty(t.shape, t.dtype)
            return t.detach().clone() if c is None else c.copy_(t)
        return self.map(cp)
    return pinned


@pytest.fixture
def pooled_cache(monkeypatch):
    """A SelectionCache module whose host copies come from a fake-locked pool."""
    gc.collect()  # caches of earlier tests are collected now, not in the middle of this one
    rt = FakeRuntime()
    pool = pool_of(rt)
    monkeypatch.setattr(cache_mod, "POOL", pool)
    monkeypatch.setattr(cache_mod, "host_memory", lambda: None)
    monkeypatch.setattr(Entry, "pinned", fake_pinned(pool))
    return pool, rt


def test_the_cache_gives_back_the_buffers_of_every_host_entry_it_forgets(pooled_cache):
    pool, rt = pooled_cache
    a, b = cache_entry(0, 0.30), cache_entry(1, 0.01)
    res_bytes = a.residual.nbytes
    cache = SelectionCache(device_budget=0, cpu_budget=a.nbytes + b.nbytes + 10, offload=True)
    assert cache.put((3, True, (), 4096), a) == "cpu" and cache.put((7, True, (), 4096), b) == "cpu"
    stored = cache.on_cpu[(3, True, (), 4096)]
    assert pool.owns(stored.residual.data) and torch.equal(stored.residual.data, a.residual.data)
    # a later anchor of the same layer: the old entry's buffers are recycled for the new one, data exact
    a2 = cache_entry(2, 0.30)
    assert cache.put((3, True, (), 4096), a2) == "cpu"
    assert cache.on_cpu[(3, True, (), 4096)].residual.data.data_ptr() == stored.residual.data.data_ptr()
    assert torch.equal(cache.get((3, True, (), 4096), "cpu").residual.data, a2.residual.data)
    # a more important newcomer takes the lesser residual's room: that residual's buffer is free again
    cache.cpu_budget = a.nbytes + b.selection.nbytes + a.nbytes // 2
    assert cache.put((9, True, (), 4096), cache_entry(3, 0.50)) == "cpu"
    assert cache.on_cpu[(7, True, (), 4096)].residual is None and cache.on_cpu[(3, True, (), 4096)].residual is None
    assert pool.owns(cache.on_cpu[(9, True, (), 4096)].residual.data)
    in_use = pool.held_bytes - pool.free_bytes
    assert in_use == sum(t.numel() * t.element_size() for e in cache.on_cpu.values()
                         for t in cache_mod._tensors(e) if pool.owns(t))
    cache.drop((9, True, (), 4096))
    cache.clear()  # end of the run: everything back, kept for the next run
    assert pool.free_bytes == pool.held_bytes > 0 and res_bytes in rt.locked.values()
    cache.put((3, True, (), 4096), cache_entry(4, 0.30))
    cache.clear()
    cache.clear()  # the next run's start: nothing stored since, nothing trimmed
    assert res_bytes in rt.locked.values()


def test_a_cache_dropped_without_clear_gives_its_buffers_back(pooled_cache):
    """Its patched model deleted: the buffers come back and the pool unlocks what is free."""
    pool, rt = pooled_cache
    cache = SelectionCache(device_budget=0, cpu_budget=1 << 30, offload=True)
    cache.put((0, True, (), 4096), cache_entry(0, 0.1))
    assert 0 < pool.held_bytes and pool.free_bytes == 0
    del cache
    gc.collect()
    assert pool.held_bytes == 0 and not rt.locked


def test_a_collected_cache_frees_only_the_buffers_it_released(pooled_cache):
    """Another model's cache keeps its buffers for its next run, and one it holds stays held: deleting the first
    model frees only what the first cache released last."""
    pool, rt = pooled_cache
    gone = SelectionCache(device_budget=0, cpu_budget=1 << 30, offload=True)
    kept = SelectionCache(device_budget=0, cpu_budget=1 << 30, offload=True)
    gone.put((0, True, (), 4096), cache_entry(0, 0.1))
    kept.put((0, True, (), 2048), cache_entry(1, 0.1))
    kept.put((1, True, (), 2048), cache_entry(2, 0.1))
    gone.clear()  # both runs ended; the buffers stay for the next runs
    kept.drop((1, True, (), 2048))
    kept_free = pool.free_bytes - sum(t.nbytes for t in cache_mod._tensors(cache_entry(0, 0.1)) if t.nbytes >= 1024)
    held = [t for t in cache_mod._tensors(kept.on_cpu[(0, True, (), 2048)]) if pool.owns(t)]
    assert held and kept_free > 0
    locked_before = dict(rt.locked)
    del gone
    gc.collect()
    assert pool.free_bytes == kept_free  # the other cache's free buffers are still page-locked
    assert all(pool.owns(t) for t in held) and len(rt.locked) < len(locked_before)
    kept.clear()
    del kept
    gc.collect()
    assert pool.held_bytes == 0 and not rt.locked


def test_a_finalizer_inside_the_pools_own_call_never_waits_for_its_lock():
    """The garbage collector can run a collected cache's finalizer inside one of the pool's calls on the same
    thread, with the pool's lock held there: the buffers are given back at the pool's next call instead of the
    thread waiting on itself for ever."""
    rt = FakeRuntime()
    pool = pool_of(rt)
    t, other = pool.empty((3000,), torch.uint8), pool.empty((2000,), torch.uint8)
    pool.release(other, owner=object())  # another cache's, kept for its next run
    with pool._lock:  # inside the pool's critical section
        pool.forget([t], object())  # returns at once
        assert len(rt.locked) == 2
    assert pool.held_bytes == 2000 and list(rt.locked.values()) == [2000]  # done at the next call


def test_work_a_finalizer_queued_during_a_call_is_done_when_that_call_ends():
    """A finalizer run inside the pool's last call of a run (nothing may call the pool for a long time after): the
    dead cache's buffers are freed as that call releases the lock, not at some later run."""
    rt = FakeRuntime()
    pool = pool_of(rt)
    dead = pool.empty((3000,), torch.uint8)
    token = object()
    pool.release(dead, owner=token)
    register = rt.register

    def register_and_collect(ptr, nbytes):  # the garbage collector runs a finalizer inside empty()
        pool.forget([], token)
        return register(ptr, nbytes)
    rt.register = register_and_collect
    pool._register = register_and_collect
    kept = pool.empty((5000,), torch.uint8)
    assert list(rt.locked.values()) == [5000] and pool.owns(kept)  # the dead cache's 3000 bytes: freed already
    with pytest.raises(ValueError, match="token"):
        pool.forget([], None)  # None would match every buffer released without an owner


def test_a_cache_frees_at_once_the_buffers_it_released():
    """free_released (a cache short of host room that packs its residuals to 4 bits, engine/cache.py): the free
    buffers that cache released go now, not those of another cache, nor buffers in use."""
    rt = FakeRuntime()
    pool = pool_of(rt)
    mine, theirs = object(), object()
    a, b, c = (pool.empty((4096,), torch.uint8) for _ in range(3))
    pool.release(a, owner=mine)
    pool.release(b, owner=theirs)
    assert pool.free_bytes == 8192 and len(rt.locked) == 3
    assert pool.free_released(mine) == 4096
    assert a.data_ptr() not in rt.locked and b.data_ptr() in rt.locked and c.data_ptr() in rt.locked
    assert pool.free_bytes == 4096 and pool.held_bytes == 8192
    with pytest.raises(ValueError, match="token"):
        pool.free_released(None)


def test_freeing_released_buffers_spares_one_for_each_size_asked_for_next():
    """free_released(keep=...): for each byte count the caller asks for next, the smallest free buffer of that cache
    that serves it stays (one per count); the others of that cache go."""
    rt = FakeRuntime()
    pool = pool_of(rt)
    mine = object()
    bufs = [pool.empty((n,), torch.uint8) for n in (4096, 4096, 4200, 8192)]
    for b in bufs:
        pool.release(b, owner=mine)
    assert pool.free_released(mine, keep=[4096, 100_000]) == 4096 + 4200 + 8192  # one 4096 stays, nothing fits 1e5
    assert list(rt.locked.values()) == [4096]
    again = pool.empty((4096,), torch.uint8)
    assert rt.registered == 4 and rt.locked == {again.data_ptr(): 4096}  # taken, not page-locked anew


def test_a_later_anchor_stores_its_packed_residual_in_the_buffers_of_the_one_it_replaces(pooled_cache):
    """A host cache with room for a layer's residual at 4 bits only (residual_precision "auto"): every anchor packs
    the layer's newcomer. The second anchor's entry takes the buffers the first one's leaves, instead of page-locking
    new memory (the freed buffers of the sizes packing changed still go)."""
    pool, rt = pooled_cache
    key = (3, True, (), 4096)
    first, second = (Entry(cache_entry(i, 0.3).selection, Residual.encode(torch.randn(1, 2, 4096, 64), "fp8"),
                           importance=0.3) for i in (0, 1))
    packed_bytes = first.nbytes - first.residual.packing_frees
    cache = SelectionCache(device_budget=0, cpu_budget=packed_bytes + 100, offload=True, pack_when_short=True)
    assert cache.put(key, first) == "cpu" and cache.on_cpu[key].residual.packed
    held, registered = pool.held_bytes, rt.registered
    old_ptrs = sorted(t.data_ptr() for t in cache_mod._tensors(cache.on_cpu[key]) if pool.owns(t))
    assert len(old_ptrs) >= 2 and pool.free_bytes == 0  # the packed codes among them; the fp8 copy was never stored
    assert cache.put(key, second) == "cpu" and cache.on_cpu[key].residual.packed
    assert rt.registered == registered and pool.held_bytes == held  # nothing page-locked anew
    assert sorted(t.data_ptr() for t in cache_mod._tensors(cache.on_cpu[key]) if pool.owns(t)) == old_ptrs
    assert torch.equal(cache.on_cpu[key].residual.data, second.residual.pack().data)


def test_a_request_is_cut_from_a_larger_free_buffer_and_the_parts_join_again():
    """No free buffer of the size asked for: the smallest free one at most SPLIT_MAX times larger gives its front,
    the rest stays free in the same page-locked region; released parts join, and the region is freed whole."""
    rt = FakeRuntime()
    pool = pool_of(rt)
    big = pool.empty((16384,), torch.uint8)
    region = big.data_ptr()
    pool.release(big)
    a = pool.empty((2000,), torch.float32)  # 8000 bytes: cut from the front
    assert a.data_ptr() == region and rt.registered == 1 and pool.held_bytes == 16384
    assert pool.free_bytes == 16384 - 8000
    b = pool.empty((8192,), torch.uint8)  # the rest (8384 bytes) serves the next request whole
    assert b.data_ptr() == region + 8000 and rt.registered == 1 and pool.free_bytes == 0
    a.fill_(1.5), b.fill_(7)  # the parts do not overlap
    assert torch.all(a == 1.5) and torch.all(b == 7)
    pool.release(b)
    assert pool.trim(since=time.monotonic()) == 0 and rt.locked == {region: 16384}  # a is in use: the region stays
    pool.release(a)
    assert pool.free_bytes == 16384
    whole = pool.empty((16384,), torch.uint8)  # joined again: the whole region serves a whole request
    assert whole.data_ptr() == region and rt.registered == 1
    pool.release(whole)
    assert pool.trim(since=time.monotonic()) == 16384 and not rt.locked


@pytest.mark.parametrize("order", [(0, 2, 1), (1, 0, 2), (2, 1, 0), (1, 2, 0)])
def test_three_parts_join_whatever_order_they_are_released_in(order):
    """A region cut in three: its parts join with the free neighbours before and after them as they are released, the
    parts still in use keep their bytes, and once all three are free the region is one buffer again."""
    rt = FakeRuntime()
    pool = pool_of(rt)
    pool.release(pool.empty((3 * 4096,), torch.uint8))
    parts = [pool.empty((4096,), torch.uint8) for _ in range(3)]  # 12288 -> 4096 + 8192 -> 4096 + 4096 + 4096
    assert rt.registered == 1 and sorted(p.data_ptr() for p in parts) == [parts[0].data_ptr() + i * 4096
                                                                           for i in range(3)]
    for i, p in enumerate(parts):
        p.fill_(i + 1)
    for n, i in enumerate(order):
        pool.release(parts[i])
        for j in order[n + 1:]:
            assert torch.all(parts[j] == j + 1)
        assert pool.free_bytes == (n + 1) * 4096
    assert len(pool._buffers) == 1 and pool.empty((3 * 4096,), torch.uint8).data_ptr() == parts[0].data_ptr()


def test_both_halves_of_a_buffer_twice_a_request_serve_it_for_odd_sizes():
    """A request of P bytes, P not a multiple of a page (a packed residual's B x H x N x D/2 for most token counts),
    cut twice from a free buffer of 2P: both halves serve it, nothing is page-locked anew, nothing stays free."""
    rt = FakeRuntime()
    pool = pool_of(rt)
    p = 10 * 4096 + 2048 + 16
    pool.release(pool.empty((2 * p,), torch.uint8))
    first, second = pool.empty((p,), torch.uint8), pool.empty((p,), torch.uint8)
    assert rt.registered == 1 and pool.free_bytes == 0 and second.data_ptr() == first.data_ptr() + p


def test_a_region_two_caches_released_is_freed_once_both_are_gone():
    """A cut region whose parts two caches released: neither cache's finalizer frees it while the other may take it
    again; once both are gone, it goes (nothing stays page-locked for models that are gone)."""
    rt = FakeRuntime()
    pool = pool_of(rt)
    high, low = object(), object()
    f = pool.empty((8192,), torch.uint8)
    pool.release(f, owner=high)
    part = pool.empty((4096,), torch.uint8)  # cut from high's free buffer
    pool.forget([part], low)  # low is gone: the region is high's and low's, and high may run again
    assert pool.held_bytes == 8192 and pool.free_bytes == 8192
    assert pool.free_released(high) == 8192 and not rt.locked  # high frees it: the other owner is gone
    g = pool.empty((8192,), torch.uint8)
    pool.release(g, owner=high)
    pool.forget([pool.empty((4096,), torch.uint8)], low)
    pool.forget([], high)
    assert pool.held_bytes == 0 and not rt.locked and not pool._gone


def test_small_requests_do_not_carve_large_buffers():
    rt = FakeRuntime()
    pool = pool_of(rt)
    pool.release(pool.empty((40000,), torch.uint8))
    small = pool.empty((5000,), torch.uint8)  # 8x smaller than the free buffer: new memory, the large one stays whole
    assert rt.registered == 2 and pool.free_bytes == 40000 and pool.owns(small)


def test_freeing_released_buffers_spares_one_to_cut_the_next_request_from():
    """free_released(keep=...) where no free buffer fits a kept size whole: the one ``empty`` would cut it from
    stays (a residual packed to 4 bits takes half of the fp8 buffer the packing freed)."""
    rt = FakeRuntime()
    pool = pool_of(rt)
    mine = object()
    fp8 = [pool.empty((8192,), torch.uint8) for _ in range(2)]
    for t in fp8:
        pool.release(t, owner=mine)
    assert pool.free_released(mine, keep=[4096]) == 8192 and pool.held_bytes == 8192
    half = pool.empty((4096,), torch.uint8)
    other = pool.empty((4096,), torch.uint8)
    assert rt.registered == 2 and pool.free_bytes == 0 and other.data_ptr() == half.data_ptr() + 4096


class FakeEvent:
    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


def test_freeing_released_buffers_spares_a_whole_region_before_a_free_part():
    """A free part of a region in use can never be freed, so it stays anyway: for the size asked for next, the whole
    free region that serves it (cut) is spared, and the part serves that request while the region serves the one
    after it."""
    rt = FakeRuntime()
    pool = pool_of(rt)
    me = object()
    a, b = pool.empty((8192,), torch.uint8), pool.empty((8192,), torch.uint8)
    pool.release(a, owner=me)
    used = pool.empty((4096,), torch.uint8)  # a = [used | free part of 4096]
    pool.release(b, owner=me)  # b: a whole free region
    assert pool.free_released(me, keep=[4096]) == 0 and pool.held_bytes == 16384
    first, second, third = (pool.empty((4096,), torch.uint8) for _ in range(3))
    assert rt.registered == 2 and pool.free_bytes == 0 and used.data_ptr() == a.data_ptr()


def test_the_first_anchor_that_packs_takes_the_halves_of_the_fp8_buffers_it_frees(pooled_cache, monkeypatch):
    """A host cache with room for six residuals at 4 bits but only three at fp8 (residual_precision "auto"), six
    layers stored at one anchor: the fourth layer on packs the stored ones and itself. Each packed residual takes
    half of an fp8 buffer the packing freed, so only the first packing page-locks memory of the packed size; no two
    stored tensors share bytes, and every stored residual holds its own data."""
    pool, rt = pooled_cache
    sizes = []
    register = pool._register

    def recording(ptr, nbytes):
        sizes.append(nbytes)
        return register(ptr, nbytes)

    pool._register = recording
    unregister = pool._unregister
    unregistered = []
    pool._unregister = lambda ptr: unregistered.append(ptr) or unregister(ptr)
    entries = [Entry(cache_entry(i, 0.3).selection, Residual.encode(torch.randn(1, 2, 4096, 64), "fp8"),
                     importance=0.3) for i in range(6)]
    for e in entries:  # the mass rows of a later anchor: packed to fp16 about each head's median
        e.residual.mass = torch.stack((20 + torch.randn(1, 2, 4096), -5 * torch.rand(1, 2, 4096)), -1)
    fp8_bytes, packed_bytes = entries[0].residual.data.nbytes, entries[0].residual.data.nbytes // 2
    scale_bytes = entries[0].residual.scale.nbytes  # fp32; packed: bf16, half
    mass_bytes = entries[0].residual.mass.nbytes  # fp32; packed: fp16, half
    room = sum(e.nbytes for e in entries) - 6 * entries[0].residual.packing_frees + 100
    assert 3 * entries[0].nbytes < room < 4 * entries[0].nbytes  # three fp8 entries fit, four do not
    cache = SelectionCache(device_budget=0, cpu_budget=room, offload=True, pack_when_short=True)
    cache._cuda_device = torch.device("cpu")  # stored host residuals are packed into the pool's buffers, as on a GPU
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "stream")  # releases record (fake) events
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    for i, e in enumerate(entries):
        assert cache.put((i, True, (), 4096), e) == "cpu"
    stored = [cache.on_cpu[(i, True, (), 4096)] for i in range(6)]
    assert all(s.residual.packed for s in stored) and cache.counters["residual_dropped"] == 0
    for s, e in zip(stored, entries):
        want = e.residual.pack()
        assert torch.equal(s.residual.data, want.data) and torch.equal(s.residual.scale, want.scale)
        assert torch.equal(s.residual.unpacked().mass, want.unpacked().mass)
    # the packed data, bf16 scales and fp16 masses come from the fp8 data's and the fp32 scales' and masses' buffers;
    # nothing is freed during the anchor (freeing waits for the copies still reading a buffer)
    assert sizes.count(fp8_bytes) == 3 and sizes.count(packed_bytes) <= 1 and sizes.count(scale_bytes // 2) <= 1
    assert sizes.count(mass_bytes) == 3  # (a packed mass has the fp32 scale's size: the count below holds both)
    assert not unregistered
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for s in stored for t in cache_mod._tensors(s))
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
    # page-locked: three fp8 entries (data, scale, mass, selection), the first packing's data, scale and mass, three
    # more selections
    assert len(sizes) == 3 * 4 + 3 + 3 and pool.held_bytes == sum(sizes)
