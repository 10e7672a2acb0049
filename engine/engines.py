"""The engines of one sampling run: one SparseEngine per device, created on first use, statistics merged.

A sampler split over several GPUs (ComfyUI's MultiGPU CFG Split) evaluates cond and uncond on different
devices in worker threads at the same time. Each device gets its own engine — cache, step, statistics and
lock — so a cached entry never serves a call on another device and the devices never wait on each other.
"""

from __future__ import annotations

import threading

from .config import SparseConfig
from .engine import SparseEngine
from .stats import RunStats


class DeviceEngines:
    """SparseEngines of one run keyed by device (any string: ``str(tensor.device)``). Thread-safe."""

    def __init__(self, cfg: SparseConfig):
        self.cfg = cfg
        self._engines: dict[str, SparseEngine] = {}
        self._lock = threading.Lock()

    def engine(self, device_key: str) -> SparseEngine:
        """The engine of ``device_key``, created (with its run begun) on first use."""
        with self._lock:
            eng = self._engines.get(device_key)
            if eng is None:
                eng = self._engines[device_key] = SparseEngine(self.cfg)
                eng.begin_run()
            return eng

    def engines(self) -> dict[str, SparseEngine]:
        """A snapshot of the engines by device key."""
        with self._lock:
            return dict(self._engines)

    def end_run(self) -> RunStats:
        """Finish every engine's run (freeing its cache) and return the merged statistics."""
        parts = [eng.end_run(log_summary=False) for _, eng in sorted(self.engines().items())]
        return RunStats.merged(parts)

    def clear(self) -> None:
        """Free every engine's cached tensors (their statistics stay)."""
        for eng in self.engines().values():
            with eng.lock:
                eng.cache.clear()

    def relieve(self) -> int:
        """Move every engine's device cache off the GPU (to host memory where it fits, else dropped: those
        layers anchor again) and drop its prefetched copies (no more prefetching this run) after the model
        itself ran out of memory; later entries stay within what is left. Returns the device bytes freed."""
        freed = 0
        for eng in self.engines().values():
            with eng.lock:
                if eng.cache.device_bytes or eng.cache.prefetched:
                    freed += eng.cache.spill(1.0, stop_prefetch=True)
        return freed

    @property
    def cache_bytes(self) -> int:
        """Bytes cached on devices and on the CPU side, over all engines."""
        return sum(eng.cache.device_bytes + eng.cache.cpu_bytes for eng in self.engines().values())
