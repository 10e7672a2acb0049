"""hybrid policy: the static structure with half the budget, united with pooled top-k blocks for the rest
(docs/method.md, "Block selection")."""

from __future__ import annotations

from .policy import Policy
from .policy_block_topk import build_block_topk
from .selection import BlockSelection


class HybridPolicy(Policy):
    """Local windows + sinks + text (static) plus dynamic top-k blocks from pooled scores."""

    name = "hybrid"

    def select(self, q, k, lse, layout, cfg, *, scale, backend) -> BlockSelection:
        return build_block_topk(q, k, layout, cfg, hybrid=True, scale=scale)
