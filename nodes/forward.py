"""Per-forward facts: what every attention call of one model evaluation shares, computed once per forward.

The patch's APPLY_MODEL wrapper stores a Forward in the forward's ``transformer_options``; each attention call
reads it back. Step, total steps and batch-chunk identity change once per forward, so they are computed
here and not on every attention call; the token layout is computed once per token count.
"""

from __future__ import annotations

from ..engine import CallContext, RunClock, TokenLayout
from .families import Family

INFO_KEY = "sparse_attention_forward"


def step_index(transformer_options: dict) -> tuple[int, int | None]:
    """(step, total_steps) of this model call within the sampling run.

    The current sigma is located in the run's schedule ``sample_sigmas`` (descending): an exact match
    gives its index; an intermediate sigma of a multi-evaluation sampler (heun, dpm_2, …) belongs to the
    step it lies in. Without a schedule: step 0.
    """
    sigmas = transformer_options.get("sigmas")
    sched = transformer_options.get("sample_sigmas")
    if sigmas is None or sched is None:
        return 0, None
    s = float(sigmas.reshape(-1)[0])
    vals = [float(x) for x in sched.reshape(-1)]
    total = max(1, len(vals) - 1)
    tol = 1e-5 * max(1.0, abs(s))
    count = sum(1 for x in vals if x >= s - tol)
    return min(max(0, count - 1), total - 1), total


def chunk_of(transformer_options: dict) -> tuple:
    """Identity of the batch chunk: the cond/uncond order, plus the context window's span when one is set."""
    chunk = tuple(int(c) for c in transformer_options.get("cond_or_uncond", ()) or ())
    window = transformer_options.get("context_window")
    if window is not None and hasattr(window, "index_list"):
        chunk = chunk + (tuple(window.index_list[:1]) + tuple(window.index_list[-1:]),)
    return chunk


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
    """One model evaluation: family, latent shape, run step, chunk, and the counter of self-attention calls
    (the layer number of models that do not report ``block_index``).

    ``clock`` places this sampler in the whole run (engine/schedule.py): the run step is the clock's offset plus
    the position of the current sigma in the sampler's schedule. Without a schedule in the options, ``counter``
    counts steps and the run's length is unknown."""

    def __init__(self, family: Family, x_shape, transformer_options: dict, layer_offsets: dict[str, int],
                 clock: RunClock | None = None, counter: StepCounter | None = None):
        self.family = family
        self.x_shape = tuple(x_shape) if x_shape is not None else None
        local, local_total = step_index(transformer_options)
        if local_total is None and counter is not None:
            self.step, self.total = counter(transformer_options), None
        elif clock is not None and clock.total is not None:
            self.step, self.total = clock.offset + local, clock.total
        else:
            self.step, self.total = local, local_total
        self.chunk = chunk_of(transformer_options)
        self.layer_offsets = layer_offsets
        self.calls = 0
        self._layouts: dict[int, TokenLayout] = {}

    def next_layer(self, transformer_options: dict) -> int:
        """The layer number of the self-attention call being made (and count it): ``block_index`` in model
        order when the model reports it, else the position of this call in the forward."""
        position = self.calls
        self.calls += 1
        idx = transformer_options.get("block_index")
        if idx is None:
            return position
        return int(idx) + self.layer_offsets.get(transformer_options.get("block_type"), 0)

    def layout(self, n_tokens: int, transformer_options: dict) -> TokenLayout:
        """The token layout of a self-attention call over ``n_tokens`` tokens (cached per token count)."""
        lay = self._layouts.get(n_tokens)
        if lay is None:
            lay = self._layouts[n_tokens] = self.family.layout(n_tokens, self.x_shape, transformer_options)
        return lay

    def context(self, layer: int, n_tokens: int, transformer_options: dict) -> CallContext:
        return CallContext(layer=layer, step=self.step, is_self=True, chunk=self.chunk, total_steps=self.total,
                           layout=self.layout(n_tokens, transformer_options))
