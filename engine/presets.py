"""Presets: ``presets/*.yaml`` files, one per model family or use case.

Each file holds a ``title`` and a ``sparse`` mapping of SparseConfig fields; its comments state where the
values come from. Loading validates every field and names the file and field on error.
"""

from __future__ import annotations

from pathlib import Path

from .config import SparseConfig
from .preset_yaml import read_yaml

PRESET_DIR = Path(__file__).resolve().parents[1] / "presets"


def list_presets(directory: Path = PRESET_DIR) -> list[str]:
    """Preset names (file stems), sorted."""
    return sorted(p.stem for p in directory.glob("*.yaml"))


def preset_title(name: str, directory: Path = PRESET_DIR) -> str:
    doc = read_yaml(directory / f"{name}.yaml") or {}
    return str(doc.get("title", name)) if isinstance(doc, dict) else name


def load_preset(name: str, overrides: dict | None = None, directory: Path = PRESET_DIR) -> SparseConfig:
    """The validated SparseConfig of preset ``name`` with ``overrides`` applied."""
    path = directory / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"preset {name!r} not found in {directory} (have: {', '.join(list_presets(directory))})")
    return SparseConfig.from_yaml(path, overrides=overrides)
