"""Projected end-to-end speed-up of a quality-bench setting at Wan 2.1 14B 720p, from the per-step costs that
bench/e2e.py measured (docs/bench-runs/e2e-wan14b*/e2e.json).

    speed-up = steps x dense / (n_dense x dense + first anchor + (n_anchor - 1) x later anchor + n_reuse x reuse)

with the step kinds counted as the engine decides them (bench/quality_grid.py ``step_kinds``); Sol-Attn:
n_dense x dense + n_sparse x Sol step. Costs per (method, density): e2e rows ``anchor_s`` (the run's first anchor),
``later_anchor_s`` (where a run timed a later anchor; else every anchor costs the first one's time, flagged "first-
anchor price" when the method's later anchors were measured at another density) and ``step_s`` (one reuse step),
``dense_s`` from the dense row. Several e2e.json files are merged newest first (by the date in their ``meta``), a
(model, mode) taken from the newest run holding it, as bench/plot_e2e.py does (a later anchor from the newest run
that timed one).

A density between two measured ones gets costs interpolated linearly in density (flag "interpolated"); one
outside the measured range gets the nearest measured density's costs (flag "nearest": for a lower density
that under-states the speed-up). The e2e rows ran the Wan 14B preset's configuration (mc_sparse groups of
128, block_topk 128-blocks, residual on, selection reused): settings with other group / block sizes,
select_every_step or residual off get their method's costs (flag "method costs"). Rows record how many of the
model's layers they kept dense (``warmup_layers``; rows written before it was recorded ran the preset's 1 of 40):
for each (method, density) a row with the Wan 14B preset's own count (presets/wan21_t2v_14b.yaml) wins over a
newer row with another count (bench/e2e.py --warmup-layers variants) or run with another preset's settings
(bench/e2e.py --preset), and a projection priced from rows with another count is flagged "layers".
"""

from __future__ import annotations

import glob
import json
import re
from pathlib import Path

from quality_grid import ANCHOR, DENSE, REUSE, count_kinds, step_kinds

DEFAULT_RUNS = "docs/bench-runs/e2e-wan14b*/e2e.json"
PRESET = Path(__file__).resolve().parents[1] / "presets" / "wan21_t2v_14b.yaml"  # the configuration the runs price
# e2e rows without a "warmup_layers" key ran the Wan 14B preset of their day: 1 of 40 layers dense (Wan 14B's count:
# the projections price wan14b rows only)
LEGACY_WARMUP_LAYERS = 1
MEASURED_CONFIG = {"group_size": 128, "block_q": 128, "block_k": 128, "residual": True, "select_every_step": False}
FLAG_TEXT = {
    "interpolated": "density not measured: costs interpolated linearly between the nearest measured densities",
    "nearest": "density outside the measured range: costs of the nearest measured density",
    "method costs": "configuration not measured end to end (group/block size, select_every_step or residual "
                    "off): the costs of its method as measured (groups / blocks of 128, residual on)",
    "first-anchor price": "a run's later anchors measured for this method at another density only: every anchor "
                          "priced at the first one's time (later anchors, which reuse the first one's host memory, "
                          "cost less where measured)",
    "layers": "priced from an e2e run that kept another number of the model's 40 layers dense than the Wan 14B "
              "preset does now (bench/e2e.py --warmup-layers; one dense layer more costs about 0.3 s per reuse step)",
}


def preset_warmup_layers(path: Path = PRESET) -> int:
    """The number of leading layers the Wan 14B preset computes densely (its ``warmup_layers``, 0 if absent), read
    by the pack's own preset loader (ValueError naming the file when it is missing or invalid)."""
    from _pack import load

    path = Path(path)
    return load("engine.presets").load_preset(path.stem, directory=path.parent).warmup_layers


def _layers_of(row: dict) -> int | None:
    """The dense-layer count an e2e row ran with (its "warmup_layers", else its "wlN" variant's N, else the legacy
    count), or None for a variant of another kind (not priced)."""
    variant = row.get("variant")
    m = re.fullmatch(r"wl(\d+)", str(variant)) if variant else None
    if variant and not m:
        return None
    if "warmup_layers" in row:
        return int(row["warmup_layers"])
    return int(m.group(1)) if m else LEGACY_WARMUP_LAYERS


def _run_date(meta) -> str:
    m = re.search(r"(\d{4}-\d{2}-\d{2} \d{2}:\d{2})", str(meta))
    return m.group(1) if m else ""


class StepCosts:
    """Seconds of one dense step and, per (method, density), of one anchor step and one reuse step."""

    def __init__(self, model: str, dense_s: float, modes: dict, sources: list[str], meta: str = "",
                 warmup_layers: int | None = None):
        """modes: {method: {density: {"anchor_s": float | None, "step_s": float, "run": str, and optionally
        "later_anchor_s": a run's later anchor steps, which replace cached entries (bench/e2e.py --pattern), and
        "warmup_layers": the dense layers its run kept}}}; warmup_layers: the count the projections price (entries
        with another count flag "layers"; None: no flag)."""
        if not (isinstance(dense_s, (int, float)) and dense_s > 0):
            raise ValueError(f"step costs of {model}: dense_s must be a positive number, got {dense_s!r}")
        self.model, self.dense_s, self.modes, self.sources, self.meta = model, float(dense_s), modes, sources, meta
        self.warmup_layers = warmup_layers

    @classmethod
    def from_e2e(cls, paths, model: str = "wan14b", warmup_layers: int | None = None) -> "StepCosts":
        """Merge e2e.json files (any order: sorted newest first by their meta date, ties in given order); per
        (method, density) rows run with ``warmup_layers`` dense layers (default: the Wan 14B preset's) first."""
        want = preset_warmup_layers() if warmup_layers is None else warmup_layers
        paths = [Path(p) for p in paths]
        if not paths:
            raise ValueError("step costs: no e2e.json files given")
        docs = []
        for p in paths:
            try:
                doc = json.loads(p.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise ValueError(f"{p}: cannot read e2e results ({exc})") from None
            if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
                raise ValueError(f"{p}: not an e2e.json (no 'rows' list)")
            docs.append((p, doc))
        order = sorted(range(len(docs)), key=lambda i: _run_date(docs[i][1].get("meta")), reverse=True)
        dense_s, modes, seen, used = None, {}, set(), []
        for matching in (True, False):  # the preset's dense-layer count first, then rows run with another one
            for i in order:
                p, doc = docs[i]
                run = p.parent.name
                for r in doc["rows"]:
                    if r.get("model") != model or "skipped" in r:
                        continue
                    if r.get("mode") == "dense":
                        if dense_s is None:
                            dense_s = r["dense_s"]
                            used.append(run)
                        continue
                    layers = _layers_of(r)
                    own = r.get("preset") in (None, PRESET.stem)  # rows of another preset (--preset): second pass
                    if "@" not in str(r.get("mode")) or layers is None or (layers == want and own) != matching:
                        continue
                    method, dens = r["mode"].split("@")
                    later = r["later_anchor_s"] if len(r.get("anchor_times_s") or []) > 1 else None  # later anchor
                    if r["mode"] in seen:  # a newer run measured this mode; an older one may add its later anchor
                        entry = modes[method][float(dens)]
                        if later is not None and "later_anchor_s" not in entry and entry["warmup_layers"] == layers:
                            entry["later_anchor_s"], entry["later_run"] = later, run
                            if run not in used:
                                used.append(run)
                        continue
                    seen.add(r["mode"])
                    entry = {"anchor_s": r.get("anchor_s"), "step_s": r["step_s"], "run": run,
                             "warmup_layers": layers}
                    if later is not None:
                        entry["later_anchor_s"] = later
                    modes.setdefault(method, {})[float(dens)] = entry
                    if run not in used:
                        used.append(run)
        if dense_s is None:
            raise ValueError(f"step costs: no dense row of {model} in {', '.join(map(str, paths))}")
        return cls(model, dense_s, modes, used, warmup_layers=want)

    @classmethod
    def load(cls, paths=None, root: Path | None = None) -> "StepCosts":
        """From e2e.json files, or one JSON written by ``to_json`` (key "step_costs"); default: DEFAULT_RUNS
        under ``root`` (the repository)."""
        if not paths:
            root = root or Path(__file__).resolve().parents[1]
            paths = sorted(glob.glob(str(root / DEFAULT_RUNS)))
            if not paths:
                raise ValueError(f"step costs: no files match {root / DEFAULT_RUNS}")
        if len(paths) == 1:
            try:
                doc = json.loads(Path(paths[0]).read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise ValueError(f"{paths[0]}: cannot read step costs ({exc})") from None
            if isinstance(doc, dict) and "step_costs" in doc:
                return cls.from_dict(doc["step_costs"], source=str(paths[0]))
        return cls.from_e2e(paths)

    def to_dict(self) -> dict:
        return {"model": self.model, "dense_s": self.dense_s, "sources": self.sources,
                "warmup_layers": self.warmup_layers,
                "modes": {m: {str(d): v for d, v in sorted(ds.items())} for m, ds in sorted(self.modes.items())}}

    def to_json(self, path) -> None:
        Path(path).write_text(json.dumps({"step_costs": self.to_dict()}, indent=1))

    @classmethod
    def from_dict(cls, d: dict, source: str = "step costs") -> "StepCosts":
        try:
            modes = {m: {float(k): dict(v) for k, v in ds.items()} for m, ds in d["modes"].items()}
            return cls(d["model"], d["dense_s"], modes, list(d.get("sources", [])),
                       warmup_layers=d.get("warmup_layers"))
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise ValueError(f"{source}: malformed step-cost table ({exc})") from None

    def costs(self, method: str, density: float) -> tuple[float | None, float, str | None]:
        """(anchor_s, reuse_s, flag) of ``method`` at ``density``; flag None | "interpolated" | "nearest"."""
        anchor_s, flag = self._value(method, density, "anchor_s")
        return anchor_s, self._value(method, density, "step_s")[0], flag

    def later_anchor_s(self, method: str, density: float) -> float | None:
        """Seconds of an anchor step after the run's first (measured where a run timed one), else None."""
        return self._value(method, density, "later_anchor_s")[0]

    def _entries(self, method: str, density: float) -> tuple[list[tuple[dict, float]], str | None]:
        """The measured entries that price ``density`` with their weights, and the flag (see ``costs``)."""
        table = self.modes.get(method)
        if not table:
            raise ValueError(f"step costs: no measured {method!r} rows for {self.model} (have "
                             f"{sorted(self.modes)})")
        ds = sorted(table)
        if density in table:
            return [(table[density], 1.0)], None
        if density < ds[0] or density > ds[-1]:
            return [(table[ds[0] if density < ds[0] else ds[-1]], 1.0)], "nearest"
        hi = next(d for d in ds if d > density)
        lo = max(d for d in ds if d < density)
        w = (density - lo) / (hi - lo)
        return [(table[lo], 1.0 - w), (table[hi], w)], "interpolated"

    def _value(self, method: str, density: float, key: str) -> tuple[float | None, str | None]:
        entries, flag = self._entries(method, density)
        values = [e.get(key) for e, _ in entries]
        if any(v is None for v in values):
            return None, flag
        return sum(v * w for v, (_, w) in zip(values, entries)), flag

    def other_layers(self, method: str, density: float) -> bool:
        """Whether the entries that price ``density`` ran with another dense-layer count than projected."""
        if self.warmup_layers is None:
            return False
        return any(e.get("warmup_layers", LEGACY_WARMUP_LAYERS) != self.warmup_layers
                   for e, _ in self._entries(method, density)[0])

    def project(self, setting: dict) -> dict:
        """{"speedup", "n" (step counts), "flags", "seconds" (projected run), "dense_seconds"} of a setting."""
        n = count_kinds(step_kinds(setting))
        steps = setting["steps"]
        flags: list[str] = []
        if setting["kind"] == "sol":
            anchor_s, reuse_s, flag = self.costs("sol", setting["sol"]["density"])
            anchor_s = self.dense_s
        elif setting["config"].get("method") == "dense":
            anchor_s, reuse_s, flag = self.dense_s, self.dense_s, None
        else:
            cfg = setting["config"]
            anchor_s, reuse_s, flag = self.costs(cfg["method"], cfg["density"])
            size_keys = ("group_size",) if cfg["method"] == "mc_sparse" else ("block_q", "block_k")
            if any(cfg.get(k, MEASURED_CONFIG[k]) != MEASURED_CONFIG[k]
                   for k in size_keys + ("residual", "select_every_step")):
                flags.append("method costs")
            if self.other_layers(cfg["method"], cfg["density"]):
                flags.append("layers")
        if flag:
            flags.insert(0, flag)
        if n[ANCHOR] and anchor_s is None:
            raise ValueError(f"step costs: no anchor time measured for {setting['id']}")
        later_s = anchor_s  # a run's later anchors, where measured (they reuse the first one's cache memory)
        if setting["kind"] != "sol" and setting["config"].get("method") != "dense":
            method = setting["config"]["method"]
            measured = self.later_anchor_s(method, setting["config"]["density"])
            later_s = measured or anchor_s
            if measured is None and n[ANCHOR] > 1 and any("later_anchor_s" in e for e in self.modes[method].values()):
                flags.append("first-anchor price")
        seconds = (n[DENSE] * self.dense_s + min(n[ANCHOR], 1) * (anchor_s or 0.0)
                   + max(0, n[ANCHOR] - 1) * (later_s or 0.0) + n[REUSE] * reuse_s)
        return {"speedup": steps * self.dense_s / seconds, "n": n, "flags": flags, "seconds": seconds,
                "dense_seconds": steps * self.dense_s}
