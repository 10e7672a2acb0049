"""A GPU-less stand-in for what kernels/fast_launch.py reads of Triton: a real ``triton.jit`` function whose JIT run is
replaced by a recorder returning a fake compiled kernel, whose launcher records what it was given (tests of
fast_launch and kernels/replay.py)."""

import triton
import triton.language as tl
from torch.utils._python_dispatch import _disable_current_modes

from comfyui_sparse_attention.kernels import fast_launch


@triton.jit
def toy_kernel(X, Y, n, scale, BLOCK: tl.constexpr, EVEN: tl.constexpr, MODE: tl.constexpr):
    pass


@triton.jit
def toy_kernel_with_default(X, Y, n, scale, BLOCK: tl.constexpr, EVEN: tl.constexpr, MODE: tl.constexpr,
                            EXTRA: tl.constexpr = 7):
    pass


@triton.jit
def attn_kernel(Q, K, V, Out, R, n, scale, BLOCK: tl.constexpr, EVEN: tl.constexpr, MODE: tl.constexpr):
    pass


class Compiled:
    """Stands for Triton's CompiledKernel: its launcher records what it was given, and with ``compute`` also does
    what a kernel would: ``compute(*kernel_args)`` (the arguments after the launcher's nine), run with PyTorch's
    dispatch modes off, as a real launcher's work is invisible to them."""

    def __init__(self, compute=None):
        self.function, self.packed_metadata, self.launches, self.compute = "fn-handle", ("meta",), [], compute

    def run(self, *a):
        self.launches.append(a)
        if self.compute is not None:
            with _disable_current_modes():
                self.compute(*a[9:])


def fake_triton(monkeypatch, kernel=toy_kernel, compute=None):
    """A GPU-less stand-in for what the direct path reads (device, stream), and ``kernel``'s JIT run replaced by one
    that calls the pre-run hooks as Triton's does, then ``compute(*args)`` if given, and returns a fake compiled
    kernel (with the same ``compute``); returns (compiled, calls), calls the (grid, args, kwargs) of each run of
    Triton's own path."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("SPARSE_ATTN_FAST_LAUNCH", raising=False)
    monkeypatch.setattr(fast_launch, "on_gpu", lambda t: True)
    monkeypatch.setattr(fast_launch, "current_device", lambda: 0)
    monkeypatch.setattr(fast_launch, "current_stream", lambda device: 1234)
    compiled, calls = Compiled(compute), []

    def run(*args, grid, warmup, **kwargs):
        for hook in kernel.pre_run_hooks:
            hook(*args, **kwargs)
        calls.append((grid, args, kwargs))
        if compute is not None:
            with _disable_current_modes():
                compute(*args)
        return compiled

    monkeypatch.setattr(kernel, "run", run)
    return compiled, calls


