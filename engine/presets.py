"""Presets: ``presets/*.yaml`` files, one per model family or use case.

Each file holds a ``title`` and a ``sparse`` mapping of SparseConfig fields; its comments state where the
values come from. Loading validates every field and names the file and field on error.
"""

from __future__ import annotations

import hashlib
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
        shown = str(name)
        if "/" in shown or "\\" in shown:  # a path: only its last part, so no directory shows in the error
            shown = ".../" + shown.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]
        raise ValueError(f"preset {shown[:60]!r} is not one of the {len(names)} presets in the pack's "
                         f"{directory.name}/ folder (a preset is a .yaml file there, named without a path; the node's "
                         "list shows them)")
    return SparseConfig.from_yaml(directory / f"{name}.yaml", overrides=overrides)


def preset_fingerprint(name: str | None, directory: Path = PRESET_DIR) -> tuple:
    """((name, sha256 of the file's bytes), ...) of preset ``name``'s file, or of every preset file when ``name`` is
    None; a missing or unreadable file gives (name, None). Changes when a preset file is edited, added or removed
    (presets are small: read_yaml refuses files over 1 MiB)."""
    paths = [directory / f"{name}.yaml"] if name is not None else sorted(directory.glob("*.yaml"))
    out = []
    for path in paths:
        try:
            out.append((path.stem, hashlib.sha256(path.read_bytes()).hexdigest()))
        except OSError:
            out.append((path.stem, None))
    return tuple(out)
