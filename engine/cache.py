"""Selection/residual cache with a GPU memory budget, CPU offload and prefetch on a side stream.

Entries are keyed by (layer, self/cross, batch chunk, token count). ComfyUI batches cond and uncond into
one call when memory allows and splits them when it runs low, so a chunk's rows are also read from an
entry of a larger chunk that holds them (its batch rows, as views), and a batched call whose conds anchored
as separate calls reuses their entries part by part (engine/engine.py, ``_reuse_parts``). An entry that does not fit the
device budget lives in (pinned) CPU memory and is copied back when used; the copy for the key expected
next (the order of the previous step) is started early on a side stream so it overlaps compute. When room
runs out, the residuals of the lowest priority are dropped and their selections kept (``put``); an entry whose
selection fits nowhere is not stored: the key is remembered as a fallback and counted. ``clear()`` frees
everything (end of a run).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .pinned_pool import POOL
from .residual import Residual

log = logging.getLogger(__name__)


@dataclass
class Entry:
    """A cached selection (BlockSelection | TokenSelection) and its Residual (engine/residual.py) or None."""

    selection: object
    residual: Residual | None
    ready: object = None  # CUDA event after an asynchronous copy into this (CPU) entry, or None
    importance: float | torch.Tensor = 0.0  # priority of keeping the residual (read as ``priority``): when room
    # runs out, the residuals of the least important entries are dropped first (their layers run dense at reuse
    # steps). The engine sets minus the anchor's relative error without the residual: the layers furthest from dense
    # go dense first (engine.cache_entry)
    replay: object = field(default=None, repr=False, compare=False)  # the reuse calls' kernels.CallReplay, made by
    # the engine for a device entry; it holds views of this entry's tensors, so it lives and dies with the entry

    @property
    def priority(self) -> float:
        """``importance`` as a float. The engine hands it over as a 0-d tensor on the device (an anchor does not wait
        for the device to read it); it is read here, once, when the cache first has to rank residuals."""
        if isinstance(self.importance, torch.Tensor):
            self.importance = float(self.importance)
        return self.importance

    def wait(self) -> "Entry":
        """This entry once its asynchronous copy has landed (for readers on the host)."""
        if self.ready is not None:
            self.ready.synchronize()
        return self

    @property
    def nbytes(self) -> int:
        return self.selection.nbytes + (0 if self.residual is None else self.residual.nbytes)

    @property
    def host_nbytes(self) -> int:
        """Its bytes in host memory (``pinned``: the selection's lists narrower)."""
        return self.selection.host_nbytes + (0 if self.residual is None else self.residual.nbytes)

    @property
    def device_nbytes(self) -> int:
        """Its bytes once ``to`` a device (a host entry's int16 block lists widen to int32 there)."""
        return self.selection.device_nbytes + (0 if self.residual is None else self.residual.nbytes)

    def host_tensor_nbytes(self) -> list[int]:
        """The bytes of each host buffer ``pinned`` asks for (the selection's lists in their host form)."""
        res = [] if self.residual is None else [t.numel() * t.element_size() for t in self.residual.tensors()]
        return self.selection.host_tensor_nbytes() + res

    def on_host(self, size: int) -> int:
        """``size`` bytes of this entry (all of it, or with its residual packed) as host memory holds them."""
        return size - (self.nbytes - self.host_nbytes)

    def map(self, fn) -> "Entry":
        return Entry(self.selection.map(fn), None if self.residual is None else self.residual.map(fn),
                     importance=self.importance)

    def fits(self, q: torch.Tensor) -> bool:
        """Whether this entry can serve a call with q (B, H, N, D): the same batch size, head count and device
        (the key holds only the layer, the chunk and the token count)."""
        counts = self.selection.kv_counts
        if tuple(counts.shape[:2]) != tuple(q.shape[:2]) or counts.device != q.device:
            return False
        return self.residual is None or tuple(self.residual.shape) == tuple(q.shape)

    @property
    def batch(self) -> int:
        return int(self.selection.tensors()[0].shape[0])

    def batch_slice(self, start: int, stop: int) -> "Entry":
        """Batch rows [start, stop) of the selection and residual (views)."""
        return Entry(self.selection.batch_slice(start, stop),
                     None if self.residual is None else self.residual.batch_slice(start, stop),
                     importance=self.importance)

    def to(self, device, non_blocking=False) -> "Entry":
        """A copy on ``device`` with the selection as the kernels take it (a host entry's lists are narrower:
        ``pinned``)."""
        out = self.map(lambda t: t.to(device, non_blocking=non_blocking))
        out.selection = out.selection.device_form()
        return out

    def pinned(self, owner=None) -> "Entry":
        """A CPU copy, in pinned memory when CUDA is present (so copies back can be asynchronous). ``owner``: the
        caching cache's pool token (buffers given back after a failed copy are its, engine/pinned_pool.py).

        A CUDA tensor is copied straight into a page-locked buffer, asynchronously on the current stream (no
        pageable bounce buffer, no host wait; later readers are ordered after it by the stream). The selection is
        copied in its host form (a block selection's lists as int16: half their bytes; ``to`` widens them again)."""
        taken = []
        src = Entry(self.selection.host_form(), self.residual, importance=self.importance)

        def cp(t):
            if t.is_cuda:  # large tensors in exact-size page-locked buffers (engine/pinned_pool.py), others in torch's
                c = _host_buffer(t.shape, t.dtype, t.device, taken)
                return c.copy_(t.detach(), non_blocking=True)
            c = t.detach().to("cpu", copy=True)
            return c.pin_memory() if torch.cuda.is_available() else c
        try:
            out = src.map(cp)
        except BaseException:  # host memory ran out midway: the buffers already taken are nobody's; their copies,
            # issued on the device's current stream, finish before the pool writes or unregisters them
            if taken:  # pool buffers are taken for CUDA tensors only; an entry's tensors share one device
                stream = torch.cuda.current_stream(next(t.device for t in _tensors(self) if t.is_cuda))
                for c in taken:
                    POOL.release(c, [stream], owner=owner)
            raise
        if any(t.is_cuda for t in _tensors(self)):
            out.ready = torch.cuda.Event()
            out.ready.record()
        return out


AUTO_RESERVE_BYTES = 8 << 30  # "auto" leaves at least this much of the card free for the model ...
AUTO_RESERVE_SHARE = 0.25  # ... or this share of it, whichever is larger (an mc_sparse anchor at 119k
# tokens needs ~25 GB of scratch next to the model's activations: docs/benchmarks.md)
AUTO_MAX_SHARE = 0.5  # and never holds more than this share of the card
AUTO_NON_CUDA_BYTES = 8 << 30  # "auto" on devices without a memory query
HOST_RESERVE_BYTES = 8 << 30  # the CPU side leaves at least this much host memory available ...
HOST_RESERVE_SHARE = 0.25  # ... or this share of it (pinned pages cannot be swapped: a full host is killed)
SELECTION_SLACK = 0.1  # a selection stored without its residual may take host memory up to this share past
# cpu_budget, so that a cap filled to the byte by residuals still takes the other layers' block lists (~1 % of a
# residual). The engine runs such a layer dense at reuse steps (its residual carries the picture) and anchors it again
# at the next anchor step; without a stored entry the layer would fall back to dense for the rest of the run
# (docs/benchmarks.md, "The small-VRAM preset on a 16 GB card")


DeviceProbe = "Callable[[torch.device], tuple[int, int] | None]"
_device_probe = None  # set by nodes/ to ComfyUI's memory manager's view (nodes/memory.py)


def set_device_probe(probe) -> None:
    """Install ``probe(device) -> (free_bytes, usable_total_bytes) | None``: the memory the cache may plan
    with. ComfyUI's view (free memory beyond what --reserve-vram keeps for other programs) replaces the
    driver's, so the cache never takes room ComfyUI counts on for the model. None restores the driver's view."""
    global _device_probe
    _device_probe = probe


def device_memory(dev: torch.device) -> tuple[int, int]:
    """(free, total) bytes the cache plans with on a CUDA device: the installed probe's view, else the driver's
    free memory plus PyTorch's own free pool."""
    if _device_probe is not None:
        try:
            seen = _device_probe(dev)
        except Exception as exc:  # noqa: BLE001 - a memory manager that cannot answer: the driver's view
            log.debug("sparse attention: memory probe failed (%s)", exc)
            seen = None
        if seen is not None:
            return int(seen[0]), int(seen[1])
    free, total = torch.cuda.mem_get_info(dev)
    free += torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)  # PyTorch's own free pool
    return free, total


def cached_pinned_bytes() -> int:
    """Pinned host memory that torch's host allocator holds but nothing uses (0 where unknown)."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None or not torch.cuda.is_available():
        return 0
    try:
        st = stats()
        return max(0, int(st.get("allocated_bytes.current", 0)) - int(st.get("active_bytes.current", 0)))
    except Exception:  # noqa: BLE001 - an older torch without these counters
        return 0


def host_memory() -> tuple[int, int] | None:
    """(available, total) bytes of host memory (Linux /proc/meminfo, else psutil), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:2]}
        return info["MemAvailable"], info["MemTotal"]
    except (OSError, KeyError, ValueError, IndexError):
        pass
    try:
        import psutil
        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)
    except Exception:  # noqa: BLE001 - no psutil, or a platform it cannot read
        return None


class SelectionCache:
    """Budgeted store of Entries. Budgets in bytes; ``offload`` allows CPU residency.

    ``device_budget=None`` ("auto"): an entry goes on the device when, after it, the card keeps
    max(8 GiB, 25 %) of its memory free (free as the driver reports it plus PyTorch's cached free blocks;
    the reserve is the room the model's own activations keep) and the cache holds at most half the card.
    """

    def __init__(self, device_budget: int | None, cpu_budget: int, offload: bool, pack_when_short: bool = False):
        """pack_when_short: a residual that finds no room is packed to 4 bits (engine/residual.py) and tried again
        before any residual is dropped (SparseConfig.residual_precision "auto")."""
        self.device_budget = None if device_budget is None else int(device_budget)
        self.pack_when_short = pack_when_short
        self.cpu_budget = int(cpu_budget)
        self.offload = offload
        self.on_device: OrderedDict[tuple, Entry] = OrderedDict()
        self.on_cpu: dict[tuple, Entry] = {}
        self.fallback_keys: set[tuple] = set()
        self.prefetched: dict[tuple, tuple[Entry, object]] = {}
        self.order_prev: list[tuple] = []
        self.order_now: list[tuple] = []
        self.counters = dict(offloaded=0, fetched=0, prefetched=0, fallbacks=0, residual_dropped=0, residual_packed=0,
                             spills=0, pool_trims=0)  # pool_trims: the engine's (engine/device_pool.py PoolWatch)
        self.peak_device = 0
        self.peak_cpu = 0
        self.auto_limit: int | None = None
        self.dropped_layers: set = set()  # layers whose residual was dropped for lack of room (this run)
        self.dropped_logged = False
        self.packed_layers: set = set()  # layers whose residual was packed to 4 bits for lack of room (this run)
        self.prefetch_off = False  # after an out-of-memory error: one entry on the device at a time (this run)
        self._stream = None
        self._cuda_device: torch.device | None = None  # the device whose entries went to host memory
        self._host_used: float | None = None  # when the first host entry since the last clear was stored
        # (time.monotonic); the pinned pool frees at clear what was not used since. A cache dropped without clear
        # gives its host entries' buffers back when it is collected.
        self._pool_token = object()  # names this cache to the pool (release, forget) without keeping it
        weakref.finalize(self, _release_all, self.on_cpu, self._pool_token).atexit = False  # at exit the process
        # frees it all

    # sizes
    @property
    def device_bytes(self) -> int:
        return sum(e.nbytes for e in self.on_device.values())

    @property
    def cpu_bytes(self) -> int:
        return sum(e.nbytes for e in self.on_cpu.values())

    def peek(self, key: tuple) -> Entry | None:
        """The stored entry under exactly ``key`` wherever it lives, for reading on the host (no copy to
        the device, no effect on prefetch order), or None."""
        entry = self.on_device.get(key) or self.on_cpu.get(key)
        return None if entry is None else entry.wait()

    def __contains__(self, key) -> bool:
        return key in self.on_device or key in self.on_cpu

    def lookup(self, key: tuple) -> tuple | None:
        """Where ``key``'s entry is: (key, None) when stored under it; (source key, (first, count, of))
        when the stored entry of a larger chunk ``source`` holds this chunk's rows (its conds
        ``first .. first+count-1`` of ``of``); None when nothing holds it. Keys: (layer, is_self, chunk, n)."""
        if key in self:
            return key, None
        found = self._covering(key)
        return found[0] if found else None

    def _covering(self, key: tuple) -> list:
        """The stored entries of larger chunks that hold ``key``'s rows: [(source key, (first, count, of))]. A
        chunk is its conds in batch order, then what makes it another forward (a context window, a guidance pass;
        nodes/forward.py, ``chunk_of``): the conds must appear in a row of the source's and everything after them
        must be the same (a guidance pass never reads the cond pass's rows)."""
        out = []
        for src in list(self.on_device) + list(self.on_cpu):
            part = rows_of(src, key)
            if part is not None:
                out.append((src, part))
        return out

    def covered(self, key: tuple) -> list:
        """The stored keys of smaller chunks whose rows ``key``'s chunk holds (the inverse of ``_covering``)."""
        return [src for src in list(self.on_device) + list(self.on_cpu) if rows_of(key, src) is not None]

    def put(self, key: tuple, entry: Entry) -> str:
        """Store an entry; returns where it went: "device", "cpu", "device-no-residual", "cpu-no-residual", or
        "none". Entries of larger chunks that held this chunk's rows, and of smaller chunks whose rows this chunk
        holds, are dropped (they are older). When the residual finds no room and none less important can give way,
        the selection alone is kept, on the device or else in host memory up to SELECTION_SLACK past
        ``cpu_budget`` (the host reserve still holds; block lists are ~1 % of a residual). The engine runs that
        layer dense at reuse steps and anchors it again at the next anchor step, where an entry not stored at all
        would make it fall back for the whole run (docs/decisions.md, "Small cards")."""
        self.drop(key)
        for src, _ in self._covering(key):
            self.drop(src)
        for src in self.covered(key):  # split calls' entries, superseded by this batched anchor: the split calls
            self.drop(src)  # read its rows from now on, and a stale entry under their own key would win the lookup
        size = entry.nbytes
        if self._device_fits(size, entry):
            self.on_device[key] = entry
            where = "device"
        elif self._cpu_fits(entry.host_nbytes):
            self.on_cpu[key] = self._to_host(entry)
            self.counters["offloaded"] += 1
            where = "cpu"
        elif self.pack_when_short and entry.residual is not None and entry.residual.can_pack() and \
                (sides := self._packing_makes_room(size - entry.residual.packing_frees, entry)):
            # half the bytes for -0.05 dB on the testbed (docs/decisions.md, "Residuals at 4 bits"), where dropping
            # it would run the layer dense at its reuse steps; then the stored ones, if it still needs room
            entry = Entry(entry.selection, entry.residual.pack(), importance=entry.importance)
            self._pack_stored(entry.nbytes, entry, sides)
            # host buffers this cache freed (replaced or packed entries) are not of the sizes it asks for now, except
            # those of the packed entry this one replaces (a later anchor's): its buffers serve this one
            # (the sizes the host copy asks for: its block lists int16, not the device entry's int32)
            POOL.free_released(self._pool_token, keep=entry.host_tensor_nbytes())
            where = self.put(key, entry)
            if where in ("device", "cpu"):
                self._note_packed(key)
            return where
        elif self._make_room(size, entry):  # residuals that matter less than this one gave way
            return self.put(key, entry)
        elif entry.residual is not None and self._device_fits(entry.selection.nbytes, entry):
            self.on_device[key] = Entry(entry.selection, None, importance=entry.importance)
            self.counters["residual_dropped"] += 1
            self._note_dropped(key)
            where = "device-no-residual"
        elif self._keep_selection_on_host(key, entry):
            where = "cpu" if entry.residual is None else "cpu-no-residual"
        else:
            self.fallback_keys.add(key)
            self.counters["fallbacks"] += 1
            log.info("sparse attention: no cache room for %s (%.1f MB); this layer falls back", key[:2], size / 2**20)
            where = "none"
        self.peak_device = max(self.peak_device, self.device_bytes)
        self.peak_cpu = max(self.peak_cpu, self.cpu_bytes)
        if where != "none":  # an anchor step's stores are its accesses: the next step prefetches in their order
            self._note_access(key)
        return where

    def _store(self, where: str) -> OrderedDict:
        """The entries of one side: "device" or "cpu"."""
        return self.on_device if where == "device" else self.on_cpu

    def _residual_entries(self, keep) -> list:
        """[(importance, key, side)] of the stored entries with a residual for which ``keep(side, entry)`` holds,
        least important first (device entries before host ones at equal importance)."""
        return sorted(((e.priority, k, where) for where in ("device", "cpu")
                       for k, e in self._store(where).items() if e.residual is not None and keep(where, e)),
                      key=lambda t: t[0])

    def _make_room(self, size: int, entry: Entry) -> bool:
        """Drop the residuals of stored entries less important than ``entry`` (lower ``importance``; their selections
        stay) until ``size`` bytes fit on the device or the CPU side. False when nothing less important is left to
        drop (docs/decisions.md, "Small cards")."""
        if entry.residual is None:
            return False
        lesser = self._residual_entries(lambda where, e: e.priority < entry.priority)
        # drop nothing when dropping every lesser residual would still leave no room (they would be lost for nothing)
        gain = {where: sum(self._store(where)[k].residual.nbytes
                           for _, k, w in lesser if w == where) for where in ("device", "cpu")}
        host = entry.on_host(size)
        if not (self._device_fits(size - gain["device"], entry) or self._cpu_fits(host - gain["cpu"])):
            return False
        freed = False
        for _, k, where in lesser:
            store = self._store(where)
            old = store[k]
            store[k] = Entry(old.selection, None, importance=old.importance)
            if where == "cpu":
                self._release(old.residual.tensors())
            self.counters["residual_dropped"] += 1
            self._note_dropped(k)
            freed = True
            if self._device_fits(size, entry) or self._cpu_fits(host):
                return True
        return freed and (self._device_fits(size, entry) or self._cpu_fits(host))

    def _pack_stored(self, size: int, entry: Entry, sides: set) -> None:
        """Pack stored fp8 residuals to 4 bits on ``sides`` ("device", "cpu": where packing can make room), the least
        important first, until ``size`` bytes fit on one side (residual_precision "auto"): packing keeps a layer
        sparse where dropping its residual sends it dense, so residuals are packed before ``_make_room`` drops any,
        and only as many as it takes."""
        stored = self._residual_entries(lambda where, e: where in sides and e.residual.can_pack())
        host = entry.on_host(size)
        for _, k, where in stored:
            if self._device_fits(size, entry) or self._cpu_fits(host):
                return
            store = self._store(where)
            old = store[k].wait()
            store[k] = Entry(old.selection, self._packed(old.residual, host=where == "cpu"), importance=old.importance)
            del old  # the fp8 data goes now: the next fit check counts the room it leaves
            self._note_packed(k)

    def _packed(self, residual: Residual, host: bool) -> Residual:
        """``residual`` packed where it lies. A host one is packed on the GPU it came from (its bytes there and back,
        no pass of the host's CPU) into page-locked memory; its fp8 tensors' pooled buffers are given back."""
        if not host:
            return residual.pack()
        taken = []

        def empty(shape, dtype):
            return _host_buffer(shape, dtype, self._cuda_device, taken)
        try:
            res = residual.pack(work=self._cuda_device, empty=empty)  # its copies back to the host wait for the GPU
        except BaseException:  # e.g. out of GPU memory for the chunk: the buffers taken are nobody's
            for buf in taken:
                POOL.release(buf, owner=self._pool_token)
            raise
        self._release(residual.tensors())
        return res

    def _packing_makes_room(self, size: int, entry: Entry) -> set:
        """The sides ("device", "cpu") where ``size`` bytes of ``entry`` would fit once every stored fp8 residual
        there is packed and every residual less important than ``entry``'s dropped; empty when neither: its residual
        is then dropped anyway, and packing would lose precision for nothing."""
        gain = {"device": 0, "cpu": 0}
        for where in ("device", "cpu"):
            for e in self._store(where).values():
                if e.residual is not None and e.priority < entry.priority:
                    gain[where] += e.residual.nbytes
                elif e.residual is not None:
                    gain[where] += e.residual.packing_frees
        host = entry.on_host(size)
        return {where for where, fits in (("device", self._device_fits(size - gain["device"], entry)),
                                          ("cpu", self._cpu_fits(host - gain["cpu"]))) if fits}

    def _note_packed(self, key: tuple) -> None:
        if not self.packed_layers:
            log.info("sparse attention: no room for every residual at fp8: some are stored at 4 bits (the report "
                     "lists their layers)")
        self.counters["residual_packed"] += 1
        self.packed_layers.add(_layer_of(key))

    def _keep_selection_on_host(self, key: tuple, entry: Entry) -> bool:
        """Store ``entry``'s selection alone in host memory, up to SELECTION_SLACK past cpu_budget; its residual, if
        it has one, is dropped (counted, logged once, listed in the Report). False when even that does not fit."""
        if not self._cpu_fits(entry.selection.host_nbytes, SELECTION_SLACK):
            return False
        self.on_cpu[key] = self._to_host(Entry(entry.selection, None, importance=entry.importance))
        self.counters["offloaded"] += 1
        if entry.residual is not None:
            self.counters["residual_dropped"] += 1
            self._note_dropped(key)
        return True

    def _note_dropped(self, key: tuple) -> None:
        if not self.dropped_logged:
            self.dropped_logged = True
            log.warning("sparse attention: no room to keep every residual on the GPU or in host memory: the layers "
                        "whose residuals were dropped (the report lists them) run dense at reuse steps until their "
                        "next anchor; more host memory (cpu_budget_mb) keeps them sparse")
        self.dropped_layers.add(_layer_of(key))

    def _cpu_fits(self, size: int, slack: float = 0.0) -> bool:
        """Offload allowed, within cpu_budget times (1 + ``slack``), and the host keeps max(8 GiB, 25 %) of its
        memory available."""
        if not self.offload or self.cpu_bytes + size > self.cpu_budget * (1.0 + slack):
            return False
        host = host_memory()
        if host is None:
            return True
        available, total = host
        # pinned blocks freed to torch's host cache, and the pool's free buffers, are reused first
        available += cached_pinned_bytes() + POOL.free_bytes
        return available - size >= max(HOST_RESERVE_BYTES, int(HOST_RESERVE_SHARE * total))

    def _device_fits(self, size: int, entry: Entry, device: torch.device | None = None) -> bool:
        """Room for ``size`` more bytes of cache on ``device`` (default: where ``entry``'s tensors are)."""
        if self.device_budget is not None:
            return self.device_bytes + size <= self.device_budget
        if self.auto_limit is not None and self.device_bytes + size > self.auto_limit:
            return False
        dev = device if device is not None else next(iter(_tensors(entry))).device
        if dev.type != "cuda":
            return self.device_bytes + size <= AUTO_NON_CUDA_BYTES
        free, total = device_memory(dev)
        # a newcomer computed on this device already holds its bytes there, and the free memory no longer counts
        # them: storing it takes nothing more (counting them again made the room one entry smaller than it is)
        free += min(size, _resident_bytes(entry, dev))
        reserve = max(AUTO_RESERVE_BYTES, int(AUTO_RESERVE_SHARE * total))
        return free - size >= reserve and self.device_bytes + size <= AUTO_MAX_SHARE * total

    def get(self, key: tuple, device) -> Entry | None:
        """The entry on ``device`` (copied from CPU if it lives there; waits for its prefetch); for a chunk
        held by a larger chunk's entry, that entry's rows of this chunk."""
        found = self.lookup(key)
        if found is None:
            return None
        src, part = found
        entry = self._get(src, device)
        if part is None or entry is None:
            return entry
        first, count, of = part
        per = entry.batch // of
        return entry.batch_slice(first * per, (first + count) * per)

    def _get(self, key: tuple, device) -> Entry | None:
        self._note_access(key)
        if key in self.on_device:
            self.on_device.move_to_end(key)
            entry = self.on_device[key]
        elif key in self.on_cpu:
            pre = self.prefetched.pop(key, None)
            if pre is not None:
                entry, event = pre
                if event is not None:
                    torch.cuda.current_stream(device).wait_event(event)
                    for t in _tensors(entry):
                        t.record_stream(torch.cuda.current_stream(device))
            else:
                entry = self.on_cpu[key].to(device, non_blocking=True)
                self.counters["fetched"] += 1
        else:
            return None
        self._prefetch_next(key, device)
        return entry

    def spill(self, share: float = 1.0, stop_prefetch: bool = False) -> int:
        """Free device memory after an out-of-memory error: drop the prefetched copies of host entries (their host
        entries stay), then move the least recently used device entries, at least ``share`` of the device
        cache's bytes, to the CPU side (without room there for the whole entry, its selection alone as in ``put``;
        without room for that either, the entry is dropped and its layer anchors again). An "auto"
        budget then keeps at most what stayed on the device. ``stop_prefetch``: the rest of the run fetches each
        host entry when its call comes (a prefetch holds a second layer's entry on the device beside the one in
        use); for the model's own out-of-memory errors. Returns the bytes freed on the device."""
        target = share * self.device_bytes
        freed = sum(entry.nbytes for entry, _ in self.prefetched.values())
        self.prefetched.clear()
        self.prefetch_off = self.prefetch_off or stop_prefetch
        moved = 0
        for key in list(self.on_device):  # least recently used first
            if moved >= target and moved:
                break
            entry = self.on_device.pop(key)
            moved += entry.nbytes
            if self._cpu_fits(entry.host_nbytes):
                self.on_cpu[key] = self._to_host(entry)
                self.counters["offloaded"] += 1
            else:
                self._keep_selection_on_host(key, entry)
        self.counters["spills"] += 1
        self.auto_limit = self.device_bytes
        self.peak_cpu = max(self.peak_cpu, self.cpu_bytes)
        return freed + moved

    def drop(self, key: tuple) -> None:
        self.on_device.pop(key, None)
        old = self.on_cpu.pop(key, None)
        if old is not None:
            self._release(_tensors(old))
        self.prefetched.pop(key, None)

    def _to_host(self, entry: Entry) -> Entry:
        """``entry``'s host copy (Entry.pinned); remembers the device it came from, whose streams read it later."""
        tensors = _tensors(entry)
        if tensors and tensors[0].is_cuda:
            self._cuda_device = tensors[0].device
        if self._host_used is None:
            self._host_used = time.monotonic()
        return entry.pinned(self._pool_token)

    def _release(self, tensors) -> None:
        """Give a forgotten host entry's pooled buffers back (engine/pinned_pool.py): the copies already issued on
        this device's current stream and on the prefetch stream finish before a new owner writes them."""
        streams = []
        if self._cuda_device is not None:
            streams.append(torch.cuda.current_stream(self._cuda_device))
            if self._stream is not None:
                streams.append(self._stream)
        for t in tensors:
            POOL.release(t, streams, owner=self._pool_token)

    def new_step(self) -> None:
        """Called when the denoising step changes: the access order just seen predicts the next one."""
        if self.order_now:
            self.order_prev, self.order_now = self.order_now, []

    def clear(self) -> None:
        """Free every entry (end of run); the pinned pool keeps the buffers this run used for the next one."""
        self.on_device.clear()
        for entry in self.on_cpu.values():
            self._release(_tensors(entry))
        self.on_cpu.clear()
        if self._host_used is not None:  # the buffers this run did not use (engine/pinned_pool.py)
            POOL.trim(self._host_used)
            self._host_used = None
        self.prefetched.clear()
        self.fallback_keys.clear()
        self.order_prev, self.order_now = [], []

    def info(self) -> dict:
        """Peak and current bytes on each side, the layers whose entries live on the CPU side now, and the counters
        (for the run's statistics)."""
        return dict(device_budget_bytes=self.device_budget, auto_limit_bytes=self.auto_limit,
                    peak_device_bytes=self.peak_device, peak_cpu_bytes=self.peak_cpu, device_bytes=self.device_bytes,
                    cpu_bytes=self.cpu_bytes, dropped_residual_layers=sorted(self.dropped_layers, key=str),
                    packed_residual_layers=sorted(self.packed_layers, key=str),
                    cpu_layers=sorted({_layer_of(k) for k in self.on_cpu}, key=str),
                    prefetch_off=self.prefetch_off, **self.counters)

    def reset(self) -> None:
        """Free every entry and zero the counters and peaks (a new run starts from nothing)."""
        self.clear()
        self.peak_device = self.peak_cpu = 0
        self.auto_limit = None
        self.dropped_layers = set()
        self.dropped_logged = False
        self.packed_layers = set()
        self.prefetch_off = False
        for k in self.counters:
            self.counters[k] = 0

    # prefetch
    def _note_access(self, key) -> None:
        if not self.order_now or self.order_now[-1] != key:
            self.order_now.append(key)

    def _prefetch_next(self, key, device) -> None:
        try:
            nxt = self.order_prev[self.order_prev.index(key) + 1]
        except (ValueError, IndexError):
            return
        if self.prefetch_off or nxt not in self.on_cpu or nxt in self.prefetched:
            return
        dev = torch.device(device)
        # the copy's size on the device, its lists widened (Entry.to), not the host entry's own
        if self.device_budget is None and not self._device_fits(self.on_cpu[nxt].device_nbytes, self.on_cpu[nxt], dev):
            # "auto" found no room for it on the device: a prefetched copy would crowd the model's own forward (a
            # 16 GB card ran out of memory there at its first reuse step and ran the step again, 18.6 against
            # 8.1 s: docs/benchmarks.md, "The small-VRAM preset on a 16 GB card"); the entry is fetched when used
            return
        if dev.type == "cuda":
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=dev)
            self._stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(self._stream):
                entry = self.on_cpu[nxt].to(dev, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            self.prefetched[nxt] = (entry, event)
        else:
            self.prefetched[nxt] = (self.on_cpu[nxt].to(dev), None)
        self.counters["prefetched"] += 1


def _layer_of(key):
    """The layer a cache key belongs to: its first element (keys are (layer, ...) tuples), or the key itself."""
    return key[0] if isinstance(key, tuple) and key else key


def _release_all(on_cpu: dict, token) -> None:
    """A collected cache (its patched model deleted) gives its host entries' buffers back and the pool frees the free
    buffers it released last: nothing keeps page-locked memory for a model that is gone, and what other caches keep
    for their next run stays (engine/pinned_pool.py, ``forget``: safe wherever the garbage collector runs it)."""
    POOL.forget([t for entry in on_cpu.values() for t in _tensors(entry)], token)


def _tensors(entry: Entry):
    out = list(entry.selection.tensors())
    if entry.residual is not None:
        out.extend(entry.residual.tensors())
    return out


def _host_buffer(shape, dtype: torch.dtype, device: torch.device | None, taken: list) -> torch.Tensor:
    """An uninitialised CPU tensor of ``shape`` and ``dtype`` for copies from ``device`` (a CUDA device, or None
    without one): a page-locked pool buffer, appended to ``taken`` so that a caller that fails gives it back, or else
    torch's pinned memory (plain memory without CUDA)."""
    buf = POOL.empty(shape, dtype, device) if device is not None else None
    if buf is not None:
        taken.append(buf)
        return buf
    return torch.empty(shape, dtype=dtype, pin_memory=torch.cuda.is_available())


def _resident_bytes(entry: Entry, dev: torch.device) -> int:
    """Bytes of ``entry``'s tensors that lie on ``dev`` (each tensor's own elements; a view counts its view)."""
    return sum(t.numel() * t.element_size() for t in _tensors(entry) if t.device == dev)


def _is_cond(c) -> bool:
    """A chunk element naming one cond of the batch: ``cond_or_uncond``, or (``cond_or_uncond``, uuid)."""
    if isinstance(c, tuple):
        return len(c) == 2 and isinstance(c[0], int) and isinstance(c[1], str)
    return isinstance(c, int) and not isinstance(c, bool)


def rows_of(big: tuple, small: tuple) -> tuple | None:
    """Where the cache key ``small``'s batch rows sit in the key ``big``'s chunk: (first, count, of) in conds, or
    None when ``big`` does not hold them (another layer, token count or forward, not a larger chunk, or repeated
    conds, which make it ambiguous whose rows are whose). Keys: (layer, is_self, chunk, n)."""
    if len(big) != 4 or len(small) != 4 or not isinstance(big[2], tuple) or not isinstance(small[2], tuple):
        return None
    if (big[0], big[1], big[3]) != (small[0], small[1], small[3]) or len(big[2]) <= len(small[2]):
        return None
    conds, rest = split_chunk(small[2])
    b_conds, b_rest = split_chunk(big[2])
    if not conds or b_rest != rest or len(set(b_conds)) != len(b_conds):
        return None
    for i in range(len(b_conds) - len(conds) + 1):
        if b_conds[i:i + len(conds)] == conds:
            return i, len(conds), len(b_conds)
    return None


def split_chunk(chunk: tuple) -> tuple[tuple, tuple]:
    """(conds, rest): a chunk's leading cond elements and what follows them (context window, pass tag)."""
    k = 0
    while k < len(chunk) and _is_cond(chunk[k]):
        k += 1
    return tuple(chunk[:k]), tuple(chunk[k:])
