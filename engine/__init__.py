"""The method layer: policies, schedule, caches and per-call decisions. Imports no ComfyUI code.

Public: SparseConfig (validated settings), CallContext / TokenLayout (what a call is), SparseEngine
(decide dense / anchor / reuse, select, compute, compensate), RunStats (per-run statistics).
"""

from .config import AnchorSchedule, Densities, SparseConfig, parse_layers
from .context import CallContext, TokenLayout
from .engine import SparseEngine
from .stats import RunStats

__all__ = ["AnchorSchedule", "CallContext", "Densities", "RunStats", "SparseConfig", "SparseEngine", "TokenLayout",
           "parse_layers"]
