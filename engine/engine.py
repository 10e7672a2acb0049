"""The sparse-attention engine: per call, decide dense / anchor / reuse, select, compute, compensate.

    engine = SparseEngine(SparseConfig(method="mc_sparse", density=0.15, anchor_steps="10,26"))
    engine.begin_run()
    out = engine.attend(q, k, v, CallContext(layer=i, step=s, layout=...), dense_fn=model_attention)
    stats = engine.end_run()

Anchors compute dense attention (with its LSE when the policy asks for it), the new selection and the
sparse output with it; they return the dense output and cache the selection and R = O_dense - O_sparse.
Reuse steps return O_sparse(q_t, k_t, v_t; cached selection) + R (docs/method.md, "Anchors, reuse and the
residual"). What a method needs is said by its Policy object (engine/policy.py).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace

import torch

from .. import kernels
from ..kernels._checks import TRITON_HEAD_DIMS
from .cache import Entry, SelectionCache, split_chunk
from .config import SparseConfig
from .context import CallContext
from .device_pool import PoolWatch, trim_pool
from .layer_density import anchor_factor, head_densities, select_heads
from .messages import oom_report
from .policy import policy_for
from .residual import Residual, residual_precision, weighs_by_mass
from .selection import BlockSelection
from .schedule import resolve_warmup
from .stats import RunStats

log = logging.getLogger(__name__)

DENSE, ANCHOR, REUSE, FALLBACK = "dense", "anchor", "reuse", "fallback"
SPILL_SHARES = (0.5, 1.0)  # of the device cache moved off the GPU at a first / second out-of-memory anchor


class SparseEngine:
    """Holds one configuration, the run's caches and statistics for one device.

    Thread-safe: calls from several threads are serialised by ``lock`` (a sampler split over devices gets one
    engine per device, engine/engines.py, so devices still run in parallel)."""

    def __init__(self, cfg: SparseConfig):
        self.cfg = cfg
        budget = None if cfg.cache_budget_mb == "auto" else int(cfg.cache_budget_mb * 2**20)
        self.cache = SelectionCache(budget, int(cfg.cpu_budget_mb * 2**20), cfg.offload,
                                    pack_when_short=cfg.residual_precision == "auto")
        self.stats = RunStats()
        self._static: dict[tuple, object] = {}
        self._anchored_at: dict[tuple, int] = {}
        self._seen_at: dict[tuple, int] = {}  # the last step each key ran sparse (anchor or reuse)
        self._run_start: int | None = None  # the step of the run's first call (> 0: a later sampler of a split)
        self._first_sparse: int | None = None  # the run's first step with a sparse (anchor or reuse) call
        self._step: int | None = None
        self._spill_warned: set = set()  # what _with_room logged this run: a kind of call, or (kind, "pool")
        self._pool_watch = PoolWatch()  # hands the allocator's idle pool back when the driver runs low (_attend)
        self.last_stats: RunStats | None = None
        self.lock = threading.RLock()
        self._dense_layers: tuple = ((), frozenset())  # (cfg.dense_layers, the same as a set)

    @property
    def policy(self):
        """The configured method's Policy (None for ``dense``); read per call, so a changed cfg takes effect."""
        return policy_for(self.cfg.method)

    # run lifecycle
    def begin_run(self) -> None:
        """Start a sampling run: forget every cache entry and statistic of the previous one."""
        with self.lock:
            self._forget()
            self.stats = RunStats()

    def end_run(self, log_summary: bool = True) -> RunStats:
        """Finish the run: resolve timings, free all cached tensors, return the statistics."""
        with self.lock:
            stats = self.stats.finish(self.cache.info())
            self._forget()
            kernels.release_graphs()  # the grouping's CUDA graphs hold memory for their shapes: kept for a run only
            self.last_stats = stats
            self.stats = RunStats()
        if log_summary:
            log.info(stats.summary_line())
        return stats

    def give_up(self, ctx: CallContext, n_tokens: int) -> None:
        """Run this call's layer densely for the rest of the run (its sparse path raised): counted as fallbacks."""
        with self.lock:
            key = ctx.key(n_tokens)
            self.cache.drop(key)
            if key not in self.cache.fallback_keys:
                self.cache.fallback_keys.add(key)
                self.cache.counters["fallbacks"] += 1

    def _forget(self) -> None:
        self.cache.reset()
        self._static.clear()
        self._anchored_at.clear()
        self._seen_at.clear()
        self._run_start = self._first_sparse = None
        self._step = None
        self._spill_warned.clear()  # out-of-memory warnings, once a run for each kind of call (_with_room)
        self._pool_watch.reset()

    # decisions
    def skip_reason(self, ctx: CallContext | None, n_q: int, n_k: int, head_dim: int) -> str | None:
        """Why a call is not the engine's to make sparse (it then runs the model's own attention and is not
        counted in the run's per-layer statistics), or None. ``ctx`` may be None (a call whose layer is not
        known yet). The schedule (warm-up, dense layers) is not a reason here: those calls are the engine's
        and count as dense calls of their layer."""
        cfg = self.cfg
        if cfg.method == "dense":
            return "method dense"
        if (ctx is not None and not ctx.is_self) or n_q != n_k:
            return "cross-attention"
        if n_q < cfg.min_tokens:
            return "sequences shorter than min_tokens"
        if cfg.backend == "triton" and head_dim not in TRITON_HEAD_DIMS:
            return f"head dim {head_dim} (the Triton kernels take {TRITON_HEAD_DIMS})"
        if ctx is not None:  # never guess which tokens are which (docs/method.md, "Modalities")
            misfit = ctx.layout.misfit(n_q)
            if misfit is not None:
                return f"a token count that does not match the layout ({misfit})"
            if not ctx.layout.has_generated_tokens:
                return "calls over text or reference tokens only (refiners)"
        return None

    def decide(self, ctx: CallContext, n_tokens: int) -> str:
        """dense | anchor | reuse | fallback for a call with ``n_tokens`` query tokens."""
        cfg = self.cfg
        if cfg.method == "dense" or not ctx.is_self or n_tokens < cfg.min_tokens:
            return DENSE
        if ctx.layout.misfit(n_tokens) is not None:  # a layout that does not describe this call: never guess
            return DENSE
        warmup = resolve_warmup(cfg.warmup_steps, ctx.total_steps)
        if ctx.step < warmup or ctx.layer < cfg.warmup_layers or ctx.layer in self._dense_set():
            return DENSE
        key = ctx.key(n_tokens)
        if key in self.cache.fallback_keys:
            return FALLBACK
        found = self.cache.lookup(key)
        if found is None:
            return ANCHOR
        last = self._anchored_at.get(found[0])
        schedule = cfg.anchor_steps
        if ctx.step < max(last or 0, self._seen_at.get(key, 0)) - 1:
            # this key's steps went back (a run restarted without begin_run): select afresh. One step back is no
            # restart: a sampler that looks two sigmas ahead within a step (heunpp2 evaluates at sigma i, i + 1
            # and i + 2, and each evaluation belongs to the step of its sigma, docs/method.md, "Schedule") starts
            # its next step one step behind its last call (docs/decisions.md, "Step caches")
            due = True
        elif last is None:
            due = schedule.is_anchor(ctx.step, warmup, ctx.total_steps)
        else:  # an anchor step that no call reached (a step cache skipped it) makes this step the anchor
            # the run's first sparse step, off the schedule, in a later sampler of a split run (engine/schedule.py,
            # AnchorSchedule.due); an entry first anchored later (a key new mid-run) keeps the schedule
            stand_in = (self._run_start or 0) > 0 and last == self._first_sparse \
                and not schedule.is_anchor(last, warmup, ctx.total_steps)
            due = schedule.due(last, ctx.step, warmup, ctx.total_steps, stand_in)
        return ANCHOR if due else REUSE

    def _dense_set(self) -> frozenset:
        """cfg.dense_layers as a set, rebuilt only when the configuration's tuple changes."""
        layers = self.cfg.dense_layers
        if self._dense_layers[0] is not layers:
            self._dense_layers = (layers, frozenset(layers))
        return self._dense_layers[1]

    # the call
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: CallContext, *, scale=None,
               dense_fn=None) -> torch.Tensor:
        """Attention for one call. q: (B, H, Nq, D); k, v: (B, H, Nk, D), or (B, H / g, Nk, D) for grouped-query
        attention (query head i reads k/v head i // g, as torch's ``enable_gqa``); returns (B, H, Nq, D) in q's
        dtype.

        dense_fn(q, k, v) -> (B, H, Nq, D): the model's own dense attention (used for dense calls, so
        any installed backend stays in charge of them; it gets grouped-query k/v as they are); default:
        kernels.attention_dense. The sparse path repeats grouped-query k/v to H heads (the kernels take equal head
        counts). Tensors on the meta device (shape-only passes) run dense and are not counted. A cached entry that
        cannot serve this call (another batch size, head count or device under the same key) is replaced by a new
        anchor.
        """
        if q.device.type == "meta":
            return self._dense(q, k, v, scale, dense_fn)
        with self.lock:
            return self._attend(q, k, v, ctx, scale, dense_fn)

    def _attend(self, q, k, v, ctx, scale, dense_fn):
        if self._step != ctx.step:
            if self._run_start is None:
                self._run_start = ctx.step
            self._step = self.stats.step = ctx.step
            self.cache.new_step()
        n = q.shape[2]
        decision = self.decide(ctx, n) if k.shape[2] == n else DENSE
        dev = q.device
        if dev.type == "cuda":
            self._watch_pool(dev)
        if decision in (DENSE, FALLBACK):
            with self.stats.timed(ctx.layer, "attention", dev):
                out = self._dense(q, k, v, scale, dense_fn)
            self.stats.add(ctx.layer, decision, 1.0, step=ctx.step)
            return out
        if self._first_sparse is None:
            self._first_sparse = ctx.step
        k, v = with_query_heads(q, k, v)
        if decision == ANCHOR:
            out = self._reuse_parts(q, k, v, ctx, scale)
            if out is not None:
                return out
        key = ctx.key(n)
        self._seen_at[key] = ctx.step
        entry = None
        if decision == REUSE and self.cfg.residual and self._residual_dropped(key):
            # its residual found no room (engine/cache.py): without it a reuse step misses what the anchor measured
            # (on the testbed at density 0.08, 2 of 8 layers without residuals cost 2.5 dB, 5 of 8 cost 12 dB;
            # docs/decisions.md, "Small cards"), so the layer runs dense until its next anchor
            with self.stats.timed(ctx.layer, "attention", dev):
                out = self._dense(q, k, v, scale, dense_fn)
            self.stats.add(ctx.layer, FALLBACK, 1.0, step=ctx.step)
            return out
        resident = False
        if decision == REUSE:
            if key in self.cache.on_device:  # resident: nothing to transfer, and no timing events to pay for
                entry, resident = self.cache.get(key, dev), True
            else:
                with self.stats.timed(ctx.layer, "transfer", dev):
                    entry = self.cache.get(key, dev)
            if entry is None or not entry.fits(q):
                entry = None
        if entry is None:
            # the anchor replaces this key's entry (SelectionCache.put drops it first thing): let it go now, so that it
            # does not sit beside the anchor's scratch and its new entry, nor does an out-of-memory spill copy it to
            # host memory on its way out (the least recently used entry at an anchor step is the layer's own)
            self.cache.drop(key)
            return self._anchor_with_room(q, k, v, ctx, key, scale, dense_fn)
        out, density, replayed = self._reuse(q, k, v, ctx, entry, resident, scale)
        self.stats.add(ctx.layer, REUSE, density, step=ctx.step, replayed=replayed)
        return out

    def _reuse(self, q, k, v, ctx, entry: Entry, resident: bool, scale) -> tuple:
        """(output (B, H, N, D) in q's dtype, density of the selection used, whether the call was replayed): the
        sparse attention of ``entry``'s selection plus its residual. ``resident``: the entry is the stored device
        entry itself (not a copy or a batch slice), so its kernel launches may be replayed."""
        dev = q.device
        selection, residual = entry.selection, entry.residual
        policy, backend = self.policy, self.cfg.backend
        if policy.reselects(self.cfg):
            with self.stats.timed(ctx.layer, "selection", dev):
                selection = self._select(policy, q, k, None, ctx, scale)
            if residual is not None and residual.mass is not None:  # the mass belongs to the anchor's selection
                residual = Residual(residual.data, residual.scale, packed=residual.packed)
            resident = False  # a new selection each call: nothing to replay
        if residual is not None and residual.packed:  # 4-bit storage: the kernels read fp8 (engine/residual.py)
            with self.stats.timed(ctx.layer, "transfer", dev):  # its fp8 copy needs room beside the model's
                residual = self._with_room(residual.unpacked, "a reuse call unpacking its residual", q,
                                           stop_prefetch=True)
            resident = False  # a fresh fp8 copy each call: nothing to replay

        def call(q_, k_, v_):  # the residual is added in the kernel's epilogue
            return selection.run(q_, k_, v_, scale=scale, backend=backend, residual=residual)
        replays = None
        with self.stats.timed(ctx.layer, "attention", dev):
            if resident:  # the stored entry's own call, replayed once it is known to be one launch (kernels/replay.py)
                if entry.replay is None:
                    entry.replay = kernels.CallReplay()
                replays = entry.replay.replays
                out = entry.replay.run(call, q, k, v, (scale, backend))
            else:
                out = call(q, k, v)
        return out, selection.density, replays is not None and entry.replay.replays > replays

    def _reuse_parts(self, q, k, v, ctx: CallContext, scale) -> torch.Tensor | None:
        """A batched call's output from the entries its conds stored as separate calls, or None when they cannot
        serve it. ComfyUI splits cond and uncond when memory runs low and batches them again when it allows; a
        batch whose conds anchored apart has no entry of its own, and anchoring it would cost an anchor on every
        flip back to batched. Each part reuses its entry (one call in the statistics, at the parts' mean
        density); a part missing, due to anchor, without its residual or of another shape anchors the whole."""
        n, dev = q.shape[2], q.device
        parts = self._stored_parts(ctx, n, q.shape[0])
        if parts is None:
            return None
        entries = []
        for part, a, b in parts:
            with self.stats.timed(ctx.layer, "transfer", dev):
                entry = self.cache.get(part.key(n), dev)
            if entry is None or not entry.fits(q[a:b]):
                return None
            entries.append(entry)
        outs, density = [], 0.0
        for (part, a, b), entry in zip(parts, entries):
            self._seen_at[part.key(n)] = ctx.step
            out, d, _ = self._reuse(q[a:b], k[a:b], v[a:b], part, entry, False, scale)
            outs.append(out)
            density += d * (b - a) / q.shape[0]
        self.stats.add(ctx.layer, REUSE, density, step=ctx.step)
        return torch.cat(outs)

    def _stored_parts(self, ctx: CallContext, n: int, batch: int) -> list | None:
        """[(part context, first row, stop row)] when this batched call has no entry of its own but stored entries of
        smaller chunks cover all its rows, each due for reuse with its residual; else None. ``batch``: the call's
        batch size, each cond holding batch / conds rows in chunk order."""
        conds, rest = split_chunk(ctx.chunk)
        if len(conds) < 2 or batch % len(conds) or self.cache.lookup(ctx.key(n)) is not None:
            return None
        per, parts, i = batch // len(conds), [], 0
        while i < len(conds):
            for j in range(len(conds) - 1 if i == 0 else len(conds), i, -1):  # the longest stored run from i
                part = replace(ctx, chunk=conds[i:j] + rest)
                if self.cache.lookup(part.key(n)) is not None:
                    break
            else:
                return None
            if self.decide(part, n) != REUSE or (self.cfg.residual and self._residual_dropped(part.key(n))):
                return None
            parts.append((part, i * per, j * per))
            i = j
        return parts

    def _residual_dropped(self, key) -> bool:
        """The entry serving ``key`` lost its residual for lack of room (host metadata only: no copy, no wait)."""
        found = self.cache.lookup(key)
        if found is None:
            return False
        entry = self.cache.on_device.get(found[0]) or self.cache.on_cpu.get(found[0])
        return entry is not None and entry.residual is None

    def _anchor_with_room(self, q, k, v, ctx, key, scale, dense_fn):
        """An anchor; when it runs out of memory, the cache crowds its scratch: move half of the cache off
        the GPU and try again, then all of it (an error after that reaches the caller)."""
        return self._with_room(lambda: self._anchor(q, k, v, ctx, key, scale, dense_fn), "an anchor", q)

    def _with_room(self, fn, what: str, q: torch.Tensor, stop_prefetch: bool = False):
        """``fn()``; when it runs out of memory, hand cudaMallocAsync's idle pool memory back to the driver and try
        again (once, where the pool holds enough: engine/device_pool.py), then move half of the cache off the GPU
        and try again, then all of it (an error after that, or with nothing to move, reaches the caller). ``what``
        names the call in the warning (logged once a run for each ``what``); ``stop_prefetch``: no more prefetched
        copies this run (for calls that need room beside the cache's entry in use, which a prefetched copy of the
        next layer's would crowd)."""
        shares, trimmed = list(SPILL_SHARES), False
        while shares or not trimmed:
            try:
                return fn()
            except torch.OutOfMemoryError as exc:
                # room is made after this block: inside it the traceback holds the failed attempt's tensors
                why = oom_report(exc)
                failed = exc.with_traceback(None)
            if not trimmed:
                trimmed = True
                idle = trim_pool(q.device)
                if idle:
                    self._warn_room((what, "pool"), "out of memory at %s (%s) with %.0f MB idle in the allocator's "
                                    "pool: handed it back to the driver and tried again", what, why, idle / 2**20)
                    continue
            released = kernels.release_graphs()  # the grouping's graphs: their memory comes back first
            freed = self.cache.spill(shares.pop(0), stop_prefetch=stop_prefetch)
            if not freed and not released:
                failed.add_note(f"sparse attention: out of memory at {what}, with no cache left on the GPU to move")
                raise failed
            self._warn_room(what, "out of memory at %s (%s); moved %.0f MB of cache off the GPU (a lower "
                            "cache_budget_mb avoids this)", what, why, freed / 2**20)
            if q.is_cuda:
                torch.cuda.empty_cache()
        return fn()

    def _watch_pool(self, dev: torch.device) -> None:
        """Hand cudaMallocAsync's idle pool memory back when the driver runs low (engine/device_pool.py
        ``PoolWatch``), before an allocation of this call or of the model's next layer fails."""
        idle = self._pool_watch.check(dev)
        if idle:
            self.cache.counters["pool_trims"] += 1
            self._warn_room("pool watch", "the driver ran low on GPU memory while the allocator's pool held %.0f MB "
                            "idle: handed it back (logged once a run; the run's summary counts them)", idle / 2**20,
                            level=logging.INFO)

    def _warn_room(self, key, msg: str, *args, level: int = logging.WARNING) -> None:
        """A message of the engine's memory handling (``_with_room``, ``_watch_pool``): at ``level`` once a run for each
        ``key`` (the call kind and what was done, or the watch), at debug level after that."""
        level = logging.DEBUG if key in self._spill_warned else level
        self._spill_warned.add(key)
        log.log(level, "sparse attention: " + msg, *args)

    def _dense(self, q, k, v, scale, dense_fn):
        if dense_fn is not None:
            return dense_fn(q, k, v)
        k, v = with_query_heads(q, k, v)
        return kernels.attention_dense(q, k, v, scale=scale, backend=self.cfg.backend)

    def _anchor(self, q, k, v, ctx, key, scale, dense_fn):
        cfg, dev, policy = self.cfg, q.device, self.policy
        # block selections come from q and k alone: select first, then the anchor call (on Hopper one pass of the
        # Gluon kernel; elsewhere one fused pass, or below density 0.12 a dense call plus the sparse kernel forming R:
        # kernels/api.py, block_anchor_attention)
        if not policy.needs_lse:
            with self.stats.timed(ctx.layer, "selection", dev):
                selection = self._select(policy, q, k, None, ctx, scale)
            if isinstance(selection, BlockSelection):
                with self.stats.timed(ctx.layer, "attention", dev):
                    precision = cfg.residual_precision if cfg.residual else "model"
                    out_d, res = selection.anchor(q, k, v, scale=scale, backend=cfg.backend,
                                                  precision=residual_precision(precision, dev),
                                                  mass=weighs_by_mass(cfg, ctx.step, q))
                with self.stats.timed(ctx.layer, "store", dev):
                    self._store_residual(key, selection, out_d, Residual(*res), ctx)
                return out_d
        # what the selection needs of q alone (mc_sparse's query groups) runs beside the dense call, on a side stream
        # that waits for this point only; its launches follow the dense call's, at select (docs/kernel_notes.md, "v23")
        prepared = policy.prepare(q, ctx.layout, cfg, backend=cfg.backend)
        with self.stats.timed(ctx.layer, "attention", dev):
            if policy.needs_lse:
                out_d, lse = kernels.attention_dense(q, k, v, scale=scale, return_lse=True, backend=cfg.backend)
            else:
                out_d, lse = self._dense(q, k, v, scale, dense_fn), None
        with self.stats.timed(ctx.layer, "selection", dev):
            selection = self._select(policy, q, k, lse, ctx, scale, prepared)
        with self.stats.timed(ctx.layer, "attention", dev):
            out_s = selection.run(q, k, v, scale=scale, backend=cfg.backend)
        with self.stats.timed(ctx.layer, "store", dev):
            where = self._store(key, selection, out_d, out_s, ctx)
        if where == "none":
            log.debug("layer %s: selection not cached", ctx.layer)
        return out_d

    def _store_residual(self, key, selection, out_d, residual: "Residual", ctx) -> str:
        """Cache an anchor's selection with a residual the kernel already encoded (packed here for "int4")."""
        nr, no = residual.norm_on_device(), torch.linalg.vector_norm(out_d).float()
        residual = residual.stored_as(self.cfg.residual_precision) if self.cfg.residual else None
        self.cache_entry(key, selection, residual, nr / no.clamp_min(1e-30), ctx)

    def cache_entry(self, key, selection, residual, fidelity: float | torch.Tensor, ctx) -> str:
        """Store an anchor's entry. ``fidelity``: ‖R‖ / ‖dense output‖, a float or a 0-d tensor on the device, which
        stays there until the cache must rank residuals (room running out) or the run's statistics are read: an
        anchor's store never waits for the device to read it (docs/kernel_notes.md, "v26")."""
        # where residuals find no room their layers run dense at reuse steps (exact), so the layers kept sparse should
        # be those whose sparse output is nearest the dense one: the residuals of the largest anchor errors go first
        # (on the testbed, 3 of 8 kept: 35.6 dB this way against 33.0 dB keeping the largest; docs/benchmarks.md,
        # "Which layers run dense when residuals find no room")
        where = self.cache.put(key, Entry(selection, residual, importance=-fidelity))
        self._anchored_at[key] = ctx.step
        self.stats.add(ctx.layer, ANCHOR, selection.density, fidelity, step=ctx.step)
        return where

    def _store(self, key, selection, out_d, out_s, ctx) -> str:
        # R = out_d - out_s formed in fp32, encoded, and the squares of R and out_d summed, in one pass over the two
        # outputs on CUDA (kernels/residual_encode_triton.py; ~10 fp32 passes before: docs/kernel_notes.md, "v23");
        # without a residual kept, R is still formed for its norm (the fidelity) in the model's dtype
        cfg = self.cfg
        precision = residual_precision(cfg.residual_precision, out_d.device) if cfg.residual else "model"
        pair, sums = kernels.residual_of(out_d, out_s, precision=precision, return_sums=True, backend=cfg.backend)
        nd, no = sums.sqrt().unbind()
        residual = Residual(*pair).stored_as(cfg.residual_precision) if cfg.residual else None
        del pair
        return self.cache_entry(key, selection, residual, nd / no.clamp_min(1e-30), ctx)

    def _select(self, policy, q, k, lse, ctx, scale, prepared=None):
        # per-layer / per-head densities and the anchor's factor: heads grouped by density, one policy call per group
        # (engine/layer_density.py); None = the configured density for every head
        cfg = self.cfg
        factor = 1.0
        if cfg.anchor_density_factors:  # by the step's place in the schedule (engine/schedule.py, span_index)
            warmup = resolve_warmup(cfg.warmup_steps, ctx.total_steps)
            factor = anchor_factor(cfg, max(0, cfg.anchor_steps.span_index(ctx.step, warmup, ctx.total_steps)))
        dens = head_densities(cfg, ctx.layer, q.shape[1], factor)
        if policy.shape_only:
            b, h, n, _ = q.shape
            skey = (b, h, n, ctx.layout, str(q.device), dens)
            if skey not in self._static:
                self._static[skey] = select_heads(policy, q, k, None, ctx.layout, self.cfg, dens, scale=scale,
                                                  backend=self.cfg.backend)
            return self._static[skey]
        return select_heads(policy, q, k, lse, ctx.layout, self.cfg, dens, scale=scale, backend=self.cfg.backend,
                            prepared=prepared)


def with_query_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query k/v, (B, H / g, N, D), repeated to q's H heads (query head i reads k/v head i // g, as torch's
    ``enable_gqa``); k/v with q's heads are returned as they are."""
    if k.shape[1] == q.shape[1]:
        return k, v
    g = q.shape[1] // k.shape[1]
    return k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
