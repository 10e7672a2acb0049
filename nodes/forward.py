"""Per-forward facts: what every attention call of one model evaluation shares, computed once per forward.

The patch's APPLY_MODEL wrapper stores a Forward in the forward's ``transformer_options``; each attention call
reads it back. Step, total steps and batch-chunk identity change once per forward, so they are computed
here and not on every attention call; the token layout is computed once per token count.
"""

from __future__ import annotations

import math

from ..engine import CallContext, RunClock, TokenLayout
from .families import Family

INFO_KEY = "sparse_attention_forward"


SIGMA_MIN_RTOL = 1e-5  # RES4LYF writes the model's sigma_min itself: equal up to float rounding


def run_sigmas(values, sigma_min: float | None = None) -> list[float]:
    """The sigma schedule a sampler runs, from the sigmas it hands ComfyUI's sampler (the OUTER_SAMPLE wrapper's
    ``sigmas``, the options' ``sample_sigmas``), with the zeros other node packs add as flags taken out
    (docs/method.md, "Schedule"). ComfyUI's own schedules come back unchanged.

    RES4LYF (ClownsharKSampler, ClownsharkChainsampler) pads its sigmas with a 0 at both ends so that ComfyUI adds
    no noise (RES4LYF beta/samplers.py, "USE NULL FLOATS AS FLAGS"): "resample" hands ``[0, s0 .. sN, 0, 0]``,
    "unsample" the flipped schedule ``[0, sN .. s0, 0]``; its sampler strips them again (beta/rk_noise_sampler_beta.py,
    ``prepare_sigmas``). A 0 followed by larger sigmas leads such a schedule; the direction is that of its non-zero
    part (the first and last sigmas are both 0). A falling one keeps one final 0 (a run down to sigma 0); a rising
    one (unsample) keeps its leading 0, the low end RES4LYF starts it from (at sigma_min; ComfyUI's FlipSigmas puts
    1e-4 there) and drops the trailing 0. Repeated trailing zeros are one.

    ``sigma_min``: the model's smallest sigma. ``prepare_sigmas`` inserts it before the final 0 when the last
    non-zero sigma is more than 1e-4 away from it, and a chained sampler receives those prepared sigmas padded again
    (``[0, s0 .. sN, sigma_min, 0, 0]``): when the schedule was padded, a last non-zero sigma equal to ``sigma_min``
    is dropped. Karras and exponential schedules end at sigma_min themselves, so the run clock keeps it when the
    schedule is one of ComfyUI's (nodes/run_clock.py, ``clock_for``); without ``sigma_min`` nothing is dropped.
    """
    v = [float(x) for x in values]
    lead = len(v) >= 3 and v[0] <= 0.0 < v[1]
    end = len(v)
    while end > 0 and v[end - 1] <= 0.0:
        end -= 1
    trailing = len(v) - end
    if not lead and trailing <= 1:
        return v  # ComfyUI's own schedules
    core = v[1 if lead else 0:end]
    if not core or any(x <= 0.0 for x in core):
        return v  # zeros inside the schedule: not a padding this knows
    if len(core) >= 2 and core[-1] > core[0]:  # rising (unsample): from its low end up
        return ([0.0] if lead else []) + core
    out = core + ([0.0] if trailing else [])
    if (lead and sigma_min is not None and trailing and len(out) >= 3
            and abs(out[-2] - sigma_min) <= SIGMA_MIN_RTOL * abs(sigma_min)):
        out = out[:-2] + out[-1:]
    return out


def rising(values) -> bool:
    """Whether a schedule rises (ComfyUI's FlipSigmas, RES4LYF's unsample: inversion), judged by its non-zero part:
    a padded schedule starts and ends at 0 (``run_sigmas``)."""
    live = [float(x) for x in values if float(x) > 0.0]
    return len(live) >= 2 and live[-1] > live[0]


def step_index(transformer_options: dict) -> tuple[int, int | None]:
    """(step, total_steps) of this model call within the sampling run.

    The current sigma is located in the run's schedule ``sample_sigmas`` (``run_sigmas``: without the zeros node
    packs such as RES4LYF pad it with): an exact match gives its index; an intermediate sigma of a
    multi-evaluation sampler (heun, dpm_2, …) belongs to the step it lies in. The schedule usually descends; a
    rising one (ComfyUI's FlipSigmas, RES4LYF's unsample, for inversion / unsampling) is run from its first sigma
    too, so its steps count forward from its start, where the warm-up belongs (docs/method.md, "Schedule").
    Without a schedule: step 0.
    """
    step, total, _ = locate_call(transformer_options)
    return step, total


def locate_call(transformer_options: dict) -> tuple[int, int | None, bool]:
    """``step_index``'s (step, total_steps), and whether the call's sigma is one of the schedule's (a step's own
    sigma, or a later step's that heun and heunpp2 evaluate at), not one between them (dpm_2's midpoints) or beside
    them (a sigma scaled by Detail Daemon or LyingSigmaSampler). One read of the schedule per forward."""
    sigmas = transformer_options.get("sigmas")
    sched = transformer_options.get("sample_sigmas")
    if sigmas is None or sched is None:
        return 0, None, False
    s = float(sigmas.reshape(-1)[0])
    vals = run_sigmas(sched.reshape(-1).tolist())
    total = max(1, len(vals) - 1)
    tol = 1e-5 * max(1.0, abs(s))
    if rising(vals):  # rising: the steps whose sigma is at or below this one
        count = sum(1 for x in vals if x <= s + tol)
    else:  # descending: the steps whose sigma is at or above this one
        count = sum(1 for x in vals if x >= s - tol)
    return min(max(0, count - 1), total - 1), total, any(abs(x - s) <= tol for x in vals)


# Options under which ComfyUI evaluates the same conds through a different forward: an extra guidance pass run from
# a post-CFG function (LTXVSpatioTemporalGuidance perturbs these blocks' self-attention, LTXVModalityGuidance
# severs the audio-video cross-attention; comfy_extras/nodes_lt.py) or blocks replaced for the pass
# (SkipLayerGuidanceDiT/SD3 and PAG via ``patches_replace``; comfy_extras/nodes_slg.py, nodes_pag.py).
# {option: its value in a plain forward}.
PASS_OPTIONS = {"stg_self_attn_blocks": (), "a2v_cross_attn": True, "v2a_cross_attn": True}


def chunk_of(transformer_options: dict) -> tuple:
    """Identity of the batch chunk, part of every cache key (engine/context.py, ``CallContext.key``).

    One element per cond of the batch, in batch order: ``(cond_or_uncond, uuid)`` when ComfyUI names the conds
    (``uuids``, set with ``cond_or_uncond`` by calc_cond_batch, stable for a sampling run), else the
    ``cond_or_uncond`` number. Two prompts ComfyUI cannot batch (ConditioningCombine) are both cond (0) and only
    their uuids tell them apart. Then ``("window", first, last)`` of a context window, and ``("pass", ...)``
    when the options make this forward another pass of the same conds (``PASS_OPTIONS``, replaced blocks): such
    a pass must anchor and reuse its own selections and residuals, not those of the cond pass, whose attention
    it does not share. A plain forward has no pass tag. A chunk of some of a batch's conds reads its rows from
    the batch's entry when everything after the conds is the same (engine/cache.py, ``_covering``; split
    cond/uncond, docs/decisions.md "Cache budget \"auto\", spill on OOM, split cond/uncond").
    """
    to = transformer_options
    conds = [int(c) for c in to.get("cond_or_uncond", ()) or ()]
    uuids = to.get("uuids")
    if uuids is not None and len(uuids) == len(conds):
        chunk = tuple((c, str(u)) for c, u in zip(conds, uuids))
    else:
        chunk = tuple(conds)
    window = to.get("context_window")
    if window is not None and hasattr(window, "index_list"):
        span = list(window.index_list[:1]) + list(window.index_list[-1:])
        chunk = chunk + (("window", *(int(i) for i in span)),)
    variant = pass_of(to)
    return chunk + (variant,) if variant else chunk


def pass_of(transformer_options: dict) -> tuple:
    """What makes this forward another pass of its conds: the ``PASS_OPTIONS`` that differ from a plain forward's
    and the blocks replaced through ``patches_replace`` (by name and block key; two passes that replace the same
    blocks with different functions are not told apart). () for a plain forward."""
    tags = []
    for name, plain in PASS_OPTIONS.items():
        value = transformer_options.get(name, plain)
        if value is None or value == plain:
            continue
        if isinstance(value, (set, frozenset, list, tuple)):
            if not value:
                continue
            value = tuple(sorted(repr(v) for v in value))  # a set's order is not stable: compare sorted
        tags.append((name, value if isinstance(value, tuple) else repr(value)))
    replaced = transformer_options.get("patches_replace") or {}
    if isinstance(replaced, dict):
        for name in sorted(replaced, key=str):
            blocks = replaced[name]
            if isinstance(blocks, dict) and blocks:
                tags.append(("replace", str(name), tuple(sorted(repr(b) for b in blocks))))
    return ("pass", *tags) if tags else ()


class StepCounter:
    """Run steps of a sampler whose sigma schedule is not known: a new step whenever the sigma changes."""

    def __init__(self):
        self.step, self._sigma = -1, None

    def __call__(self, transformer_options: dict) -> int:
        sigmas = transformer_options.get("sigmas")
        sigma = None if sigmas is None else float(sigmas.reshape(-1)[0])
        if self.step < 0 or sigma != self._sigma:
            self.step += 1
            self._sigma = sigma
        return self.step


class Forward:
    """One model evaluation: family, latent shape and conditioning, run step, chunk, and the numbering of its
    self-attention calls.

    ``clock`` places this sampler in the whole run (engine/schedule.py): the run step is the clock's offset plus
    the position of the current sigma in the sampler's schedule; ``progress`` = (the run step of the run's first
    call, the steps the sampler reported finished through its callback; nodes/patch.py, ``_with_progress``) keeps
    it at the reported step (one more at a schedule sigma) once the sampler reported any, unless a call at a
    schedule sigma shows the count does not fit (``miscounted``: from the second such call the run places its
    calls by sigma alone). Without
    a schedule in the options, ``counter`` counts steps and the run's length is unknown. ``conds``: the
    conditioning APPLY_MODEL receives (keyword arguments: ``latent_shapes`` of packed audio-video latents, reference
    latents, MiniMax's packed layout, ...).
    ``seen``: a dict the layouts of this forward's calls are counted in ({(stream, layout): calls}).

    Layer numbers (docs/families.md, "Numbering"): a main-block call is numbered by its ``block_index`` in model
    order (``layer_offsets`` per ``block_type``), or by its position among the forward's main calls when the model
    reports none; a call of another stream (LTX-2 audio) or an extra call (a refiner, a second self-attention in
    one block) is numbered by its position among its stream's calls, after ``layer_offsets[stream]`` (when the
    model's block count is not known: its position among all the forward's self-attention calls)."""

    def __init__(self, family: Family, x_shape, transformer_options: dict, layer_offsets: dict[str, int],
                 clock: RunClock | None = None, counter: StepCounter | None = None, conds: dict | None = None,
                 seen: dict | None = None, progress: tuple | None = None):
        self.family = family
        self.x_shape = tuple(x_shape) if x_shape is not None else None
        self.miscounted = False  # the sampler's reported steps do not fit this call's schedule sigma (``progress``)
        local, local_total, on_schedule = locate_call(transformer_options)
        if local_total is None and counter is not None:
            self.step, self.total = counter(transformer_options), None
        elif clock is not None and clock.total is not None:
            # a call at a sigma the clock's schedule left out (RES4LYF's sigma_min, run_sigmas) is its last step
            step = clock.offset + local
            first, done = progress if progress is not None else (clock.offset, None)
            exact = progress is not None and on_schedule
            if first is None and not exact:  # the run's first call is at its first step's sigma: scaled, not moved
                step = clock.offset
            elif first is not None and done is not None:  # the sampler reported `done` finished steps: a call
                # after them is of step first + done, or one more at a schedule sigma (heunpp2's second look-ahead),
                # whatever sigma the model is handed (Detail Daemon and LyingSigmaSampler scale it by a few percent)
                expected = first + done
                # a call at a schedule sigma that the count does not fit: a sampler that does not report once per
                # step (RES4LYF's implicit steps report each iteration), or a scaled sigma that happens to equal
                # another step's; the run counts them and, from the second, places its calls by sigma alone
                self.miscounted = exact and not expected <= step <= expected + 1
                step = min(max(step, expected), expected + (1 if exact else 0))
            self.step, self.total = min(step, clock.total - 1), clock.total
        else:
            self.step, self.total = local, local_total
        self.chunk = chunk_of(transformer_options)
        self.layer_offsets = layer_offsets
        self.conds = dict(conds or {})
        shapes = self.conds.get("latent_shapes")
        self.latent_shapes = [tuple(int(v) for v in s) for s in shapes] if shapes else None
        self.seen = seen
        self.state: dict = {}  # the family's per-forward bookkeeping (e.g. LTX-2's stream order)
        self.calls = 0
        self._per_stream: dict[str, int] = {}
        self._blocks_seen: set = set()
        self._stream_of: dict[int, str] = {}
        self._layouts: dict[tuple, TokenLayout] = {}
        self._image_tokens: int | None = None
        self._options = transformer_options

    def mask_is_noop(self) -> bool:
        """Whether the attention masks of this forward's self-attention calls change nothing (``Family.mask_is_noop``,
        asked once per forward: it may read a tensor's values)."""
        if "mask_is_noop" not in self.state:
            self.state["mask_is_noop"] = bool(self.family.mask_is_noop(self.conds))
        return self.state["mask_is_noop"]

    def image_tokens(self) -> int:
        """Number of generated image/video tokens of this forward (0 when the family cannot tell)."""
        if self._image_tokens is None:
            grid = self.family.image_grid(self.x_shape, self._options, self.conds)
            self._image_tokens = math.prod(grid) if grid is not None else 0
        return self._image_tokens

    def next_layer(self, transformer_options: dict, args: tuple | None = None,
                   kwargs: dict | None = None) -> int | None:
        """The layer number of the attention call being made (and count it), or None for a cross-attention call.
        ``args``/``kwargs``: the override's arguments (without them the call is taken as a main self-attention)."""
        to = transformer_options
        self._options = to
        stream = "main"
        if args is not None:
            shape = call_shape(args, kwargs or {})
            if shape is None:
                return None
            stream = self.family.stream(self, *shape, to)
            if stream is None:
                return None
        position = self.calls
        self.calls += 1
        idx = to.get("block_index")
        if args is None and idx is None:
            return self._number(position, stream)
        if stream == "main" and idx is not None:
            key = (to.get("block_type"), int(idx))
            if key not in self._blocks_seen:
                self._blocks_seen.add(key)
                return self._number(int(idx) + self.layer_offsets.get(key[0], 0), stream)
            stream = "extra"  # a second self-attention in the same block (VACE)
        elif stream == "main" and self.family.is_indexed and args is not None:
            stream = "extra"  # outside the model's indexed blocks: a refiner
        k = self._per_stream.get(stream, 0)
        self._per_stream[stream] = k + 1
        if stream in ("main", "audio"):
            # blocks whose self-attentions do not run in this forward (LTX-2 STG skips a flagged block's video and
            # audio self-attention alike: comfy/ldm/lightricks/model.py, "stg_skip_self_attn")
            skipped = sorted(int(b) for b in to.get("stg_self_attn_blocks", ()) or ())
            for b in skipped:
                if b <= k:
                    k += 1
        if stream == "main":
            return self._number(k, stream)
        base = self.layer_offsets.get(stream)
        return self._number(position if base is None else base + k, stream)

    def _number(self, layer: int, stream: str) -> int:
        self._stream_of[layer] = stream
        return layer

    def layout(self, n_tokens: int, transformer_options: dict, stream: str = "main") -> TokenLayout:
        """The token layout of a self-attention call over ``n_tokens`` tokens (cached per token count and stream)."""
        key = (n_tokens, stream)
        lay = self._layouts.get(key)
        if lay is None:
            lay = self._layouts[key] = self.family.layout(n_tokens, self.x_shape, transformer_options, self.conds,
                                                          stream)
        return lay

    def context(self, layer: int, n_tokens: int, transformer_options: dict) -> CallContext:
        stream = self._stream_of.get(layer, "main")
        lay = self.layout(n_tokens, transformer_options, stream)
        if self.seen is not None:
            what = (stream, lay.describe(n_tokens))
            self.seen[what] = self.seen.get(what, 0) + 1
        return CallContext(layer=layer, step=self.step, is_self=True, chunk=self.chunk, total_steps=self.total,
                           layout=lay)


def call_shape(args: tuple, kwargs: dict) -> tuple[int, int, int] | None:
    """(query tokens, key tokens, query width H*D) of an override call, read without translating it; None when
    the arguments are not tensors of a known layout."""
    if len(args) < 2 or not all(hasattr(t, "shape") and hasattr(t, "dim") for t in args[:2]):
        return None
    q, k = args[0], args[1]
    if kwargs.get("skip_reshape", False):
        if q.dim() != 4 or k.dim() != 4:
            return None
        return int(q.shape[2]), int(k.shape[2]), int(q.shape[1] * q.shape[3])
    if q.dim() < 3 or k.dim() < 2:
        return None
    return int(q.shape[1]), int(k.shape[1]), int(math.prod(q.shape[2:]))
