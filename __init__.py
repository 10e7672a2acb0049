"""ComfyUI entry point of the Sparse Attention node pack.

ComfyUI imports this file as ``custom_nodes.<folder>``. Importing it never fails because Triton, a GPU
or an optional package is missing: the node registry is imported under a guard and the reason is
logged once. The attention primitives (``kernels``) and the method (``engine``) import no ComfyUI code.
"""

import logging

log = logging.getLogger(__name__)

WEB_DIRECTORY = "./web"
NODE_CLASS_MAPPINGS = {}
NODE_DISPLAY_NAME_MAPPINGS = {}

try:
    from .nodes.registry import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: F811
except ImportError as exc:  # outside ComfyUI (tests, tools): no `comfy` package to patch
    log.debug("sparse attention: nodes not registered (%s)", exc)

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
