"""Per-run statistics: density, anchor fidelity, time in selection / attention / transfers / storing, cache bytes.

Timing uses CUDA events on GPU tensors (resolved once at the end of the run, so measuring never
synchronises the device mid-run) and ``time.perf_counter`` on other devices.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

PHASES = ("selection", "attention", "transfer", "store")  # store: residual, fidelity, cache placement


@dataclass
class LayerStats:
    calls: int = 0
    dense: int = 0
    anchors: int = 0
    reuses: int = 0
    fallbacks: int = 0
    replays: int = 0  # reuse calls replayed (kernels/replay.py)
    density_sum: float = 0.0
    fidelity: list = field(default_factory=list)
    seconds: dict = field(default_factory=lambda: {p: 0.0 for p in PHASES})
    # densities the engine left on the device (0-d tensors, one entry per call; a selection's reuse calls share its
    # tensor), added to density_sum when read (``read_device_values``)
    density_pending: list = field(default_factory=list)

    @property
    def density(self) -> float:
        self.read_device_values()
        return self.density_sum / self.calls if self.calls else 1.0

    def read_device_values(self) -> None:
        """Read the densities and fidelities the engine left on the device as 0-d tensors, as floats (an anchor
        never waits for the device to read them: docs/kernel_notes.md, "v26" and "v27"); each distinct tensor is read
        once, however many calls share it."""
        if self.density_pending:
            read: dict[int, float] = {}
            for d in self.density_pending:
                if id(d) not in read:
                    read[id(d)] = float(d)
                self.density_sum += read[id(d)]
            self.density_pending = []
        if any(isinstance(f, torch.Tensor) for f in self.fidelity):
            self.fidelity = [float(f) for f in self.fidelity]


class _Timed:
    """The context of ``RunStats.timed``: a class rather than a generator, since a host-bound reuse call enters two
    of them (docs/benchmarks.md, "Host overhead at 4 608 tokens")."""

    __slots__ = ("stats", "layer", "phase", "device", "step", "t0", "stream", "start")

    def __init__(self, stats: "RunStats", layer: int, phase: str, device: torch.device):
        self.stats, self.layer, self.phase, self.device, self.step = stats, layer, phase, device, stats.step

    def __enter__(self):
        if self.device.type == "cuda":
            # one current-stream lookup for both events; the enclosed work is enqueued on that stream
            self.stream = torch.cuda.current_stream(self.device)
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record(self.stream)
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record(self.stream)
            self.stats._pending.append((self.layer, self.step, self.phase, self.start, end))
        else:
            self.stats._add_seconds(self.layer, self.step, self.phase, time.perf_counter() - self.t0)
        return False


class RunStats:
    """Accumulates one sampling run's statistics; ``finish()`` resolves pending GPU timings."""

    def __init__(self):
        self.layers: dict[int, LayerStats] = {}
        self.steps: dict[int, dict[str, int]] = {}  # run step -> calls per kind (dense/anchor/reuse/fallback)
        self.step: int | None = None  # the run step timed work belongs to (set by the engine as steps change)
        self.step_seconds: dict[int, dict[int, dict[str, float]]] = {}  # run step -> layer -> phase -> seconds
        self._pending: list[tuple[int, int | None, str, object, object]] = []
        self.cache: dict = {}
        self.finished = False

    def layer(self, idx: int) -> LayerStats:
        s = self.layers.get(idx)
        if s is None:
            s = self.layers[idx] = LayerStats()
        return s

    def add(self, layer: int, kind: str, density: float | torch.Tensor, fidelity: float | torch.Tensor | None = None,
            step: int | None = None, replayed: bool = False) -> None:
        """kind: dense | anchor | reuse | fallback (a dense call forced by a cache fallback); step: the run step;
        replayed: a reuse call that was replayed (kernels/replay.py). density and fidelity: floats, or 0-d tensors
        on the device, read when the statistics are (``LayerStats.read_device_values``)."""
        if step is not None:
            per = self.steps.setdefault(step, {})
            per[kind] = per.get(kind, 0) + 1
        s = self.layer(layer)
        s.calls += 1
        if isinstance(density, torch.Tensor):
            s.density_pending.append(density)
        else:
            s.density_sum += density
        if kind == "dense":
            s.dense += 1
        elif kind == "anchor":
            s.anchors += 1
        elif kind == "reuse":
            s.reuses += 1
            s.replays += replayed
        elif kind == "fallback":
            s.fallbacks += 1
            s.dense += 1
        if fidelity is not None:
            s.fidelity.append(fidelity)

    def timed(self, layer: int, phase: str, device: torch.device) -> "_Timed":
        """Time the enclosed work (``with stats.timed(...):``) under ``phase`` for ``layer`` (and for the current
        ``step``, when set): CUDA events on a CUDA device, resolved at ``finish``; the host clock elsewhere."""
        return _Timed(self, layer, phase, device)

    def _add_seconds(self, layer: int, step: int | None, phase: str, sec: float) -> None:
        self.layer(layer).seconds[phase] += sec
        if step is not None:
            per = self.step_seconds.setdefault(step, {}).setdefault(layer, {})
            per[phase] = per.get(phase, 0.0) + sec

    def step_totals(self) -> dict[int, dict[str, float]]:
        """Per run step, the seconds of each phase summed over the layers (steps the engine timed work in)."""
        return {step: {p: sum(per.get(p, 0.0) for per in layers.values()) for p in PHASES}
                for step, layers in sorted(self.step_seconds.items())}

    def _read_device_values(self) -> None:
        """Every layer's ``read_device_values``: after a run, when the statistics are read."""
        for s in self.layers.values():
            s.read_device_values()

    def finish(self, cache_info: dict | None = None) -> "RunStats":
        if self._pending:
            torch.cuda.synchronize()
            for layer, step, phase, start, end in self._pending:
                self._add_seconds(layer, step, phase, start.elapsed_time(end) / 1000.0)
            self._pending.clear()
        self._read_device_values()
        if cache_info is not None:
            self.cache = dict(cache_info)
        self.finished = True
        return self

    @staticmethod
    def merged(parts: list["RunStats"]) -> "RunStats":
        """One RunStats from several finished ones (one engine per device): calls, densities, fidelities and
        seconds add up per layer and step; cache figures add up over the devices (budgets are each device's)."""
        if len(parts) == 1:
            return parts[0]
        out = RunStats()
        for part in parts:
            for idx, s in part.layers.items():
                s.read_device_values()
                acc = out.layer(idx)
                for name in ("calls", "dense", "anchors", "reuses", "fallbacks", "replays", "density_sum"):
                    setattr(acc, name, getattr(acc, name) + getattr(s, name))
                acc.fidelity.extend(s.fidelity)
                for phase, sec in s.seconds.items():
                    acc.seconds[phase] = acc.seconds.get(phase, 0.0) + sec
            for step, kinds in part.steps.items():
                per = out.steps.setdefault(step, {})
                for kind, count in kinds.items():
                    per[kind] = per.get(kind, 0) + count
            for step, layers in part.step_seconds.items():
                for idx, phases in layers.items():
                    per = out.step_seconds.setdefault(step, {}).setdefault(idx, {})
                    for phase, sec in phases.items():
                        per[phase] = per.get(phase, 0.0) + sec
            for key, value in part.cache.items():
                if isinstance(value, list):
                    out.cache[key] = sorted(set(out.cache.get(key, [])) | set(value), key=str)
                elif key.endswith("budget_bytes") or key == "auto_limit_bytes" or value is None:
                    out.cache.setdefault(key, value)
                elif isinstance(value, bool):  # a flag (prefetch_off): set when any device set it
                    out.cache[key] = bool(out.cache.get(key, False)) or value
                else:
                    out.cache[key] = out.cache.get(key, 0) + value
        out.cache["devices"] = len(parts)
        out.finished = all(p.finished for p in parts)
        return out

    # views
    def totals(self) -> dict:
        self._read_device_values()
        calls = sum(s.calls for s in self.layers.values())
        fid = [f for s in self.layers.values() for f in s.fidelity]
        return dict(
            calls=calls,
            dense=sum(s.dense for s in self.layers.values()),
            anchors=sum(s.anchors for s in self.layers.values()),
            reuses=sum(s.reuses for s in self.layers.values()),
            fallbacks=sum(s.fallbacks for s in self.layers.values()),
            replays=sum(s.replays for s in self.layers.values()),
            density=(sum(s.density_sum for s in self.layers.values()) / calls) if calls else 1.0,
            fidelity_mean=(sum(fid) / len(fid)) if fid else None,
            fidelity_max=max(fid) if fid else None,
            seconds={p: sum(s.seconds[p] for s in self.layers.values()) for p in PHASES},
        )

    def step_kinds(self) -> dict[int, str]:
        """Per run step, what its calls were: "anchor" if any call anchored, else "reuse" if any reused, else
        "dense" (warm-up or dense-only steps)."""
        out = {}
        for step, kinds in sorted(self.steps.items()):
            out[step] = "anchor" if kinds.get("anchor") else "reuse" if kinds.get("reuse") else "dense"
        return out

    def schedule_line(self) -> str:
        """The run's steps as a string of letters: D dense, A anchor, r reuse (e.g. "DDArrrArr")."""
        kinds = self.step_kinds()
        return "".join({"anchor": "A", "reuse": "r", "dense": "D"}[k] for k in kinds.values())

    def as_dict(self) -> dict:
        """Structured form for a report node: totals, per-layer rows, per-step kinds, cache figures."""
        self._read_device_values()
        return dict(totals=self.totals(), cache=self.cache, steps=self.step_kinds(), step_seconds=self.step_totals(),
                    layers={
            i: dict(calls=s.calls, dense=s.dense, anchors=s.anchors, reuses=s.reuses, fallbacks=s.fallbacks,
                    replays=s.replays, density=s.density,
                    fidelity=(sum(s.fidelity) / len(s.fidelity)) if s.fidelity else None,
                    seconds=dict(s.seconds)) for i, s in sorted(self.layers.items())})

    def summary_line(self) -> str:
        t = self.totals()
        fid = "n/a" if t["fidelity_mean"] is None else f"{t['fidelity_mean']:.4f} (max {t['fidelity_max']:.4f})"
        sec = t["seconds"]
        c = self.cache
        # "on the device": the model's device, which is the CPU itself on a run without a GPU
        cache = (f"cache peak {c.get('peak_device_bytes', 0) / 2**20:.0f} MiB on the device / "
                 f"{c.get('peak_cpu_bytes', 0) / 2**20:.0f} MiB in host memory" if c else "cache n/a")
        if c.get("pool_trims"):
            cache += f", allocator pool handed back {c['pool_trims']}x"  # engine/device_pool.py PoolWatch
        return (f"sparse attention: {t['calls']} calls ({t['dense']} dense, {t['anchors']} anchor, "
                f"{t['reuses']} reuse ({t['replays']} replayed), {t['fallbacks']} fallback), "
                f"density {t['density']:.3f}, anchor rel-L2 {fid}, "
                f"selection {sec['selection']:.2f}s attention {sec['attention']:.2f}s "
                f"transfer {sec['transfer']:.2f}s store {sec['store']:.2f}s, {cache}")
