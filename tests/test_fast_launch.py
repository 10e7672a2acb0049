"""kernels/fast_launch.py on the CPU: Triton's own autotune and heuristics wrappers around a real ``triton.jit``
function whose JIT run is replaced by a recorder (no GPU here), so the memo's key, the arguments it binds for the
direct launch and every reason to stay on Triton's path are checked. The GPU tests run the real kernels both ways
(tests/test_gpu_kernels.py, "fast_launch")."""

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from comfyui_sparse_attention.kernels import fast_launch  # noqa: E402
from fake_triton import Compiled as _Compiled, fake_triton as _fake_triton, toy_kernel as _toy  # noqa: E402


@pytest.fixture
def toy(monkeypatch):
    """An autotuned (one config), heuristics-wrapped ``_toy`` on the fake Triton: (kernel, compiled, calls)."""
    compiled, calls = _fake_triton(monkeypatch)
    kernel = triton.autotune(configs=[triton.Config({"BLOCK": 64}, num_warps=4)], key=["n"])(
        triton.heuristics({"EVEN": lambda a: a["n"] % 64 == 0})(_toy))
    fast_launch.reset()
    yield kernel, compiled, calls
    fast_launch.reset()


def _no_op(*args, **kwargs):
    pass


def _args(n=128, dtype=torch.float32, offset=0):
    x = torch.zeros(n + 8, dtype=dtype)[offset:offset + n]
    return (x, torch.zeros(n, dtype=dtype), n, 0.5)


def test_a_seen_key_is_relaunched_directly_with_the_calls_own_tensors(toy):
    kernel, compiled, calls = toy
    fast_launch.launch(kernel, (4,), _args(), {"MODE": 1})
    assert len(calls) == 1 and not compiled.launches
    args = _args()
    fast_launch.launch(kernel, (4,), args, {"MODE": 1})
    assert len(calls) == 1, "the second launch of the same key went through Triton's path"
    (launch,) = compiled.launches
    assert launch[:9] == (4, 1, 1, 1234, "fn-handle", ("meta",), None, None, None)
    # every parameter in the kernel's order: the call's own tensors and scalars, then the tuned config's BLOCK,
    # the heuristic's EVEN and the caller's MODE
    assert launch[9:11][0] is args[0] and launch[10] is args[1]
    assert launch[11:] == (128, 0.5, 64, True, 1)
    assert fast_launch.counts() == {"direct": 1, "normal": 1, "replayed": 0}


def test_a_constexpr_left_to_its_default_is_bound_and_passed(monkeypatch):
    """A kernel parameter with a default that the caller does not pass reaches the JIT's run unbound; the direct
    launch passes the default in its place, as Triton's JIT does (before, such a kernel never left Triton's path)."""
    from fake_triton import toy_kernel_with_default
    compiled, calls = _fake_triton(monkeypatch, kernel=toy_kernel_with_default)
    kernel = triton.autotune(configs=[triton.Config({"BLOCK": 64}, num_warps=4)], key=["n"])(
        triton.heuristics({"EVEN": lambda a: a["n"] % 64 == 0})(toy_kernel_with_default))
    fast_launch.reset()
    try:
        for _ in range(2):
            fast_launch.launch(kernel, (4,), _args(), {"MODE": 1})
        assert len(calls) == 1 and len(compiled.launches) == 1
        assert compiled.launches[0][11:] == (128, 0.5, 64, True, 1, 7)
    finally:
        fast_launch.reset()


@pytest.mark.parametrize("change", ["misaligned tensor", "dtype", "scalar", "constexpr"])
def test_what_triton_specialises_on_makes_a_new_key(toy, change):
    kernel, compiled, calls = toy
    fast_launch.launch(kernel, (4,), _args(), {"MODE": 1})
    other = {"misaligned tensor": (_args(offset=1), {"MODE": 1}), "dtype": (_args(dtype=torch.float16), {"MODE": 1}),
             "scalar": (_args(n=192), {"MODE": 1}), "constexpr": (_args(), {"MODE": 2})}[change]
    fast_launch.launch(kernel, (4,), *other)
    assert len(calls) == 2 and not compiled.launches
    fast_launch.launch(kernel, (4,), *other)
    assert len(calls) == 2 and len(compiled.launches) == 1


def test_a_tuple_grid_is_the_calls_own(toy):
    """A grid that the key does not determine (the batch size: a batch of 2 has a batch of 1's strides) is taken
    from each call."""
    kernel, compiled, calls = toy
    fast_launch.launch(kernel, (4,), _args(), {"MODE": 1})
    fast_launch.launch(kernel, (8, 2), _args(), {"MODE": 1})
    assert len(calls) == 1 and compiled.launches[0][:3] == (8, 2, 1)


def test_a_callable_grid_is_resolved_from_the_bound_arguments(toy):
    kernel, compiled, calls = toy
    grid = lambda meta: (meta["n"] // meta["BLOCK"], 3)  # noqa: E731
    fast_launch.launch(kernel, grid, _args(), {"MODE": 0})
    fast_launch.launch(kernel, grid, _args(), {"MODE": 0})
    assert compiled.launches[0][:3] == (2, 3, 1)


def test_after_tuning_the_winning_configs_launch_is_the_one_remembered(monkeypatch):
    """With several configs the autotuner runs each (its benchmark), then the winner: the memo keeps the winner's
    arguments, and a direct launch leaves ``best_config`` as the autotuner's own run does."""
    compiled, calls = _fake_triton(monkeypatch)
    timings = {32: 2.0, 64: 1.0, 128: 3.0}  # BLOCK 64 wins

    def bench(fn, quantiles=None):
        fn()
        return [timings[calls[-1][2]["BLOCK"]]] * 3

    kernel = triton.autotune(configs=[triton.Config({"BLOCK": b}) for b in (32, 64, 128)], key=["n"],
                             do_bench=bench)(triton.heuristics({"EVEN": lambda a: a["n"] % 64 == 0})(_toy))
    fast_launch.reset()
    try:
        fast_launch.launch(kernel, (4,), _args(), {"MODE": 1})
        assert calls[-1][2]["BLOCK"] == 64 and len(calls) > 3  # the benchmark ran every config, then the winner
        kernel.best_config = None
        fast_launch.launch(kernel, (4,), _args(), {"MODE": 1})
        assert compiled.launches[0][11:] == (128, 0.5, 64, True, 1)
        assert kernel.best_config.kwargs == {"BLOCK": 64}
    finally:
        fast_launch.reset()


def test_a_bool_an_int_and_a_float_of_equal_value_are_different_keys(toy):
    kernel, compiled, calls = toy
    for scale in (1, 1.0, True):
        fast_launch.launch(kernel, (4,), (*_args()[:3], scale), {"MODE": 1})
    assert len(calls) == 3 and not compiled.launches


@pytest.mark.parametrize("why", ["turned off", "interpreter", "launch hook", "CPU tensors", "debug",
                                 "another pre-run hook"])
def test_triton_keeps_the_launch_when_the_direct_path_is_not_known_equivalent(toy, monkeypatch, why):
    kernel, compiled, calls = toy
    if why == "turned off":
        monkeypatch.setenv("SPARSE_ATTN_FAST_LAUNCH", "0")
    elif why == "interpreter":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    elif why == "CPU tensors":
        monkeypatch.setattr(fast_launch, "on_gpu", lambda t: t.is_cuda)
    elif why == "debug":
        monkeypatch.setattr(triton.knobs.runtime, "debug", True)
    elif why == "another pre-run hook":
        fast_launch.launch(kernel, (4,), _args(), {"MODE": 1})  # remembered first
        monkeypatch.setattr(_toy, "pre_run_hooks", [_no_op])
        calls.clear()
        fast_launch.reset()
        fast_launch.launch(kernel, (4,), _args(), {"MODE": 1})
        fast_launch.launch(kernel, (4,), _args(), {"MODE": 1})
        assert len(calls) == 2 and not compiled.launches
        return
    else:
        hook = triton.knobs.runtime.launch_enter_hook
        if hasattr(hook, "calls"):  # a chain of hooks (newer Tritons)
            monkeypatch.setattr(hook, "calls", [_no_op])
        else:
            monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", _no_op)
    for _ in range(3):
        fast_launch.launch(kernel, (4,), _args(), {"MODE": 1})
    assert len(calls) == 3 and not compiled.launches
    assert fast_launch.counts() == {"direct": 0, "normal": 3, "replayed": 0}


def test_a_compiled_kernel_without_a_launcher_keeps_tritons_path(toy, monkeypatch, caplog):
    kernel, compiled, calls = toy
    monkeypatch.delattr(_Compiled, "run")
    with caplog.at_level("INFO"):
        for _ in range(3):
            fast_launch.launch(kernel, (4,), _args(), {"MODE": 1})
    assert len(calls) == 3
    assert "launches through Triton's own path" in caplog.text


def test_host_helpers_match_tritons():
    from comfyui_sparse_attention.kernels._triton_common import cdiv, next_pow2
    for n in range(1, 70_000, 97):
        assert next_pow2(n) == triton.next_power_of_2(n)
        assert cdiv(n, 128) == triton.cdiv(n, 128) and cdiv(n, 64) == triton.cdiv(n, 64)
    assert [next_pow2(n) for n in (1, 2, 3, 4, 5, 32768, 32769)] == [1, 2, 4, 4, 8, 32768, 65536]


def test_the_memo_is_bounded(toy, monkeypatch):
    kernel, compiled, calls = toy
    monkeypatch.setattr(fast_launch, "MEMO_LIMIT", 3)
    for n in (64, 128, 192, 256):
        fast_launch.launch(kernel, (4,), _args(n=n), {"MODE": 1})
    fast_launch.launch(kernel, (4,), _args(n=256), {"MODE": 1})
    assert len(compiled.launches) == 1  # the newest key survived the clear
    fast_launch.launch(kernel, (4,), _args(n=64), {"MODE": 1})
    assert len(calls) == 5
