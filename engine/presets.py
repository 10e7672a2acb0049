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
    """The validated SparseConfig of preset ``name`` (a file stem of ``directory``, never a path: a name from a
    workflow or the server's API reads no other file) with ``overrides`` applied."""
    names = list_presets(directory)
    if not isinstance(name, str) or name not in names:
        raise ValueError(f"preset {str(name)[:60]!r} is not one of the presets in {directory} "
                         f"(have: {', '.join(names)})")
    return SparseConfig.from_yaml(directory / f"{name}.yaml", overrides=overrides)
