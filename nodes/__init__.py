"""ComfyUI-facing layer: the only code in the pack that imports ``comfy``.

``nodes.registry`` exposes ``NODE_CLASS_MAPPINGS`` / ``NODE_DISPLAY_NAME_MAPPINGS`` for ComfyUI's loader (V3
``io.ComfyNode`` classes registered through the V1 mappings, which ComfyUI 0.3.64+ accepts). Importing this
package itself imports nothing from ComfyUI: the family registry, the call translation and the per-forward
facts (families.py, call.py, forward.py) are plain Python, testable without ComfyUI.
"""
