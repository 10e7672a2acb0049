"""engine/messages.oom_report: how a log line names an out-of-memory error (its message's first line, cut short, and
where it was raised), as the engine's spill warning and the node's model-OOM warning print it."""

import torch

from comfyui_sparse_attention.engine.messages import oom_report


def _raise_here(exc):
    raise exc


def test_the_message_and_the_raising_frame():
    try:
        _raise_here(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB."))
    except torch.OutOfMemoryError as exc:
        text = oom_report(exc)
    assert text.startswith("CUDA out of memory. Tried to allocate 2.00 GiB.; raised at test_oom_report.py:")
    assert text.endswith("in _raise_here")


def test_a_message_over_several_lines_keeps_its_numbers():
    """Under cudaMallocAsync PyTorch puts what was requested and what was free on lines of their own."""
    msg = ("Allocation on device 0 would exceed allowed memory. (out of memory)\nCurrently allocated     : 88.10 GiB\n"
           "Requested               : 2.00 GiB\n\nFree (according to CUDA): 1.20 GiB")
    text = oom_report(torch.OutOfMemoryError(msg))
    assert text == ("Allocation on device 0 would exceed allowed memory. (out of memory); Currently allocated     : "
                    "88.10 GiB; Requested               : 2.00 GiB; Free (according to CUDA): 1.20 GiB")


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
    assert oom_report(torch.OutOfMemoryError(" \n ")) == "OutOfMemoryError"
