"""The model patch: an attention override that hands long self-attention to the engine.

Installed on ``model.clone()`` as ``transformer_options["optimized_attention_override"]``. Each call is
translated (nodes/call.py), given its per-forward facts (nodes/forward.py) and passed to the engine, which
decides; the calls it does not take run the override installed before ours (SageAttention, another pack) or
the model's own ``func``, with their arguments untouched. ComfyUI callbacks/wrappers (keyed, so removing the
node removes them) reset the engine at the start of each sampling run, free its caches at the end, record
each forward's facts, and re-assert the override before every model evaluation.
"""

from __future__ import annotations

import contextlib
import importlib
import logging


from ..engine import RunClock, SparseConfig, SparseEngine
from .call import translate
from .families import UNKNOWN, Family, family_of
from .forward import INFO_KEY, Forward, StepCounter
from .run_clock import clock_for

log = logging.getLogger(__name__)

KEY = "sparse_attention"
OVERRIDE = "optimized_attention_override"


class SparseAttentionPatch:
    """Callable override state: config, engine, the previous override, counters and the last run's stats.

    ``copy.deepcopy`` returns the object itself (older ComfyUI deep-copies model options on clone),
    so every clone of the patched model shares one engine.
    """

    def __init__(self, cfg: SparseConfig, previous=None, family: Family | None = None,
                 layer_offsets: dict[str, int] | None = None):
        self.cfg = cfg
        self.engine = SparseEngine(cfg)
        self.previous = previous
        self.family = family if family is not None else UNKNOWN
        self.layer_offsets = dict(layer_offsets or {})
        self.fallbacks: dict[str, int] = {}
        self.layouts: dict[tuple[str, str], int] = {}  # (stream, layout) -> self-attention calls, last run
        self.snapshots: dict[int, dict] = {}
        self.runs = 0
        self.last_stats = None
        self.clock: RunClock | None = None  # where the current (or last) sampler sits in the whole run
        self._counter = StepCounter()
        self._logged: set[str] = set()

    def __deepcopy__(self, memo):
        return self

    # dense path ------------------------------------------------------------------------------------
    def _dense(self, func, args, kwargs):
        if self.previous is not None:
            return self.previous(func, *args, **kwargs)
        return func(*args, **kwargs)

    def _fallback(self, reason: str, func, args, kwargs):
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
        if reason not in self._logged:
            self._logged.add(reason)
            log.info("sparse attention: dense for %s (logged once)", reason)
        return self._dense(func, args, kwargs)

    # the override ----------------------------------------------------------------------------------
    def __call__(self, func, *args, **kwargs):
        """ComfyUI's override contract (nodes/call.py)."""
        to = kwargs.get("transformer_options") or {}
        forward = to.get(INFO_KEY)
        layer = forward.next_layer(to, args, kwargs) if forward is not None else None
        call = translate(args, kwargs)
        if isinstance(call, str):
            return self._fallback(call, func, args, kwargs)
        q, k, v = call.q, call.k, call.v
        nq = q.shape[2]
        ctx = forward.context(layer, nq, to) if layer is not None else None
        reason = self.engine.skip_reason(ctx, nq, k.shape[2], q.shape[-1])
        if reason is None and ctx is None:  # the family says a self-shaped call is cross-attention (LTX-2 a2v)
            reason = "cross-attention" if forward is not None else "calls outside a tracked forward"
        if reason is not None:
            return self._fallback(reason, func, args, kwargs)

        def dense_fn(dq, dk, dv):
            kw = dict(kwargs)
            kw.update(skip_reshape=True, skip_output_reshape=True)
            kw.pop("mask", None)
            kw.pop("heads", None)
            return self._dense(func, (dq, dk, dv, call.heads), kw)

        try:
            out = self.engine.attend(q, k, v, ctx, scale=kwargs.get("scale"), dense_fn=dense_fn)
        except (RuntimeError, ValueError) as exc:  # out of memory, a backend refusing the case, ...
            # never fail a sampling run: this call goes dense; the reason is counted and logged once
            kind = f"an engine error ({type(exc).__name__})"
            if kind not in self._logged:
                log.warning("sparse attention: %s: %s", kind, str(exc).splitlines()[0][:300])
            return self._fallback(kind, func, args, kwargs)
        self._snapshot(ctx, nq)
        return call.output(out)

    def _snapshot(self, ctx, n):
        """Keep a small picture of each layer's first selection of the run (for the report node)."""
        if ctx.layer in self.snapshots:
            return
        entry = self.engine.cache.peek(ctx.key(n))
        if entry is not None:
            self.snapshots[ctx.layer] = entry.selection.picture(n)

    # lifecycle (ComfyUI callbacks and wrappers) -------------------------------------------------------
    def outer_sample(self, executor, *args, **kwargs):
        """OUTER_SAMPLE wrapper: one sampling run; place it in the whole denoising run and check the schedule
        against it (before any step runs), reset before, free and report after."""
        sigmas = args[3] if len(args) > 3 else kwargs.get("sigmas")
        self.clock = self._locate(executor, sigmas)
        self._check_schedule(self.clock)
        self._counter = StepCounter()
        self.engine.begin_run()
        self.snapshots = {}
        self.fallbacks = {}
        self.layouts = {}
        try:
            return executor(*args, **kwargs)
        finally:
            self.last_stats = self.engine.end_run()
            self.runs += 1

    def _locate(self, executor, sigmas) -> RunClock:
        """The run clock of this sampler (nodes/run_clock.py)."""
        try:
            ms = executor.class_obj.model_patcher.get_model_object("model_sampling")
        except Exception:  # noqa: BLE001 - a guider without a model patcher: the sampler's own steps
            ms = None
        return clock_for(sigmas, ms)

    def _check_schedule(self, clock: RunClock) -> None:
        """Reject, before sampling, anchor steps that lie beyond a run whose length is known exactly."""
        if clock.exact and clock.total is not None:
            beyond = [s for s in self.cfg.anchor_steps.steps if s >= clock.total]
            if beyond:
                raise ValueError(f"Sparse Attention: anchor_steps: step(s) {beyond} lie beyond this {clock.total}-step "
                                 "run (steps count from 0); give them as shares of the run, e.g. '20%, 50%'")

    def apply_model(self, executor, x, t, *args, **kwargs):
        """APPLY_MODEL wrapper: this forward's facts (step, chunk, latent shape, layer counter), computed once."""
        to = args[3] if len(args) > 3 else kwargs.get("transformer_options")
        if isinstance(to, dict):
            to[INFO_KEY] = Forward(self.family, x.shape, to, self.layer_offsets, self.clock, self._counter,
                                   conds=kwargs, seen=self.layouts)
            if self.family.bypass_module is not None:
                with route_module_attention(self.family.bypass_module, to):
                    return executor(x, t, *args, **kwargs)
        return executor(x, t, *args, **kwargs)

    def prepare_state(self, patcher, *args):
        """ON_PREPARE_STATE: re-assert the override so a node applied later cannot silently drop it;
        an override installed later is kept and chained (used for dense calls)."""
        live = args[1] if len(args) > 1 and isinstance(args[1], dict) else patcher.model_options
        opts = live.setdefault("transformer_options", {})
        current = opts.get(OVERRIDE)
        if current is not self:
            if current is not None and current is not self.previous:
                self.previous = current
            opts[OVERRIDE] = self

    def cleanup(self, patcher, *args):
        """ON_CLEANUP: nothing may stay cached between runs."""
        self.engine.cache.clear()


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


def install(model, cfg: SparseConfig):
    """Clone a ComfyUI ModelPatcher and install the sparse-attention patch on the clone."""
    import comfy.patcher_extension as pe

    m = model.clone()
    opts = m.model_options.setdefault("transformer_options", {})
    previous = opts.get(OVERRIDE)
    if isinstance(previous, SparseAttentionPatch):
        previous = previous.previous  # re-patching replaces our own earlier patch, keeps what it chained
    diffusion_model = m.get_model_object("diffusion_model")
    family = family_of(diffusion_model)
    patch = SparseAttentionPatch(cfg, previous=previous, family=family,
                                 layer_offsets=family.layer_offsets(diffusion_model))
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
