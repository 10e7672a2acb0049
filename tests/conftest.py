"""Test harness: import the pack as a package by name, and the `gpu` / `comfyui` markers.

The repository root is mapped to the package ``comfyui_sparse_attention`` (as ComfyUI imports it
from ``custom_nodes/<folder>``): tests never import ``nodes`` or ``kernels`` as top-level modules,
because ComfyUI owns a top-level ``nodes``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "comfyui_sparse_attention"


def _import_pack():
    if PACKAGE in sys.modules:
        return sys.modules[PACKAGE]
    spec = importlib.util.spec_from_file_location(PACKAGE, ROOT / "__init__.py",
                                                  submodule_search_locations=[str(ROOT)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = module
    spec.loader.exec_module(module)
    return module


_import_pack()


@pytest.fixture
def bench_import(monkeypatch):
    """``bench_import("name")`` imports bench/name.py as a module, bench/ on the path (the bench scripts import each
    other by name, as when run from bench/)."""
    import importlib

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    return importlib.import_module


@pytest.fixture(scope="module")
def compile_report_module():
    """tools/compile_report.py as a module (it compiles for any NVIDIA target without a GPU); skips where this Triton
    has no NVIDIA backend."""
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        import triton.backends.nvidia  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"this Triton has no NVIDIA backend: {exc}")
    spec = importlib.util.spec_from_file_location("compile_report", ROOT / "tools" / "compile_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def comfyui_path() -> Path | None:
    """The ComfyUI source tree named by COMFYUI_PATH, or None."""
    p = os.environ.get("COMFYUI_PATH")
    if p and (Path(p) / "comfy").is_dir():
        return Path(p)
    return None


def comfyui_version(root: Path | None = None) -> tuple[int, ...]:
    """The version of a ComfyUI tree (default: COMFYUI_PATH's), from its comfyui_version.py."""
    import re

    root = root or comfyui_path()
    text = (root / "comfyui_version.py").read_text()
    return tuple(int(x) for x in re.search(r'__version__ = "([0-9.]+)"', text).group(1).split("."))


def workflow_needs(doc: dict) -> tuple[int, ...]:
    """The oldest ComfyUI a bundled workflow loads on (tools/build_workflows.py records newer ones)."""
    v = (doc.get("extra") or {}).get("sparse_attention_min_comfyui", "0.3.64")
    return tuple(int(x) for x in str(v).split("."))


def pytest_collection_modifyitems(config, items):
    import torch

    no_cuda = pytest.mark.skip(reason="needs a CUDA GPU (marker gpu)")
    require = os.environ.get("SPARSE_ATTN_REQUIRE_COMFYUI") == "1"
    no_comfy = pytest.mark.skip(
        reason="!!! COMFYUI_PATH is not set to a ComfyUI source tree: ComfyUI integration tests SKIPPED !!!")
    have_comfy = comfyui_path() is not None
    if require and not have_comfy and any("comfyui" in it.keywords for it in items):
        raise pytest.UsageError("SPARSE_ATTN_REQUIRE_COMFYUI=1 but COMFYUI_PATH does not point at a ComfyUI tree")
    for it in items:
        if "gpu" in it.keywords and not torch.cuda.is_available():
            it.add_marker(no_cuda)
        if "comfyui" in it.keywords and not have_comfy:
            it.add_marker(no_comfy)
