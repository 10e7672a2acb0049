"""What a selection policy is, and the one place where policies are registered.

A policy turns one anchor call (q, k, the row LSE when it asks for one, the token layout) into a Selection
(engine/selection.py) that the engine runs, caches and reuses. What differs between policies is said by the
policy object itself — whether it needs the dense pass's LSE, whether it re-selects at every step, whether
its selection depends on the shape alone — so the engine never asks which method is configured
(docs/architecture.md: "Adding a policy").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

    from .config import SparseConfig
    from .context import TokenLayout


class Policy:
    """A selection method. Subclasses set ``name`` and implement ``select``.

    needs_lse: the anchor computes dense attention with its row LSE (exact selection uses it).
    shape_only: the selection depends only on (B, H, N, layout, device) and is built once per shape.
    """

    name: str = ""
    needs_lse: bool = False
    shape_only: bool = False

    def reselects(self, cfg: "SparseConfig") -> bool:
        """True when reuse steps select again from the current q/k (and keep only the anchor's residual)."""
        return False

    def prepare(self, q: "torch.Tensor", layout: "TokenLayout", cfg: "SparseConfig", *, backend: str):
        """Work of an anchor that reads only q (B, H, N, D), set up before the anchor's dense call so that it can
        run beside it (``kernels.beside``: launched when ``select`` asks for it, on a side stream); what it returns
        goes to ``select`` as ``prepared``. None (the default): nothing to prepare. A returned object has
        ``heads(index)``, the same for a slice or an int64 index tensor of the heads (engine/layer_density.py
        selects head groups apart)."""
        return None

    def select(self, q: "torch.Tensor", k: "torch.Tensor", lse: "torch.Tensor | None", layout: "TokenLayout",
               cfg: "SparseConfig", *, scale: float | None, backend: str, prepared=None):
        """q, k: (B, H, N, D); lse: fp32 (B, H, N) when ``needs_lse``, else None; prepared: what ``prepare``
        returned for this q (or its ``heads(...)``), passed only when not None (a policy without ``prepare`` need
        not take it). Returns a Selection."""
        raise NotImplementedError


def _registered() -> dict[str, Policy]:
    from .policy_block_topk import BlockTopkPolicy
    from .policy_hybrid import HybridPolicy
    from .policy_mc_sparse import McSparsePolicy
    from .policy_static import StaticPolicy

    # The registration list: one line per policy, in the order users see them (best quality first).
    return {p.name: p for p in (McSparsePolicy(), BlockTopkPolicy(), HybridPolicy(), StaticPolicy())}


_POLICIES: dict[str, Policy] | None = None
DENSE = "dense"  # the method that selects nothing: every call runs the model's own attention


def policies() -> dict[str, Policy]:
    """Every registered policy by name (imported on first use: the policy modules import the kernels)."""
    global _POLICIES
    if _POLICIES is None:
        _POLICIES = _registered()
    return _POLICIES


def method_names() -> tuple[str, ...]:
    """Methods a configuration may name: the registered policies, then ``dense``."""
    return (*policies(), DENSE)


def policy_for(method: str) -> Policy | None:
    """The policy of ``method`` (None for ``dense``); ValueError for an unknown name."""
    if method == DENSE:
        return None
    try:
        return policies()[method]
    except KeyError:
        raise ValueError(f"method: must be one of {method_names()}, got {method!r}") from None
