"""Dense and sparse sampling of real-dimension models (random bf16 weights) on one GPU and split over two GPUs
with ComfyUI's MultiGPU CFG Split (ComfyUI 0.33.0 and later: cond and uncond run on different GPUs).

    COMFYUI_PATH=/path/to/ComfyUI-0.33.0 python bench/multigpu.py --out DIR [--models wan13b,wan14b]
        [--method M --density D] [--steps N] [--budget-s 540] [--cpu-devices]

Per model (built as bench/e2e.py builds it, on cuda:0; CFG > 1 so there are two conds to split):
1. one GPU: a 1-step dense run loads the model and records the self-attention shape; the sparse kernels are
   compiled and autotuned on random q/k/v of that shape (batch 2 on cuda:0, batch 1 on each GPU for the split
   run), then ``steps`` steps sparse (the preset's layers and settings, warm-up 0, no later anchors: step 0 is
   the anchor, the rest reuse) and ``steps`` steps dense.
2. two GPUs: ``MultiGPUCFGSplitNode.execute(model, 2)`` (its clone for the second GPU is built by the same
   seeded builder, so both GPUs hold the same weights); a 1-step dense run loads both GPUs, then the same
   sparse and dense runs as on one GPU (the sparse model is patched first, then split, as the node's
   documentation asks: nodes that change the model's attention go before it).
Each run: seconds per step (sampler callback, every GPU synchronised), peak memory per GPU
(``torch.cuda.max_memory_allocated``), the final latent. Sparse runs also report the engines of the patch's
last run by device key (nodes/patch.py ``SamplingRun``, engine/engines.py ``DeviceEngines``) and a cache check:
every tensor that entered or left each engine's cache during the run (``SelectionCache.put``/``get``) and
every entry it held when the run ended was on that engine's device (entries moved to host memory: on the CPU).
Compared: relative L2 of the final latents, two GPUs against one, dense and sparse; the sparse pair must agree
within ``max(--tol, 3 x the dense pair's)`` (the dense pair is the split's own floating-point noise: batch 2
on one GPU against batch 1 on each runs other kernels).

``--cpu-devices``: the same logic on the CPU with tiny models and the device keys "cpu" and "cpu:1" (ComfyUI's
MultiGPU takes any device list; tests/test_comfyui_composition.py fakes it the same way); the cache check can
only compare device types there (both keys share one memory). Writes DIR/multigpu.json (after every run, so a
run stopped by a time limit keeps what it measured) and DIR/multigpu.md.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # a benchmark script: its sibling e2e.py
import e2e  # noqa: E402

log = logging.getLogger("bench.multigpu")


def node_model(out):
    """The model a ComfyUI node returned (``io.NodeOutput`` or a plain tuple)."""
    return out.result[0] if hasattr(out, "result") else out[0]


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (same shapes, any device)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30))


def on_device(device: torch.device, key: str) -> bool:
    """Whether a tensor on ``device`` lives on the device an engine key names. CUDA: the same GPU. CPU keys
    ("cpu", "cpu:1": ComfyUI's MultiGPU on the CPU) share one memory: only the type can be compared."""
    want = torch.device(key)
    if want.type == "cpu":
        return device.type == "cpu"
    index = want.index if want.index is not None else torch.cuda.current_device()
    return device.type == want.type and device.index == index


def entry_tensors(entry) -> list[torch.Tensor]:
    """The tensors of a cache Entry (engine/cache.py): its selection's and its residual's."""
    out = list(entry.selection.tensors())
    if entry.residual is not None:
        out.extend(entry.residual.tensors())
    return out


class CacheWatch:
    """Watches every engine cache while active: ``SelectionCache.put`` and ``.get`` are wrapped to record
    the tensors that enter and leave each cache (and the thread), and ``DeviceEngines.end_run`` to look at
    what each engine's cache holds just before the run frees it. ``report(engines)`` checks them against
    each engine's device key."""

    def __init__(self, cache_cls, engines_cls):
        self.cache_cls, self.engines_cls = cache_cls, engines_cls
        self.lock = threading.Lock()
        self.events: dict[int, list] = {}  # id(cache) -> [(op, thread, [tensor devices])]
        self.violations: dict[int, list] = {}  # id(cache) -> [text]
        self.resident: dict[int, dict] = {}  # id(cache) -> {"device": entries, "cpu": entries}

    def reset(self) -> None:
        with self.lock:
            self.events, self.violations, self.resident = {}, {}, {}

    def __enter__(self):
        watch = self
        put, get, end_run = self.cache_cls.put, self.cache_cls.get, self.engines_cls.end_run
        self._saved = (put, get, end_run)

        def put_watched(cache, key, entry):
            where = put(cache, key, entry)
            watch._note(cache, "put", key, entry_tensors(entry))
            return where

        def get_watched(cache, key, device):
            entry = get(cache, key, device)
            if entry is not None:
                watch._note(cache, "get", key, entry_tensors(entry))
            return entry

        def end_run_watched(engines):
            for k, eng in engines.engines().items():
                watch._inspect(k, eng.cache)
            return end_run(engines)
        self.cache_cls.put, self.cache_cls.get, self.engines_cls.end_run = put_watched, get_watched, end_run_watched
        return self

    def __exit__(self, *exc):
        self.cache_cls.put, self.cache_cls.get, self.engines_cls.end_run = self._saved
        return False

    def _note(self, cache, op, key, tensors) -> None:
        with self.lock:
            self.events.setdefault(id(cache), []).append(
                (op, threading.current_thread().name, [t.device for t in tensors], key[:1]))

    def _inspect(self, engine_key: str, cache) -> None:
        bad, counts = [], {"device": 0, "cpu": 0}
        for where, store in (("device", cache.on_device), ("cpu", cache.on_cpu)):
            for key, entry in list(store.items()):
                counts[where] += 1
                for t in entry_tensors(entry):
                    ok = on_device(t.device, engine_key) if where == "device" else t.device.type == "cpu"
                    if not ok:
                        bad.append(f"held ({where}) layer {key[:1]} on {t.device}")
        with self.lock:
            self.resident[id(cache)] = counts
            self.violations.setdefault(id(cache), []).extend(bad)

    def report(self, engines: dict) -> tuple[bool, dict]:
        """(every engine's cache stayed on its device, per device key: puts, gets, threads, entries held at the
        end of the run on the device / in host memory, the first violations)."""
        out, ok = {}, True
        with self.lock:
            for key, eng in sorted(engines.items()):
                cid = id(eng.cache)
                events = self.events.get(cid, [])
                bad = list(self.violations.get(cid, []))
                for op, thread, devices, layer in events:
                    bad.extend(f"{op} layer {layer} on {d} (thread {thread})" for d in devices
                               if not on_device(d, key))
                out[key] = dict(puts=sum(e[0] == "put" for e in events), gets=sum(e[0] == "get" for e in events),
                                threads=sorted({e[1] for e in events}), held_at_end=self.resident.get(cid),
                                violations=bad[:10], n_violations=len(bad))
                ok = ok and not bad and cid in self.resident
        return ok, out


def engines_summary(patch) -> dict:
    """The engines of the patch's last run by device key: calls by kind and cache peaks (MiB)."""
    out = {}
    for key, eng in sorted(patch.last_run.engines.engines().items()):
        st = eng.last_stats
        t = st.totals()
        out[key] = dict(calls=t["calls"], dense=t["dense"], anchors=t["anchors"], reuses=t["reuses"],
                        fallbacks=t["fallbacks"], density=t["density"],
                        cache_gpu_mib=st.cache.get("peak_device_bytes", 0) / 2**20,
                        cache_cpu_mib=st.cache.get("peak_cpu_bytes", 0) / 2**20)
    return out


def bench_model(name, args, patch_mod, presets, eng, devices, clock, emit):
    """One model: the runs of the module docstring, each emitted as a row; returns the comparison row."""
    import comfy.model_management as mm
    from comfy_extras.nodes_multigpu import MultiGPUCFGSplitNode

    from _pack import load
    cache_cls = load("engine.cache").SelectionCache

    primary, second = devices
    tiny = primary.type == "cpu"
    t = time.perf_counter()
    model, latent, pos, neg, cfg, preset_name, _ = e2e.build(name, tiny, primary)
    t_build = time.perf_counter() - t
    if cfg <= 1.0:
        raise ValueError(f"--models: {name} samples with CFG {cfg:g}: there is no uncond to split")
    builds = []

    def rebuild(*_, **__):  # ComfyUI's deepclone_multigpu calls this for the second GPU's model
        builds.append(1)
        return e2e.build(name, tiny, primary, offload=not tiny)[0]  # from host memory, as from a checkpoint
    model.cached_patcher_init = (rebuild, ())
    preset = presets.load_preset(preset_name)
    sparse_cfg = preset.replace(method=args.method or preset.method, density=args.density or preset.density,
                                warmup_steps=0, anchor_steps=eng.AnchorSchedule(),
                                min_tokens=0 if tiny else preset.min_tokens, backend="auto")
    mode = f"{sparse_cfg.method}@{sparse_cfg.density:g}"
    watch = CacheWatch(cache_cls, eng.DeviceEngines)
    outs: dict[tuple[int, str], torch.Tensor] = {}

    def run(gpus, kind, m, steps, patch=None, note=""):
        row = dict(model=name, gpus=gpus, mode=kind if kind == "dense" else mode, steps=steps, note=note)
        watch.reset()
        with watch:
            times, peaks, out = e2e.sample_timed(m, latent, pos, neg, cfg, steps, list(devices))
        row.update(step_s=times, first_s=times[0], later_s=e2e.median(times[1:]) if len(times) > 1 else None,
                   peak_gb={k: v / 2**30 for k, v in peaks.items()}, finite=bool(torch.isfinite(out).all()))
        if patch is not None:
            engines = patch.last_run.engines.engines()
            row["engines"] = engines_summary(patch)
            row["cache_on_own_device"], row["cache_check"] = watch.report(engines)
            row["fallbacks"] = dict(patch.fallbacks)
        outs[(gpus, kind)] = out
        emit(row)
        log.info("%s %d GPU(s) %s: step 0 %.3f s, later %s s, peak %s GB%s", name, gpus, row["mode"], times[0],
                 "–" if row["later_s"] is None else f"{row['later_s']:.3f}",
                 {k: round(v, 1) for k, v in row["peak_gb"].items()},
                 f", engines {row['engines']}, cache on own device: {row['cache_on_own_device']}"
                 if patch is not None else "")
        return row

    def skip(gpus, kind, why):
        emit(dict(model=name, gpus=gpus, mode=kind if kind == "dense" else mode, skipped=why))
        log.warning("%s %d GPU(s) %s skipped: %s", name, gpus, kind, why)

    # one GPU: load and record the self-attention shapes (1 dense step), compile, then sparse and dense
    shapes: list = []
    t = time.perf_counter()
    e2e.sample_timed(e2e.with_override(model, e2e.shape_recorder(shapes)), latent, pos, neg, cfg, 1, list(devices))
    first = time.perf_counter() - t
    steps = args.steps or (2 if first > args.long_step_s else 4)
    (shape, dtype) = max(shapes, key=lambda s: s[0][2])
    log.info("%s: built in %.1f s, first dense step %.1f s (with loading), self-attention %s; %d steps per run",
             name, t_build, first, shape, steps)
    t = time.perf_counter()
    for dev, batch in ((primary, shape[0]), (primary, 1), (second, 1)):
        if dev.type == "cuda":
            with torch.cuda.device(dev):
                e2e.prewarm(eng, sparse_cfg, (batch,) + tuple(shape[1:]), dtype, dev)
        elif dev == primary:
            e2e.prewarm(eng, sparse_cfg, (batch,) + tuple(shape[1:]), dtype, dev)
    log.info("%s %s: kernels ready in %.1f s", name, mode, time.perf_counter() - t)
    patched, patch = patch_mod.install(model, sparse_cfg)
    one_step = first  # a dense step with loading: an upper bound for a step of any run below
    for kind, m, p in (("sparse", patched, patch), ("dense", model, None)):
        if clock.left() < one_step * (steps + 1):
            skip(1, kind, "the time budget is spent")
            continue
        run(1, kind, m, steps, p)

    # two GPUs: MultiGPU CFG Split (its clone for the second GPU is built and loaded by the first split run)
    if clock.left() < t_build + one_step * (2 * steps + 3):
        for kind in ("sparse", "dense"):
            skip(2, kind, "the time budget is spent")
    else:
        split_dense = node_model(MultiGPUCFGSplitNode.execute(model, 2))
        extra = [str(m.load_device) for m in split_dense.get_additional_models_with_key("multigpu")]
        if extra != [str(second)]:
            raise RuntimeError(f"MultiGPU CFG Split chose {extra} for the second device, expected {str(second)}")
        t = time.perf_counter()
        e2e.sample_timed(split_dense, latent, pos, neg, cfg, 1, list(devices))
        log.info("%s: split model loaded and warmed in %.1f s (%d clone(s) built)", name, time.perf_counter() - t,
                 len(builds))
        split_sparse = node_model(MultiGPUCFGSplitNode.execute(patched, 2))
        for kind, m, p in (("sparse", split_sparse, patch), ("dense", split_dense, None)):
            if clock.left() < one_step * (steps + 1):
                skip(2, kind, "the time budget is spent")
                continue
            run(2, kind, m, steps, p, note=f"second GPU's model built {len(builds)} time(s)")

    # comparison: two GPUs against one, per mode
    tol = args.tol if args.tol is not None else (1e-4 if tiny else 1e-2)
    cmp = dict(model=name, mode="compare", sparse_mode=mode, steps=steps)
    for kind in ("sparse", "dense"):
        if (1, kind) in outs and (2, kind) in outs:
            cmp[f"{kind}_rel_l2"] = rel_l2(outs[(2, kind)], outs[(1, kind)])
    if (1, "sparse") in outs and (1, "dense") in outs:
        cmp["sparse_vs_dense_rel_l2"] = rel_l2(outs[(1, "sparse")], outs[(1, "dense")])
    if "sparse_rel_l2" in cmp:
        cmp["tolerance"] = max(tol, 3 * cmp.get("dense_rel_l2", 0.0))
        cmp["sparse_equal_within_tolerance"] = cmp["sparse_rel_l2"] <= cmp["tolerance"]
    emit(cmp)
    log.info("%s: %s", name, {k: v for k, v in cmp.items() if k not in ("model", "mode")})
    outs.clear()
    del model, patched
    mm.soft_empty_cache()
    return cmp


def render(rows, meta) -> str:
    def f(v, fmt):
        return "–" if v is None else format(v, fmt)
    lines = [meta, "", "| model | GPUs | mode | steps | step 0 s | later steps s (median) | peak GB per GPU | engines "
             "(device: anchors/reuses/dense) | cache on own device |", "|---|---|---|---|---|---|---|---|---|"]
    compares = []
    for r in rows:
        if r.get("mode") == "compare":
            compares.append(r)
            continue
        if "skipped" in r:
            lines.append(f"| {r['model']} | {r['gpus']} | {r['mode']} | skipped: {r['skipped']} ||||||")
            continue
        peaks = ", ".join(f"{k} {v:.1f}" for k, v in r["peak_gb"].items())
        engines = ", ".join(f"{k}: {e['anchors']}/{e['reuses']}/{e['dense']}" for k, e in r.get("engines", {}).items())
        check = "–" if "cache_on_own_device" not in r else ("yes" if r["cache_on_own_device"] else "**no**")
        lines.append(f"| {r['model']} | {r['gpus']} | {r['mode']} | {r['steps']} | {r['first_s']:.3f} | "
                     f"{f(r['later_s'], '.3f')} | {peaks} | {engines or '–'} | {check} |")
    if compares:
        lines += ["", "| model | sparse mode | rel-L2 sparse, 2 GPUs vs 1 | rel-L2 dense, 2 GPUs vs 1 | tolerance | "
                  "sparse equal | rel-L2 sparse vs dense (1 GPU) |", "|---|---|---|---|---|---|---|"]
        for c in compares:
            eq = c.get("sparse_equal_within_tolerance")
            lines.append(f"| {c['model']} | {c['sparse_mode']} | {f(c.get('sparse_rel_l2'), '.2e')} | "
                         f"{f(c.get('dense_rel_l2'), '.2e')} | {f(c.get('tolerance'), '.1e')} | "
                         f"{'–' if eq is None else 'yes' if eq else '**no**'} | "
                         f"{f(c.get('sparse_vs_dense_rel_l2'), '.2e')} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="wan13b,wan14b")
    ap.add_argument("--method", default="", help="sparse method (default: the model's preset's)")
    ap.add_argument("--density", type=float, default=0.0, help="density (default: the model's preset's)")
    ap.add_argument("--steps", type=int, default=0, help="steps of every timed run (default: 4, or 2 when a dense "
                    "step takes longer than --long-step-s)")
    ap.add_argument("--long-step-s", type=float, default=5.0)
    ap.add_argument("--tol", type=float, default=None, help="relative L2 the sparse pair may differ by at least "
                    "(default 1e-2 on GPUs in bf16, 1e-4 with --cpu-devices in fp32)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip runs that would not finish in this time")
    ap.add_argument("--cpu-devices", action="store_true", help="tiny models on the CPU, device keys cpu and cpu:1")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    cpu = args.cpu_devices
    if not cpu and torch.cuda.device_count() < 2:
        raise SystemExit(f"two GPUs needed, {torch.cuda.device_count()} visible (--cpu-devices runs on the CPU)")
    devices = [torch.device("cpu"), torch.device("cpu", 1)] if cpu else [torch.device("cuda", 0),
                                                                          torch.device("cuda", 1)]
    patch_mod, presets, eng = e2e.comfy_setup(cpu=cpu)
    import importlib.util

    import comfy.model_management as mm
    if importlib.util.find_spec("comfy.multigpu") is None:
        raise SystemExit("this ComfyUI has no MultiGPU CFG Split (ComfyUI 0.33.0 or later)")
    if cpu:  # ComfyUI lists no devices beside the CPU: the second key stands for a second GPU
        mm.get_all_torch_devices = lambda exclude_current=False: list(devices)
    clock = e2e.Clock(args.budget_s)
    names = ", ".join(torch.cuda.get_device_name(d) for d in devices) if not cpu else "cpu (device keys cpu, cpu:1)"
    alloc = f", allocator {torch.cuda.get_allocator_backend()}" if not cpu else ""
    meta = f"devices {names}, torch {torch.__version__}{alloc}, {time.strftime('%Y-%m-%d %H:%M')}"
    rows, emit = e2e.row_writer(Path(args.out), "multigpu", meta, render)
    for name in args.models.split(","):
        bench_model(name, args, patch_mod, presets, eng, devices, clock, emit)
    sys.stdout.write(render(rows, meta))


if __name__ == "__main__":
    main()
