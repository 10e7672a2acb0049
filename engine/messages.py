"""How configuration errors show the value they refuse: its repr, cut short (a widget or a YAML value can hold
megabytes; an error message must stay readable and small)."""

from __future__ import annotations

SHOWN_CHARS = 60
MAX_TEXT = 4096  # longest schedule or layer-list text read (a real one is a few dozen characters)


def shown(value, limit: int = SHOWN_CHARS) -> str:
    """repr(value), at most ``limit`` characters plus an ellipsis and the full length when cut."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - an object whose repr fails is still named
        text = f"<{type(value).__name__}>"
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"
