"""ComfyUI-facing layer: the only code in the pack that imports ``comfy``.

Exposes ``NODE_CLASS_MAPPINGS`` / ``NODE_DISPLAY_NAME_MAPPINGS`` for ComfyUI's loader. V3
``io.ComfyNode`` classes are registered through these V1 mappings, which ComfyUI 0.3.64+ accepts.
"""

from .registry import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
