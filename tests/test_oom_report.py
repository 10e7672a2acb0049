"""engine/messages.oom_report: how a log line names an out-of-memory error (its message's first line, cut short, and
where it was raised), as the engine's spill warning and the node's model-OOM warning print it."""

import torch

from comfyui_sparse_attention.engine.messages import oom_report


def _raise_here(exc):
    raise exc


def test_the_first_line_and_the_raising_frame():
    try:
        _raise_here(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nsecond line"))
    except torch.OutOfMemoryError as exc:
        text = oom_report(exc)
    assert text.startswith("CUDA out of memory. Tried to allocate 2.00 GiB.; raised at test_oom_report.py:")
    assert text.endswith("in _raise_here")
    assert "second line" not in text


def test_a_frame_inside_torch_names_the_caller_outside_it():
    def ask():
        torch.nn.functional.interpolate(torch.zeros(1), size=2)  # raises in torch's own Python code

    try:
        ask()
    except NotImplementedError as exc:
        text = oom_report(exc)
    where = text.split("; raised at ")[1]
    assert where.startswith("functional.py:")  # torch/nn/functional.py
    assert where.endswith("called from test_oom_report.py:" + where.rsplit(":", 1)[1])
    assert where.rsplit(" in ", 1)[1] == "ask"


def test_long_or_empty_messages_and_no_traceback():
    assert oom_report(torch.OutOfMemoryError("x" * 1000), limit=10) == "x" * 10 + "..."
    assert oom_report(torch.OutOfMemoryError("")) == "OutOfMemoryError"
