"""How configuration errors show the value they refuse: its repr, cut short (a widget or a YAML value can hold
megabytes; an error message must stay readable and small); and how a log line names an out-of-memory error."""

from __future__ import annotations

import os
import traceback

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


def _frame(f: traceback.FrameSummary) -> str:
    return f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}"


def _in_torch(filename: str) -> bool:
    import torch  # here: the messages module stays importable without it

    return os.path.abspath(filename).startswith(os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)


def oom_report(exc: BaseException, limit: int = 400) -> str:
    """An out-of-memory error in one line for a log: its message's lines joined by "; " (PyTorch's names the size it
    tried to allocate and what was free: on one line under the native allocator, over several under cudaMallocAsync),
    cut at ``limit`` characters, then where it was raised: the innermost frame and, when that lies in torch's own
    package, the innermost frame outside it (the model's or the pack's line that asked). A string, so that the caller
    can let go of the exception, whose traceback keeps the failed attempt's tensors."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = "; ".join(lines) if lines else type(exc).__name__
    if len(text) > limit:
        text = text[:limit] + "..."
    tb = exc.__traceback__
    frames = traceback.StackSummary.extract(traceback.walk_tb(tb), lookup_lines=False) if tb is not None else []
    if not frames:
        return text
    where = [_frame(frames[-1])]
    in_torch = [_in_torch(f.filename) for f in frames]
    if in_torch[-1]:
        outside = [f for f, t in zip(frames, in_torch) if not t]
        if outside:
            where.append(f"called from {_frame(outside[-1])}")
    return f"{text}; raised at {', '.join(where)}"
