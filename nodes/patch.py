"""The model patch: an attention override that hands long self-attention to the engine.

Installed on ``model.clone()`` as ``transformer_options["optimized_attention_override"]``. Each call is
translated (nodes/call.py), given its per-forward facts (nodes/forward.py) and passed to the engine of its
sampling run and device, which decides; the calls it does not take run the override installed before ours
(SageAttention, another pack) or the model's own ``func``, with their arguments untouched. ComfyUI
callbacks/wrappers (keyed, so removing the node removes them) open a run at the start of each sampling run and
free it at the end, record each forward's facts, and re-assert the override before every model evaluation.

State lives per sampling run (``SamplingRun``, stored in that run's own ``transformer_options``): clones of a
patched model share the patch object (ComfyUI deep-copies model options on clone and the patch copies as
itself), but two samplers never share caches. Within a run, each device has its own engine (ComfyUI's MultiGPU
CFG Split runs cond and uncond on different GPUs in threads). Under ``torch.compile`` the override is one
graph break (``torch.compiler.disable``): it runs eagerly with the live options of every call, so nothing the
engine decides is baked into a graph and no step recompiles (docs/reliability.md).
"""

from __future__ import annotations

import collections
import contextlib
import gc
import importlib
import logging
import sys
import threading

import torch

from ..engine import DeviceEngines, RunClock, SparseConfig
from ..engine.device_pool import async_pool, trim_pool
from ..engine.messages import oom_report
from ..engine.schedule import reuse_steps
from .call import carries_mask, translate
from .families import UNKNOWN, Family, family_of
from .forward import INFO_KEY, Forward, StepCounter, run_sigmas
from .run_clock import called_by_ksampler, clock_for

log = logging.getLogger(__name__)

KEY = "sparse_attention"
OVERRIDE = "optimized_attention_override"
RUN_KEY = "sparse_attention_run"
CHAINED = "sparse_attention_chained"  # an override installed after ours on this model, run for our dense calls
MULTIGPU_DEVICE = "multigpu_thread_device"  # set by ComfyUI's MultiGPU worker threads in transformer_options
_not_compiled = getattr(getattr(torch, "compiler", None), "disable", None) or (lambda fn: fn)


def interrupting(exc: BaseException) -> bool:
    """True for ComfyUI's interruption (the user pressed cancel): it must reach the sampler, never go dense."""
    mm = sys.modules.get("comfy.model_management")
    cls = getattr(mm, "InterruptProcessingException", None)
    return cls is not None and isinstance(exc, cls)


# ComfyUI's samplers whose reports do not count the schedule's steps: dpm_fast and dpm_adaptive step on a grid of
# their own between its first and last sigma (comfy/samplers.py, ``ksampler``); ar_video (Causal-WAN, ComfyUI 0.33.0)
# runs the whole schedule once per frame block and reports a step scaled over all blocks
OWN_STEP_SAMPLERS = frozenset({"dpm_fast_function", "dpm_adaptive_function", "sample_ar_video"})


def _with_progress(run: SamplingRun, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The OUTER_SAMPLE arguments with the sampler's callback (``callback``, the sixth: ``callback(step, x0, x,
    total_steps)`` after each step, ComfyUI's previews and progress bar) wrapped to count the steps the sampler
    finished in ``run.done`` (a step number reported twice in a row counts once); a sampler given no callback gets
    one that only counts. The run steps of the calls
    after them then follow the count from the run's first step, whatever sigma the model is handed
    (nodes/forward.py, ``Forward``; docs/method.md, "Schedule")."""
    if len(args) > 5:
        callback = args[5]
    elif "callback" in kwargs:
        callback = kwargs["callback"]
    else:
        return args, kwargs  # a guider whose outer_sample takes no callback: steps by the sigmas alone
    sampler = args[2] if len(args) > 2 else kwargs.get("sampler")
    if getattr(getattr(sampler, "sampler_function", None), "__name__", "") in OWN_STEP_SAMPLERS:
        return args, kwargs

    last = []

    def noted(*a, **kw):  # counted, not read: node packs pass their own step numbers (RES4LYF counts unsample's down)
        step = a[0] if a else kw.get("step")
        if not (last and isinstance(step, int) and step == last[-1]):  # a step reported again is one step (RES4LYF
            run.done = (run.done or 0) + 1  # reports each implicit iteration, and the last step once more)
        last[:] = [step]
        return None if callback is None else callback(*a, **kw)
    if len(args) > 5:
        return args[:5] + (noted,) + args[6:], kwargs
    return args, {**kwargs, "callback": noted}


RECENT_RUNS = 8  # finished runs a Report node can find by the latent it is given (SparseAttentionPatch.run_for)


def latent_fingerprint(latent) -> tuple | None:
    """(elements, sum, sum of squares, precision) of a sampler's output: a torch tensor, or a NestedTensor of several
    (ComfyUI 0.33.0 packs several latents into one flat tensor while sampling and hands the node their nested view:
    the same values in another shape). Sums in float64 on the CPU (MPS has no float64); the precision is the dtype's
    epsilon (at least 1e-6), since the node may get a copy cast to ComfyUI's intermediate dtype (fp16 or bf16
    intermediates). None for anything else or shape-only tensors."""
    try:
        parts = getattr(latent, "tensors", None)
        tensors = list(parts) if parts is not None else [latent]
        if not tensors or not all(isinstance(t, torch.Tensor) and t.device.type != "meta" for t in tensors):
            return None
        eps = max([1e-6] + [torch.finfo(t.dtype).eps for t in tensors if t.is_floating_point()])
        flat = [t.detach().to("cpu").double() for t in tensors]
        return (sum(t.numel() for t in flat), sum(float(t.sum()) for t in flat),
                sum(float(t.square().sum()) for t in flat), eps)
    except Exception:  # noqa: BLE001 - a latent type of another node pack: the report falls back to the last run
        return None


def latent_distance(a: tuple, b: tuple) -> float:
    """How far apart two latent_fingerprint values are, in units of the coarser dtype's rounding: at most 1 for the
    same latent (each element within one epsilon, the sums within two); inf for other element counts. Two runs'
    outputs are usually far apart; runs that all but coincide can both come within 1, and the nearest is the one."""
    (n, s, q, e), (n2, s2, q2, e2) = a, b
    if n != n2:
        return float("inf")
    eps = 2 * max(e, e2)
    return max(abs(q - q2) / (eps * q + 1e-30), abs(s - s2) / (eps * (q * n) ** 0.5 + 1e-30))


class SamplingRun:
    """One sampling run of a patched model: its engines (one per device), where it sits in the whole denoising
    run (``clock``), the step counter of samplers without a sigma schedule, the dense fallbacks by reason and
    the report's pictures. Thread-safe. Copies as itself (ComfyUI copies the options that carry it)."""

    def __init__(self, cfg: SparseConfig, clock: RunClock | None):
        self.cfg = cfg
        self.engines = DeviceEngines(cfg)
        self.clock = clock
        self.counter = StepCounter()
        self.fallbacks: dict[str, int] = {}
        self.layouts: dict[tuple[str, str], int] = {}  # (stream, layout) -> self-attention calls
        self.snapshots: dict[int, dict] = {}
        self.stats = None
        self.dense_reason: str | None = None  # set when the whole run is better dense (SparseAttentionPatch._no_reuse)
        self.done: int | None = None  # steps the sampler reported finished through its callback (None: none yet)
        self.first: int | None = None  # the run step of its first call (what `done` counts from)
        self.miscounted: set = set()  # reported steps a call's schedule sigma did not fit; from 2: steps by sigma alone
        self.forwards = 0  # model forwards of this run (APPLY_MODEL) ...
        self.reached = 0  # ... and attention calls that reached the override: none from many forwards means a node
        # replaced the model's forward without passing transformer_options on (TeaCache, MagCache)
        self.lock = threading.Lock()

    def __deepcopy__(self, memo):
        return self

    def engine_for(self, q: torch.Tensor, transformer_options: dict):
        """The engine of the device this call runs on (ComfyUI's MultiGPU worker device when set, else q's)."""
        device = transformer_options.get(MULTIGPU_DEVICE)
        return self.engines.engine(str(device if device is not None else q.device))

    def count(self, reason: str) -> None:
        with self.lock:
            self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1

    def snapshot(self, engine, ctx, n: int) -> None:
        """Keep a small picture of each layer's first selection of the run (for the report node)."""
        if ctx.layer in self.snapshots:
            return
        with engine.lock:
            entry = engine.cache.peek(ctx.key(n))
            picture = None if entry is None else entry.selection.picture(n)
        if picture is not None:
            with self.lock:
                self.snapshots.setdefault(ctx.layer, picture)

    def finish(self):
        """End the run: free every engine's cache, keep and return the merged statistics."""
        self.stats = self.engines.end_run()
        return self.stats

    @property
    def unreached(self) -> bool:
        """The model ran forwards and not one attention call of them reached the pack."""
        return self.forwards > 0 and self.reached == 0


class SparseAttentionPatch:
    """Callable override: configuration, the previous override, the family, and the sampling runs.

    ``copy.deepcopy`` returns the object itself (older ComfyUI deep-copies model options on clone), so every
    clone of the patched model shares this object; what a run computes lives in its ``SamplingRun``. The
    report reads the finished run whose sampler returned its samples (``run_for``), with that run's own
    configuration (``cfg_for``: the Preset node's `auto` may give a short run another preset).
    """

    def __init__(self, cfg: SparseConfig, previous=None, family: Family | None = None,
                 layer_offsets: dict[str, int] | None = None, by_steps: tuple = ()):
        self.cfg = cfg
        self.by_steps = tuple(by_steps)  # ((most run steps, SparseConfig, preset name), ...): ``cfg_for``
        self.previous = previous
        self.family = family if family is not None else UNKNOWN
        self.layer_offsets = dict(layer_offsets or {})
        self.runs = 0
        self.last_run: SamplingRun | None = None
        self.recent: collections.deque = collections.deque(maxlen=RECENT_RUNS)  # (latent fingerprint, finished run)
        self.idle = SamplingRun(cfg, None)  # calls made outside any sampling run this patch saw begin
        self._active: list[SamplingRun] = []  # runs in progress, oldest first
        self._lock = threading.Lock()
        self._logged: set[str] = set()
        self.error_messages: dict[str, str] = {}  # the first message of each kind of error of ours (``_error``)
        self._local = threading.local()  # .dense: this thread is inside one of our dense calls

    def __deepcopy__(self, memo):
        return self

    # what the report shows: the last finished run ------------------------------------------------------
    @property
    def last_stats(self):
        return None if self.last_run is None else self.last_run.stats

    @property
    def fallbacks(self) -> dict[str, int]:
        return {} if self.last_run is None else dict(self.last_run.fallbacks)

    @property
    def snapshots(self) -> dict[int, dict]:
        return {} if self.last_run is None else self.last_run.snapshots

    @property
    def layouts(self) -> dict[tuple[str, str], int]:
        return {} if self.last_run is None else dict(self.last_run.layouts)

    @property
    def clock(self) -> RunClock | None:
        return None if self.last_run is None else self.last_run.clock

    def run_for(self, latent) -> tuple[SamplingRun | None, bool]:
        """(run, matched): of the last RECENT_RUNS finished runs, the one whose sampler returned ``latent`` (its
        values: the sampler's output tensor, or ComfyUI's NestedTensor of several; the nearest within the dtype's
        rounding, ``latent_distance``), else the last run and False; the last run and True when there is nothing to
        compare. Two samplers of one patched model (a second pass, two stages) each get a report of their own even
        when ComfyUI re-runs only the Report node."""
        key = latent_fingerprint(latent)
        with self._lock:
            if key is None or not self.recent:  # nothing to compare: no claim either way
                return self.last_run, True
            near = [(latent_distance(fingerprint, key), -i, run) for i, (fingerprint, run) in enumerate(self.recent)]
        distance, _, run = min(near, key=lambda x: x[:2])  # the nearest; of equals, the newest
        return (run, True) if distance <= 1 else (self.last_run, False)

    def cache_bytes(self) -> int:
        """Bytes cached by the runs in progress and by calls outside a run (0 once every run has ended)."""
        with self._lock:
            runs = [self.idle, *self._active]
        return sum(r.engines.cache_bytes for r in runs)

    def run_of(self, transformer_options: dict) -> SamplingRun:
        """The run a call belongs to: the one its options carry, else the newest run in progress, else idle."""
        run = transformer_options.get(RUN_KEY)
        if isinstance(run, SamplingRun):
            with self._lock:
                if run in self._active:
                    return run
        with self._lock:
            return self._active[-1] if self._active else self.idle

    # dense path ------------------------------------------------------------------------------------
    def _dense(self, func, args, kwargs, transformer_options: dict):
        """The dense call: the override chained on this model's options (installed after ours), else the one
        installed before ours, else the model's own attention."""
        chained = transformer_options.get(CHAINED, self.previous)
        if chained is None:
            return func(*args, **kwargs)
        self._local.dense = True
        try:
            return chained(func, *args, **kwargs)
        finally:
            self._local.dense = False

    def _fallback(self, run: SamplingRun, reason: str, func, args, kwargs):
        run.count(reason)
        self._log_once(reason, "sparse attention: dense for %s (logged once)", reason)
        return self._dense(func, args, kwargs, kwargs.get("transformer_options") or {})

    def _log_once(self, key: str, msg: str, *args, level=logging.INFO) -> None:
        with self._lock:
            if key in self._logged:
                return
            self._logged.add(key)
        log.log(level, msg, *args)

    # the override ----------------------------------------------------------------------------------
    @_not_compiled
    def __call__(self, func, *args, **kwargs):
        """ComfyUI's override contract (nodes/call.py). Whatever goes wrong on our side (reading the call, the
        engine, the report's picture) never fails the run: the call goes dense, counted and logged once; only
        ComfyUI's interruption passes through."""
        if getattr(self._local, "dense", False):
            # an override we chain that itself calls the override it found (ours) for this dense call
            return func(*args, **kwargs)
        to = kwargs.get("transformer_options") or {}
        run = self.run_of(to)
        run.reached += 1  # only compared with 0: no lock needed
        try:
            plan = self._plan(run, args, kwargs, to)
        except Exception as exc:  # a layout or call this pack cannot read
            if interrupting(exc):
                raise
            plan = self._error("an error reading the call", exc)
        if isinstance(plan, str):
            return self._fallback(run, plan, func, args, kwargs)
        call, ctx, engine = plan
        q, k, v = call.q, call.k, call.v  # grouped-query k/v as they are: the engine repeats them for sparse calls
        nq = q.shape[2]

        def dense_fn(dq, dk, dv):
            kw = dict(kwargs)
            kw.update(skip_reshape=True, skip_output_reshape=True)
            kw.pop("mask", None)
            kw.pop("heads", None)
            return self._dense(func, (dq, dk, dv, call.heads), kw, to)

        try:
            out = engine.attend(q, k, v, ctx, scale=kwargs.get("scale"), dense_fn=dense_fn)
        except Exception as exc:  # out of memory, a backend refusing the case, a bug: never fail the run
            if interrupting(exc):
                raise
            # this call goes dense, and its layer for the rest of the run; counted, reported, logged once
            kind = self._error("an engine error", exc)
            engine.give_up(ctx, nq)
            return self._fallback(run, kind, func, args, kwargs)
        try:
            run.snapshot(engine, ctx, nq)
        except Exception as exc:  # the report's picture only
            if interrupting(exc):
                raise
            self._error("an error drawing the report's picture", exc)
        return call.output(out)

    def _plan(self, run: SamplingRun, args, kwargs, to: dict):
        """(call, ctx, engine) for a call the engine takes, or the reason the call runs dense."""
        if run.dense_reason is not None:
            return run.dense_reason
        forward = to.get(INFO_KEY)
        layer = forward.next_layer(to, args, kwargs) if forward is not None else None
        noop = carries_mask(args, kwargs) and forward is not None and forward.mask_is_noop()
        call = translate(args, kwargs, ignore_mask=noop)
        if isinstance(call, str):
            return call
        q, k = call.q, call.k
        nq = q.shape[2]
        ctx = forward.context(layer, nq, to) if layer is not None else None
        engine = run.engine_for(q, to)
        reason = engine.skip_reason(ctx, nq, k.shape[2], q.shape[-1])
        if reason is None and ctx is None:  # the family says a self-shaped call is cross-attention (LTX-2 a2v)
            reason = "cross-attention" if forward is not None else "calls outside a tracked forward"
        return reason if reason is not None else (call, ctx, engine)

    def _error(self, what: str, exc: Exception) -> str:
        """Log an error of ours once per kind (a warning with its message); returns the kind for the report."""
        kind = f"{what} ({type(exc).__name__})"
        first = str(exc).splitlines()[0][:300] if str(exc) else ""
        self.error_messages.setdefault(kind, first)  # the report shows it beside the count
        self._log_once(kind, "sparse attention: %s: %s", kind, first, level=logging.WARNING)
        return kind

    # lifecycle (ComfyUI callbacks and wrappers) -------------------------------------------------------
    def outer_sample(self, executor, *args, **kwargs):
        """OUTER_SAMPLE wrapper: one sampling run; place it in the whole denoising run and check the schedule
        against it (before any step runs), open its state in the run's own options, free and report after."""
        sigmas = args[3] if len(args) > 3 else kwargs.get("sigmas")
        # the sampler settles a split's schedule only under KSampler, the one node that drops a penultimate sigma
        sampler = (args[2] if len(args) > 2 else kwargs.get("sampler")) if called_by_ksampler() else None
        clock = self._locate(executor, sigmas, sampler)
        cfg = self.cfg_for(clock)
        self._check_schedule(clock, cfg)
        run = SamplingRun(cfg, clock)
        run.dense_reason = self._no_reuse(clock, sigmas, cfg)
        options = _run_options(executor)
        outer = None if options is None else options.get(RUN_KEY, None)
        if options is not None:
            options[RUN_KEY] = run
            self.reassert(options)  # an override installed after ours is chained from the first step
        with self._lock:
            self._active.append(run)
        args, kwargs = _with_progress(run, args, kwargs)
        fingerprint = None
        try:
            out = executor(*args, **kwargs)
            fingerprint = latent_fingerprint(out)
            return out
        finally:
            if options is not None:
                if outer is None:
                    options.pop(RUN_KEY, None)
                else:
                    options[RUN_KEY] = outer
            stats = run.finish()
            if run.unreached:
                self._log_once("unreached", "sparse attention: %d model forwards and not one attention call reached "
                               "the pack: most likely a node replaced the model's forward without passing "
                               "transformer_options on (TeaCache and MagCache do), so attention ran dense. ComfyUI's "
                               "own EasyCache and LazyCache work with the pack", run.forwards, level=logging.WARNING)
            with self._lock:
                self._active.remove(run)
                self.last_run = run
                if fingerprint is not None:
                    self.recent.append((fingerprint, run))
                self.runs += 1
            log.info(stats.summary_line())

    def _locate(self, executor, sigmas, sampler=None) -> RunClock:
        """The run clock of this sampler (nodes/run_clock.py); ``sampler`` (ComfyUI's KSAMPLER) tells a split of a
        schedule that drops its penultimate sigma (uni_pc, dpm_2) from a plain one."""
        try:
            ms = executor.class_obj.model_patcher.get_model_object("model_sampling")
        except Exception:  # noqa: BLE001 - a guider without a model patcher: the sampler's own steps
            ms = None
        return clock_for(sigmas, ms, sampler=sampler)

    def cfg_for(self, clock: RunClock) -> SparseConfig:
        """The configuration of a sampling run: the first of ``by_steps`` whose step count the run's does not
        exceed (the Preset node's `auto` on a distilled 4- or 8-step run), else the patch's own."""
        total = clock.total if clock is not None else None
        for most, cfg, name in self.by_steps:
            if total is not None and total <= most:
                self._log_once(f"by-steps {name}", "sparse attention: auto: a %d-step run takes the preset %s",
                               total, name)
                return cfg
        return self.cfg

    def _no_reuse(self, clock: RunClock, sigmas, cfg: SparseConfig) -> str | None:
        """Why this sampler runs dense when its steps hold no reuse step, else None. With the residual on, an anchor
        computes the dense output and more (1.1-1.3x a dense call; docs/benchmarks.md), and its output is the dense
        one: a sampler whose every sparse step anchors (a short second stage, a 1- or 2-step part of a split, a
        many-step preset on a few-step run) is faster dense, with the same picture. Policies that select afresh at
        every step, or runs without the residual, do not compute the dense output and keep their sparse steps."""
        if not cfg.residual or cfg.select_every_step or cfg.method == "dense" or clock.total is None:
            return None
        # the sampler's steps, without the zeros RES4LYF pads its sigmas with (nodes/forward.py, run_sigmas)
        steps = len(run_sigmas(sigmas.reshape(-1).tolist())) - 1 if isinstance(sigmas, torch.Tensor) else 0
        if steps < 1 or reuse_steps(cfg.anchor_steps, cfg.warmup_steps, clock.offset, steps, clock.total) > 0:
            return None
        reason = "a sampler with no reuse step (every sparse step would anchor, costing more than dense)"
        self._log_once(reason, "sparse attention: this sampler's %d steps (run steps %d-%d of %d) hold no reuse step "
                       "under anchors %s: it runs dense, which gives the same picture faster", steps, clock.offset,
                       clock.offset + steps - 1, clock.total, cfg.anchor_steps.describe())
        return reason

    def _check_schedule(self, clock: RunClock, cfg: SparseConfig) -> None:
        """Reject, before sampling, anchor steps that lie beyond a run whose length is known exactly."""
        if clock.exact and clock.total is not None:
            beyond = [s for s in cfg.anchor_steps.steps if s >= clock.total]
            if beyond:
                raise ValueError(f"Sparse Attention: anchor_steps: step(s) {beyond[:10]} lie beyond this "
                                 f"{clock.total}-step run (steps count from 0); give them as shares of the run, "
                                 "e.g. '20%, 50%'")

    def apply_model(self, executor, x, t, *args, **kwargs):
        """APPLY_MODEL wrapper: this forward's facts (step, chunk, latent shape, layer counter), computed once."""
        to = args[3] if len(args) > 3 else kwargs.get("transformer_options")
        if isinstance(to, dict):
            run = self.run_of(to)
            trimmed = False
            while True:
                try:
                    return self._forward(run, executor, x, t, args, kwargs, to)
                except torch.OutOfMemoryError as exc:
                    # the model ran out of GPU memory: under cudaMallocAsync, first hand the pool's idle memory back
                    # to the driver and run the forward again (once: engine/device_pool.py); then, if our cache
                    # holds some, move it off the GPU and run the forward once more; a cache must never end a run
                    # (docs/decisions.md, small cards)
                    why = oom_report(exc)  # a string: the exception itself keeps the failed attempt's frames
                    run = self.run_of(to)
                    trim = not trimmed and async_pool(x.device)
                    freed = 0 if trim else run.engines.relieve()
                    if not trim and not freed:
                        raise
                    failed = exc.with_traceback(None)
                # the retries run here, after the except block: inside it the exception's traceback keeps the
                # failed attempt's frames, and with them its activations, on the GPU
                if not trim:
                    break
                trimmed = True
                idle = trim_pool(x.device)  # measured after a collection, the failed attempt's tensors gone
                if idle:
                    run.count("the model ran out of GPU memory: the allocator's idle memory handed back")
                    self._log_once("model-oom-pool", "sparse attention: the model ran out of GPU memory (%s) with "
                                   "%.0f MB idle in the allocator's pool: handed it back to the driver and ran the "
                                   "step again", why, idle / 2**20, level=logging.WARNING)
                    continue
                freed = run.engines.relieve()
                if not freed:
                    raise failed
                break
            run.count("the model ran out of GPU memory: the cache moved to host memory")
            self._log_once("model-oom", "sparse attention: the model ran out of GPU memory (%s); freed %.0f MB of "
                           "cache on the GPU (moved to host memory; prefetching off for the rest of the run) and "
                           "ran the step again (a lower cache_budget_mb avoids this)",
                           why, freed / 2**20, level=logging.WARNING)
            gc.collect()  # frames of the failed attempt caught in reference cycles
            torch.cuda.empty_cache()
            return self._forward(run, executor, x, t, args, kwargs, to)
        return executor(x, t, *args, **kwargs)

    def _forward(self, run, executor, x, t, args, kwargs, to):
        """One forward with its facts made afresh (a retried forward numbers its layers from 0 again)."""
        with run.lock:  # the step counter is shared by the run's worker threads
            run.forwards += 1
            forward = Forward(self.family, x.shape, to, self.layer_offsets, run.clock, run.counter, conds=kwargs,
                              seen=run.layouts, progress=(run.first, None if len(run.miscounted) >= 2 else run.done))
            if run.first is None:
                run.first = forward.step
            if forward.miscounted:
                run.miscounted.add(run.done)
            to[INFO_KEY] = forward
        if self.family.bypass_module is not None:
            with route_module_attention(self.family.bypass_module, to):
                return executor(x, t, *args, **kwargs)
        return executor(x, t, *args, **kwargs)

    def prepare_state(self, patcher, *args):
        """ON_PREPARE_STATE: re-assert the override so a node applied later cannot silently drop it (its override
        is chained for our dense calls). ComfyUI 0.33.0 passes the run's model options, 0.3.75 none (the
        patcher's own)."""
        live = args[1] if len(args) > 1 and isinstance(args[1], dict) else patcher.model_options
        self.reassert(live.setdefault("transformer_options", {}))

    def reassert(self, transformer_options: dict) -> None:
        """Make ours the override of these options; one installed after ours is kept in the same options (never
        on this shared object: another clone must not inherit it) and runs our dense calls."""
        current = transformer_options.get(OVERRIDE)
        if current is self:
            return
        if isinstance(current, SparseAttentionPatch):  # another patch of ours on a clone: chain what it chains
            current = transformer_options.get(CHAINED, current.previous)
        if current is not None and current is not self.previous:
            transformer_options[CHAINED] = current
        transformer_options[OVERRIDE] = self

    def cleanup(self, patcher, *args):
        """ON_CLEANUP: nothing may stay cached between runs. Runs in progress (a clone's sampler) keep theirs:
        each run frees its own state when it ends."""
        self.idle.engines.clear()


def _run_options(executor) -> dict | None:
    """The transformer_options of the sampling run an OUTER_SAMPLE executor belongs to (the guider's per-run
    copy of the model options, which ComfyUI passes down to every model call of the run), or None."""
    options = getattr(getattr(executor, "class_obj", None), "model_options", None)
    if not isinstance(options, dict):
        return None
    to = options.setdefault("transformer_options", {})
    return to if isinstance(to, dict) else None


@contextlib.contextmanager
def route_module_attention(module_name: str, transformer_options: dict):
    """For the duration of one forward of the patched model, make ``module.optimized_attention`` pass this
    forward's ``transformer_options``, so ComfyUI's own override mechanism (and so our patch, chained
    after any other) handles those calls. The module attribute is restored afterwards."""
    module = importlib.import_module(module_name)
    original = module.optimized_attention

    def routed(q, k, v, *args, **kwargs):
        kwargs.setdefault("transformer_options", transformer_options)
        return original(q, k, v, *args, **kwargs)
    module.optimized_attention = routed
    try:
        yield
    finally:
        module.optimized_attention = original


def install(model, cfg: SparseConfig, by_steps: tuple = ()):
    """Clone a ComfyUI ModelPatcher and install the sparse-attention patch on the clone. ``by_steps``: ((most run
    steps, SparseConfig, preset name), ...) taken instead of ``cfg`` by runs that short (``cfg_for``)."""
    import comfy.patcher_extension as pe

    from .memory import install_probe

    install_probe()

    m = model.clone()
    opts = m.model_options.setdefault("transformer_options", {})
    previous = opts.get(OVERRIDE)
    if isinstance(previous, SparseAttentionPatch):
        # re-patching replaces our own earlier patch (its override, chain and wrappers), keeps what it chained
        previous = opts.pop(CHAINED, previous.previous)
        for kind in (pe.WrappersMP.OUTER_SAMPLE, pe.WrappersMP.APPLY_MODEL):
            m.remove_wrappers_with_key(kind, KEY)
        for kind in (pe.CallbacksMP.ON_PREPARE_STATE, pe.CallbacksMP.ON_CLEANUP):
            m.remove_callbacks_with_key(kind, KEY)
    diffusion_model = m.get_model_object("diffusion_model")
    family = family_of(diffusion_model)
    patch = SparseAttentionPatch(cfg, previous=previous, family=family,
                                 layer_offsets=family.layer_offsets(diffusion_model), by_steps=by_steps)
    opts[OVERRIDE] = patch
    m.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, KEY, patch.outer_sample)
    m.add_wrapper_with_key(pe.WrappersMP.APPLY_MODEL, KEY, patch.apply_model)
    m.add_callback_with_key(pe.CallbacksMP.ON_PREPARE_STATE, KEY, patch.prepare_state)
    m.add_callback_with_key(pe.CallbacksMP.ON_CLEANUP, KEY, patch.cleanup)
    log.info("sparse attention: patched a %s model (%s, density %.2f)", family.name, cfg.method, cfg.density)
    return m, patch


def find_patch(model) -> SparseAttentionPatch | None:
    """The patch installed on a ModelPatcher, if any."""
    opts = getattr(model, "model_options", {}).get("transformer_options", {})
    p = opts.get(OVERRIDE)
    return p if isinstance(p, SparseAttentionPatch) else None
