"""The model patch: an attention override that routes long self-attention through the engine.

Installed on ``model.clone()`` as ``transformer_options["optimized_attention_override"]``. It chains to
an override that was installed before it (SageAttention, another pack) and uses it — or the model's own
``func`` — for every dense call. ComfyUI callbacks/wrappers (keyed, so removing the node removes them)
reset the engine at the start of each sampling run, free its caches at the end, record the latent shape
of each forward, and re-assert the override before every model evaluation.
"""

from __future__ import annotations

import contextlib
import importlib
import logging

import torch

from ..engine import CallContext, SparseConfig, SparseEngine
from ..kernels._checks import TRITON_HEAD_DIMS
from .adapters import INFO_KEY, family_of, forward_info, layer_index, layout_for, step_index

log = logging.getLogger(__name__)

KEY = "sparse_attention"
OVERRIDE = "optimized_attention_override"


class SparseAttentionPatch:
    """Callable override state: config, engine, the previous override, counters and the last run's stats.

    ``copy.deepcopy`` returns the object itself (older ComfyUI deep-copies model options on clone),
    so every clone of the patched model shares one engine.
    """

    def __init__(self, cfg: SparseConfig, previous=None, family=None):
        self.cfg = cfg
        self.engine = SparseEngine(cfg)
        self.previous = previous
        self.family = family
        self.fallbacks: dict[str, int] = {}
        self.snapshots: dict[int, dict] = {}
        self.runs = 0
        self.last_stats = None
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
        """ComfyUI's override contract: ``fn(func, q, k, v, heads, mask=None, attn_precision=None,
        skip_reshape=False, skip_output_reshape=False, **kwargs)``; q/k/v are (B, N, H*D) unless
        ``skip_reshape`` (then (B, H, N, D)); the output is (B, N, H*D) unless ``skip_output_reshape``."""
        if len(args) < 3:
            return self._fallback("an unexpected call signature", func, args, kwargs)
        q, k, v = args[:3]
        heads = args[3] if len(args) > 3 else kwargs.get("heads")
        mask = args[4] if len(args) > 4 else kwargs.get("mask")
        to = kwargs.get("transformer_options") or {}
        skip_reshape = kwargs.get("skip_reshape", False)
        skip_out = kwargs.get("skip_output_reshape", False)
        info = to.get(INFO_KEY)
        # layer index: from the model, else the position of this self-attention call in the forward
        layer = layer_index(to)
        if info is not None and isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor):
            token_dim = 2 if skip_reshape else 1
            if q.dim() > token_dim and k.dim() > token_dim and q.shape[token_dim] == k.shape[token_dim]:
                if layer is None:
                    layer = info["calls"]
                info["calls"] += 1
        if self.cfg.method == "dense":
            return self._dense(func, args, kwargs)
        if heads is None or not isinstance(q, torch.Tensor):
            return self._fallback("an unexpected call signature", func, args, kwargs)
        if mask is not None:
            return self._fallback("calls with an attention mask", func, args, kwargs)
        if kwargs.get("enable_gqa") and k.shape[-3 if skip_reshape else -1] != q.shape[-3 if skip_reshape else -1]:
            return self._fallback("grouped-query attention", func, args, kwargs)
        if skip_reshape:
            qh, kh, vh = q, k, v
        else:
            b, n, hd = q.shape
            if hd % heads:
                return self._fallback("an unexpected call signature", func, args, kwargs)
            d = hd // heads
            qh = q.view(b, -1, heads, d).transpose(1, 2)
            kh = k.view(b, -1, heads, d).transpose(1, 2)
            vh = v.view(b, -1, heads, d).transpose(1, 2)
        nq, nk = qh.shape[2], kh.shape[2]
        if nq != nk:
            return self._fallback("cross-attention", func, args, kwargs)
        if self.cfg.backend == "triton" and qh.shape[-1] not in TRITON_HEAD_DIMS:
            return self._fallback(f"head dim {qh.shape[-1]} (the Triton kernels take {TRITON_HEAD_DIMS})", func,
                                  args, kwargs)
        if nq < self.cfg.min_tokens:
            return self._fallback("sequences shorter than min_tokens", func, args, kwargs)
        if layer is None:
            return self._fallback("calls outside a tracked forward", func, args, kwargs)
        step, total = step_index(to)
        chunk = tuple(int(c) for c in to.get("cond_or_uncond", ()) or ())
        window = to.get("context_window")
        if window is not None and hasattr(window, "index_list"):
            chunk = chunk + (tuple(window.index_list[:1]) + tuple(window.index_list[-1:]),)
        family = info["family"] if info is not None else self.family
        layout = layout_for(nq, to, family) if family is not None else None
        ctx = CallContext(layer=layer, step=step, is_self=True, chunk=chunk, total_steps=total,
                          **({"layout": layout} if layout is not None else {}))

        def dense_fn(dq, dk, dv):
            kw = dict(kwargs)
            kw.update(skip_reshape=True, skip_output_reshape=True)
            kw.pop("mask", None)
            kw.pop("heads", None)
            return self._dense(func, (dq, dk, dv, heads), kw)

        try:
            out = self.engine.attend(qh, kh, vh, ctx, scale=kwargs.get("scale"), dense_fn=dense_fn)
        except (RuntimeError, ValueError) as exc:  # out of memory, a backend refusing the case, ...
            # never fail a sampling run: this call goes dense; the reason is counted and logged once
            kind = f"an engine error ({type(exc).__name__})"
            if kind not in self._logged:
                log.warning("sparse attention: %s: %s", kind, str(exc).splitlines()[0][:300])
            return self._fallback(kind, func, args, kwargs)
        self._snapshot(ctx, nq)
        if skip_out:
            return out
        b, h, n, d = out.shape
        return out.transpose(1, 2).reshape(b, n, h * d)

    def _snapshot(self, ctx, n):
        """Keep a small picture of each layer's first selection of the run (for the report node)."""
        if ctx.layer in self.snapshots:
            return
        entry = self.engine.cache.peek(ctx.key(n))
        if entry is None:
            return
        self.snapshots[ctx.layer] = selection_picture(entry.selection, n)

    # lifecycle (ComfyUI callbacks and wrappers) -------------------------------------------------------
    def outer_sample(self, executor, *args, **kwargs):
        """OUTER_SAMPLE wrapper: one sampling run; reset before, free and report after."""
        self.engine.begin_run()
        self.snapshots = {}
        self.fallbacks = {}
        try:
            return executor(*args, **kwargs)
        finally:
            self.last_stats = self.engine.end_run()
            self.runs += 1

    def apply_model(self, executor, x, t, *args, **kwargs):
        """APPLY_MODEL wrapper: record the latent shape and start the per-forward call counter."""
        to = args[3] if len(args) > 3 else kwargs.get("transformer_options")
        if isinstance(to, dict):
            to[INFO_KEY] = forward_info(x.shape, self.family)
            module = BYPASSING_MODULES.get(self.family.name if self.family is not None else "")
            if module is not None:
                with route_module_attention(module, to):
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


# Model families whose attention calls do not pass transformer_options (so ComfyUI's override hook never
# sees them): module whose ``optimized_attention`` name the calls use.
BYPASSING_MODULES = {"hunyuan3d_2_1": "comfy.ldm.hunyuan3dv2_1.hunyuandit"}


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


def selection_picture(selection, n: int, width: int = 256) -> dict:
    """A small map of one selection (batch 0, head 0): block map (nqb, nkb) or token map (groups, width)."""
    if hasattr(selection, "kv_indices"):
        idx, cnt = selection.kv_indices[0, 0], selection.kv_counts[0, 0]
        nqb = cnt.shape[0]
        nkb = -(-n // selection.block_k)
        grid = torch.zeros(nqb, nkb + 1)
        valid = torch.arange(idx.shape[-1], device=idx.device) < cnt.unsqueeze(-1)
        cols = torch.where(valid, idx.long(), nkb).cpu()
        grid.scatter_(1, cols, 1.0)
        grid = grid[:, :nkb]
        if max(grid.shape) > width:  # bound the picture's memory: pool to at most width x width
            grid = torch.nn.functional.adaptive_avg_pool2d(grid[None, None], (min(width, nqb), min(width, nkb)))[0, 0]
        return {"kind": "block", "map": grid}
    one = selection.head(0, 0)  # decode one head's lists, not all of them
    toks, cnt = one.kv_tokens()[0, 0], one.kv_counts[0, 0]
    g = cnt.shape[0]
    bins = min(width, n)
    grid = torch.zeros(g, bins + 1)
    valid = torch.arange(toks.shape[-1], device=toks.device) < cnt.unsqueeze(-1)
    cols = torch.where(valid, (toks.long() * bins) // n, bins).cpu()
    grid.scatter_add_(1, cols, torch.ones_like(cols, dtype=grid.dtype))
    per_bin = max(1, n // bins)
    return {"kind": "token", "map": (grid[:, :bins] / per_bin).clamp(max=1.0)}


def install(model, cfg: SparseConfig):
    """Clone a ComfyUI ModelPatcher and install the sparse-attention patch on the clone."""
    import comfy.patcher_extension as pe

    m = model.clone()
    opts = m.model_options.setdefault("transformer_options", {})
    previous = opts.get(OVERRIDE)
    if isinstance(previous, SparseAttentionPatch):
        previous = previous.previous  # re-patching replaces our own earlier patch, keeps what it chained
    diffusion_model = m.get_model_object("diffusion_model")
    patch = SparseAttentionPatch(cfg, previous=previous, family=family_of(diffusion_model))
    opts[OVERRIDE] = patch
    m.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, KEY, patch.outer_sample)
    m.add_wrapper_with_key(pe.WrappersMP.APPLY_MODEL, KEY, patch.apply_model)
    m.add_callback_with_key(pe.CallbacksMP.ON_PREPARE_STATE, KEY, patch.prepare_state)
    m.add_callback_with_key(pe.CallbacksMP.ON_CLEANUP, KEY, patch.cleanup)
    log.info("sparse attention: patched a %s model (%s, density %.2f)", patch.family.name, cfg.method, cfg.density)
    return m, patch


def find_patch(model) -> SparseAttentionPatch | None:
    """The patch installed on a ModelPatcher, if any."""
    opts = getattr(model, "model_options", {}).get("transformer_options", {})
    p = opts.get(OVERRIDE)
    return p if isinstance(p, SparseAttentionPatch) else None
