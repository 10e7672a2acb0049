"""Node registry: every node class of the pack, keyed by its permanent node id."""

from __future__ import annotations

from .nodes_calibrate import NODES as CALIBRATE_NODES
from .nodes_compare import SparseAttentionCompare
from .nodes_sparse import NODES as SPARSE_NODES

NODES = [*SPARSE_NODES, SparseAttentionCompare, *CALIBRATE_NODES]

NODE_CLASS_MAPPINGS = {cls.GET_SCHEMA().node_id: cls for cls in NODES}
NODE_DISPLAY_NAME_MAPPINGS = {cls.GET_SCHEMA().node_id: cls.GET_SCHEMA().display_name for cls in NODES}
