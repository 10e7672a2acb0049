"""The pack's engine as the quality testbed's attention function: the only code of the quality bench that touches
the engine API (SparseConfig, SparseEngine, CallContext, TokenLayout).

    attn = EngineAttention({"method": "block_topk", "density": 0.15, ...}, total_steps=30, context=model.CONTEXT,
                           dense_fn=model.sdpa_attention)
    with attn.run():
        videos = evaluate.sample(net, noise, labels, steps=30, attn=attn, ...)
    attn.stats   # calls dense / anchor / reuse, density, anchor fidelity of that run
"""

from __future__ import annotations

from contextlib import contextmanager

from _pack import load


class EngineAttention:
    """``attention(q, k, v) -> o`` backed by one SparseEngine; the call's layer, step, batch chunk and token grid
    come from the testbed's ``context`` dict ("layer", "step", "grid" (F, H, W), "batch_offset")."""

    def __init__(self, config: dict, total_steps: int, context: dict, dense_fn=None):
        """config: SparseConfig fields (ValueError naming the field when invalid); dense_fn(q, k, v) -> o: the
        model's own dense attention for the engine's dense calls (None: the pack's dense kernel)."""
        self._eng = load("engine")
        self.engine = self._eng.SparseEngine(self._eng.SparseConfig.from_dict(config, source="quality setting"))
        self.total_steps, self.context, self.dense_fn = total_steps, context, dense_fn
        self.stats: dict | None = None

    def __call__(self, q, k, v):
        """q, k, v: (B, H, N, D) self-attention inputs (the 1/sqrt(D) scale not applied); returns (B, H, N, D)
        in q's dtype."""
        c = self.context
        ctx = self._eng.CallContext(layer=c["layer"], step=c["step"], total_steps=self.total_steps,
                                    chunk=(c.get("batch_offset", 0),),
                                    layout=self._eng.TokenLayout(grid=tuple(c["grid"])))
        return self.engine.attend(q, k, v, ctx, dense_fn=self.dense_fn)

    @contextmanager
    def run(self):
        """One sampling run: begin_run before, end_run after; ``stats`` then holds the run's totals."""
        self.engine.begin_run()
        try:
            yield self
        finally:
            t = self.engine.end_run().totals()
            sparse = t["anchors"] + t["reuses"]  # dense calls count density 1 in the run's mean
            self.stats = {"calls": t["calls"], "dense": t["dense"], "anchor": t["anchors"], "reuse": t["reuses"],
                          "fallback": t["fallbacks"], "density": t["density"],
                          "density_sparse": (t["density"] * t["calls"] - t["dense"]) / sparse if sparse else None,
                          "fidelity_mean": t["fidelity_mean"], "fidelity_max": t["fidelity_max"],
                          "seconds": t["seconds"]}
