"""The method layer: policies, schedule, caches and per-call decisions. Imports no ComfyUI code.

Public: SparseConfig (validated settings), CallContext / TokenLayout (what a call is), SparseEngine
(decide dense / anchor / reuse, select, compute, compensate), DeviceEngines (one engine per device of a run),
RunStats (per-run statistics).
"""

from .config import Densities, SparseConfig, parse_layers
from .context import CallContext, TokenLayout
from .engine import SparseEngine
from .engines import DeviceEngines
from .schedule import AnchorSchedule, Coordinate, RunClock, locate_run
from .stats import RunStats

__all__ = ["AnchorSchedule", "CallContext", "Coordinate", "Densities", "DeviceEngines", "RunClock", "RunStats",
           "SparseConfig", "SparseEngine", "TokenLayout", "locate_run", "parse_layers"]
