"""Selection/residual cache with a GPU memory budget, CPU offload and prefetch on a side stream.

Entries are keyed by (layer, self/cross, batch chunk, token count). An entry that does not fit the
device budget lives in (pinned) CPU memory and is copied back when used; the copy for the key expected
next (the order of the previous step) is started early on a side stream so it overlaps compute. An
entry that fits nowhere is not stored: the key is remembered as a fallback and counted. ``clear()``
frees everything (end of a run).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass
class Entry:
    """A cached selection (BlockSelection | TokenSelection) and its residual (B, H, N, D) or None."""

    selection: object
    residual: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        r = 0 if self.residual is None else self.residual.numel() * self.residual.element_size()
        return self.selection.nbytes + r

    def map(self, fn) -> "Entry":
        return Entry(self.selection.map(fn), None if self.residual is None else fn(self.residual))

    def to(self, device, non_blocking=False) -> "Entry":
        return self.map(lambda t: t.to(device, non_blocking=non_blocking))

    def pinned(self) -> "Entry":
        """A CPU copy, in pinned memory when CUDA is present (so copies back can be asynchronous)."""
        pin = torch.cuda.is_available()

        def cp(t):
            c = t.detach().to("cpu", copy=True)
            return c.pin_memory() if pin else c
        return self.map(cp)


class SelectionCache:
    """Budgeted store of Entries. Budgets in bytes; ``offload`` allows CPU residency."""

    def __init__(self, device_budget: int, cpu_budget: int, offload: bool):
        self.device_budget = int(device_budget)
        self.cpu_budget = int(cpu_budget)
        self.offload = offload
        self.on_device: OrderedDict[tuple, Entry] = OrderedDict()
        self.on_cpu: dict[tuple, Entry] = {}
        self.fallback_keys: set[tuple] = set()
        self.prefetched: dict[tuple, tuple[Entry, object]] = {}
        self.order_prev: list[tuple] = []
        self.order_now: list[tuple] = []
        self.counters = dict(offloaded=0, fetched=0, prefetched=0, fallbacks=0, residual_dropped=0)
        self.peak_device = 0
        self.peak_cpu = 0
        self._stream = None

    # sizes
    @property
    def device_bytes(self) -> int:
        return sum(e.nbytes for e in self.on_device.values())

    @property
    def cpu_bytes(self) -> int:
        return sum(e.nbytes for e in self.on_cpu.values())

    def __contains__(self, key) -> bool:
        return key in self.on_device or key in self.on_cpu

    def put(self, key: tuple, entry: Entry) -> str:
        """Store an entry; returns where it went: "device", "cpu", "device-no-residual", or "none"."""
        self.drop(key)
        size = entry.nbytes
        if self.device_bytes + size <= self.device_budget:
            self.on_device[key] = entry
            where = "device"
        elif self.offload and self.cpu_bytes + size <= self.cpu_budget:
            self.on_cpu[key] = entry.pinned()
            self.counters["offloaded"] += 1
            where = "cpu"
        elif entry.residual is not None and self.device_bytes + entry.selection.nbytes <= self.device_budget:
            self.on_device[key] = Entry(entry.selection, None)
            self.counters["residual_dropped"] += 1
            where = "device-no-residual"
        else:
            self.fallback_keys.add(key)
            self.counters["fallbacks"] += 1
            log.info("sparse attention: no cache room for %s (%.1f MB); this layer falls back", key[:2], size / 2**20)
            where = "none"
        self.peak_device = max(self.peak_device, self.device_bytes)
        self.peak_cpu = max(self.peak_cpu, self.cpu_bytes)
        return where

    def get(self, key: tuple, device) -> Entry | None:
        """The entry on ``device`` (copied from CPU if it lives there; waits for its prefetch)."""
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

    def drop(self, key: tuple) -> None:
        self.on_device.pop(key, None)
        self.on_cpu.pop(key, None)
        self.prefetched.pop(key, None)

    def new_step(self) -> None:
        """Called when the denoising step changes: the access order just seen predicts the next one."""
        if self.order_now:
            self.order_prev, self.order_now = self.order_now, []

    def clear(self) -> None:
        """Free every entry (end of run)."""
        self.on_device.clear()
        self.on_cpu.clear()
        self.prefetched.clear()
        self.fallback_keys.clear()
        self.order_prev, self.order_now = [], []

    def info(self) -> dict:
        """Peak and current bytes on each side, and the counters (for the run's statistics)."""
        return dict(peak_device_bytes=self.peak_device, peak_cpu_bytes=self.peak_cpu, device_bytes=self.device_bytes,
                    cpu_bytes=self.cpu_bytes, **self.counters)

    def reset(self) -> None:
        """Free every entry and zero the counters and peaks (a new run starts from nothing)."""
        self.clear()
        self.peak_device = self.peak_cpu = 0
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
        if nxt not in self.on_cpu or nxt in self.prefetched:
            return
        dev = torch.device(device)
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


def _tensors(entry: Entry):
    out = list(entry.selection.tensors())
    if entry.residual is not None:
        out.append(entry.residual)
    return out
