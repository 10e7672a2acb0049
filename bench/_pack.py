"""Import the repository as the package ``comfyui_sparse_attention`` (as ComfyUI does) for the bench scripts."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAME = "comfyui_sparse_attention"


def load(submodule: str = ""):
    """The pack (or ``NAME.submodule``), importing the repository root as a package once."""
    if NAME not in sys.modules:
        spec = importlib.util.spec_from_file_location(NAME, ROOT / "__init__.py",
                                                      submodule_search_locations=[str(ROOT)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[NAME] = mod
        spec.loader.exec_module(mod)
    return importlib.import_module(f"{NAME}.{submodule}" if submodule else NAME)
