"""kernels/replay.py on the CPU, on the fake Triton of tests/fake_triton.py whose "kernel" computes
O = Q * scale + K - V + R (so a replay that passed a wrong tensor shows in the output): a call that is exactly an
allocation and one direct launch is replayed once two recorded calls agree, and every other kind of call keeps running
itself. The GPU tests replay the engine's real reuse calls (tests/test_gpu_kernels.py, "replay")."""

import gc
import weakref

import pytest
import torch

triton = pytest.importorskip("triton")

from comfyui_sparse_attention.kernels import fast_launch, replay  # noqa: E402
from fake_triton import attn_kernel, fake_triton  # noqa: E402


def _compute(Q, K, V, Out, R, n, scale, *constexprs):
    Out.copy_(Q * scale + K - V + R)


@pytest.fixture
def kern(monkeypatch):
    """The autotuned fake kernel: (kernel, compiled launcher, Triton-path calls)."""
    compiled, calls = fake_triton(monkeypatch, attn_kernel, _compute)
    monkeypatch.setattr(replay, "ENABLED", True)
    kernel = triton.autotune(configs=[triton.Config({"BLOCK": 64}, num_warps=4)], key=["n"])(
        triton.heuristics({"EVEN": lambda a: a["n"] % 64 == 0})(attn_kernel))
    fast_launch.reset()
    yield kernel, compiled, calls
    fast_launch.reset()


HELD = torch.arange(64, dtype=torch.float32).view(2, 32) / 7  # stands for a cached residual


def _call(kernel, extra=None, before=None, runs=None):
    """A kernel call like the pack's: allocate the output, launch once (``extra(q, out)`` runs first if given)."""
    def fn(q, k, v):
        if runs is not None:
            runs.append(1)
        out = torch.empty_like(q)
        r = HELD if extra is None else extra(q, out)
        fast_launch.launch(kernel, (2,), (q, k, v, out, r, q.shape[-1], 0.5), {"MODE": 1}, before=before)
        return out
    return fn


def _qkv(seed, shape=(2, 32), dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=g).to(dtype) for _ in range(3))


def _expect(q, k, v, r=HELD):
    return q * 0.5 + k - v + r


def test_a_single_launch_call_is_replayed_after_two_agreeing_recordings(kern):
    kernel, compiled, calls = kern
    rep, runs, befores = replay.CallReplay(), [], []
    fn = _call(kernel, before=lambda: befores.append(1), runs=runs)
    for i in range(6):
        q, k, v = _qkv(i)
        out = rep.run(fn, q, k, v, (0.5, "auto"))
        assert torch.equal(out, _expect(q, k, v)), f"call {i}"
    # call 0 tunes (Triton's path), calls 1 and 2 are recorded, 3-5 replayed without running fn
    assert len(runs) == 3 and len(calls) == 1
    assert fast_launch.counts() == {"direct": 2, "normal": 1, "replayed": 3}
    assert len(befores) == 6, "the launch's `before` did not run at each replay"
    last = compiled.launches[-1]
    assert last[9] is q and last[10] is k and last[11] is v and last[12] is out and last[13] is HELD
    assert last[14:] == (32, 0.5, 64, False, 1)  # n, scale, the config's BLOCK, the heuristic's EVEN, MODE


def test_a_call_that_runs_another_operator_is_never_replayed(kern):
    kernel, compiled, calls = kern
    rep, runs = replay.CallReplay(), []

    def zeroed(q, out):
        out.zero_()
        return HELD
    fn = _call(kernel, zeroed, runs=runs)
    for i in range(5):
        q, k, v = _qkv(i)
        assert torch.equal(rep.run(fn, q, k, v), _expect(q, k, v))
    assert len(runs) == 5 and fast_launch.counts()["replayed"] == 0
    assert "zero_" in rep.refused


def test_a_temporary_launch_argument_is_never_replayed(kern):
    """A tensor the call makes afresh (a workspace, a counter) must not be replayed with the recorded one."""
    kernel, compiled, calls = kern
    rep, runs = replay.CallReplay(), []
    fn = _call(kernel, lambda q, out: HELD.clone(), runs=runs)
    for i in range(5):
        q, k, v = _qkv(i)
        assert torch.equal(rep.run(fn, q, k, v), _expect(q, k, v))
    assert len(runs) == 5 and fast_launch.counts()["replayed"] == 0 and rep.refused


def test_a_temporary_allocation_that_is_only_written_by_the_launch_differs_between_calls(kern):
    """An uninitialised temporary passes the operator check. The recording holds the first recorded call's, so the
    second call's cannot land on its memory (as a caching allocator would do), and the two recordings disagree."""
    kernel, compiled, calls = kern
    rep, runs, made = replay.CallReplay(), [], []

    def temporary(q, out):
        t = torch.empty_like(HELD)
        made.append(weakref.ref(t))
        return t
    fn = _call(kernel, temporary, runs=runs)
    for i in range(5):
        rep.run(fn, *_qkv(i))
        compiled.launches.clear()  # the fake launcher's log would hold the call's temporary too
        if i == 1:
            gc.collect()
            assert made[1]() is not None, "the first recording let its call's temporary go"
    assert len(runs) == 5 and fast_launch.counts()["replayed"] == 0
    assert rep.refused == "its launch's other arguments differ between calls"


def test_a_view_of_q_passed_to_the_launch_is_never_replayed(kern):
    """Even with the same q object every call (its address the same), a view of it is the call's own memory."""
    kernel, compiled, calls = kern
    rep, runs = replay.CallReplay(), []
    fn = _call(kernel, lambda q, out: q.view(2, 32), runs=runs)
    q, k, v = _qkv(0)
    for _ in range(5):
        assert torch.equal(rep.run(fn, q, k, v), q * 0.5 + k - v + q)
    assert len(runs) == 5 and "view" in rep.refused


@pytest.mark.parametrize("change", ["shape", "dtype", "misaligned", "key"])
def test_a_call_the_plan_does_not_fit_runs_itself_and_is_planned_again(kern, change):
    kernel, compiled, calls = kern
    rep, runs = replay.CallReplay(), []
    fn = _call(kernel, lambda q, out: HELD if q.shape == HELD.shape else torch.zeros_like(q), runs=runs)
    for i in range(4):
        rep.run(fn, *_qkv(i), (0.5,))
    assert len(runs) == 3 and rep.plan is not None
    key = (0.5,)
    if change == "shape":
        q, k, v = _qkv(9, shape=(2, 64))
    elif change == "dtype":
        q, k, v = _qkv(9, dtype=torch.float64)
    elif change == "misaligned":
        q, k, v = _qkv(9)
        buf = torch.empty(q.numel() + 1)
        q = buf[1:].view_as(q).copy_(q)
    else:
        q, k, v = _qkv(9)
        key = (0.25,)
    replayed = fast_launch.counts()["replayed"]
    out = rep.run(fn, q, k, v, key)
    r = HELD if q.shape == HELD.shape else torch.zeros_like(q)
    assert torch.equal(out, _expect(q, k, v, r)) and len(runs) == 4
    assert fast_launch.counts()["replayed"] == replayed
    assert rep.plan is None and rep.refused is None


def test_calls_that_keep_changing_layouts_stop_being_recorded(kern, monkeypatch):
    kernel, compiled, calls = kern
    monkeypatch.setattr(replay, "REPLANS", 2)
    rep = replay.CallReplay()
    held64 = HELD.double()
    fn = _call(kernel, lambda q, out: HELD if q.dtype == torch.float32 else held64)
    for i in range(30):
        q, k, v = _qkv(i, dtype=(torch.float32, torch.float64)[(i // 3) % 2])
        assert torch.allclose(rep.run(fn, q, k, v), _expect(q, k, v))
    assert rep.refused == "its calls keep changing layouts"


@pytest.mark.parametrize("off", ["SPARSE_ATTN_REPLAY", "SPARSE_ATTN_FAST_LAUNCH"])
def test_turned_off_every_call_runs_itself(kern, monkeypatch, off):
    kernel, compiled, calls = kern
    rep, runs = replay.CallReplay(), []
    fn = _call(kernel, runs=runs)
    for i in range(4):
        rep.run(fn, *_qkv(i))
    assert rep.plan is not None
    if off == "SPARSE_ATTN_REPLAY":
        monkeypatch.setattr(replay, "ENABLED", False)
    else:
        monkeypatch.setenv("SPARSE_ATTN_FAST_LAUNCH", "0")
    for i in range(4, 8):
        q, k, v = _qkv(i)
        assert torch.equal(rep.run(fn, q, k, v), _expect(q, k, v))
    assert len(runs) == 7 and fast_launch.counts()["replayed"] == 1


def test_two_launches_are_never_replayed(kern):
    kernel, compiled, calls = kern
    rep, runs = replay.CallReplay(), []
    one = _call(kernel)

    def fn(q, k, v):
        runs.append(1)
        one(q, k, v)
        return one(q, k, v)
    for i in range(5):
        rep.run(fn, *_qkv(i))
    assert len(runs) == 5 and rep.refused == "it makes 2 launches"


def test_a_recording_keeps_no_call_tensor_alive(kern):
    """The first recording waits a call for the second: it must not hold that call's q, k, v or output (activations
    of (B, H, N, D) per cached layer)."""
    kernel, compiled, calls = kern
    rep = replay.CallReplay()
    fn = _call(kernel)
    rep.run(fn, *_qkv(0))
    q, k, v = _qkv(1)
    out = rep.run(fn, q, k, v)
    assert rep.last is not None
    refs = [weakref.ref(t) for t in (q, k, v, out)]
    compiled.launches.clear()  # the fake launcher's own log of what it was given
    del q, k, v, out
    gc.collect()
    assert all(r() is None for r in refs)


def _planned(kern, fn=None, key=()):
    """A CallReplay with a plan for ``fn`` (default: the plain call), after four calls: (replay, fn, runs)."""
    kernel = kern[0]
    runs = []
    fn = fn or _call(kernel, runs=runs)
    rep = replay.CallReplay()
    for i in range(4):
        rep.run(fn, *_qkv(i), key)
    assert rep.plan is not None
    return rep, fn, runs


def test_q_k_or_v_passed_twice_is_never_replayed(kern):
    """With k passed as v too, the launch's v positions would be filed under k: a later call with its own v would be
    replayed with k there."""
    kernel, compiled, calls = kern
    rep, fn = replay.CallReplay(), _call(kernel)
    for i in range(4):
        q, k, _ = _qkv(i)
        assert torch.equal(rep.run(fn, q, k, k), _expect(q, k, k))
    assert rep.refused == "q, k, v and its output are not four tensors"
    rep, fn, runs = _planned(kern)
    q, k, _ = _qkv(7)
    assert torch.equal(rep.run(fn, q, k, k), _expect(q, k, k))
    assert fast_launch.counts()["replayed"] == 1  # the plan's own fourth call only


def test_other_strides_of_the_same_shape_are_not_replayed(kern):
    """The kernels take q's strides as scalars of the launch: a q of the recorded shape with other strides runs the
    call itself."""
    rep, fn, runs = _planned(kern)
    replayed = fast_launch.counts()["replayed"]
    q, k, v = _qkv(8)
    q = q.t().contiguous().t()  # (2, 32) with strides (1, 2)
    assert torch.equal(rep.run(fn, q, k, v), _expect(q, k, v))
    assert fast_launch.counts()["replayed"] == replayed and len(runs) == 4


def test_a_scalar_that_changes_at_every_call_is_never_replayed(kern):
    kernel, compiled, calls = kern
    rep, scales = replay.CallReplay(), iter(x / 16 for x in range(1, 100))

    def fn(q, k, v):
        out = torch.empty_like(q)
        fast_launch.launch(kernel, (2,), (q, k, v, out, HELD, 32, next(scales)), {"MODE": 1})
        return out
    for i in range(24):
        rep.run(fn, *_qkv(i))
    assert fast_launch.counts()["replayed"] == 0 and rep.refused


@pytest.mark.parametrize("why", ["another device current", "a launch hook", "a pre-run hook"])
def test_where_the_direct_path_may_not_run_the_call_runs_itself_and_the_plan_stays(kern, monkeypatch, why):
    kernel, compiled, calls = kern
    rep, fn, runs = _planned(kern)
    replayed = fast_launch.counts()["replayed"]
    with monkeypatch.context() as m:
        if why == "another device current":
            m.setattr(fast_launch, "current_device", lambda: 1)
        elif why == "a launch hook":
            hook = triton.knobs.runtime.launch_enter_hook
            if hasattr(hook, "calls"):
                m.setattr(hook, "calls", [lambda *a, **k: None])
            else:
                m.setattr(triton.knobs.runtime, "launch_enter_hook", lambda *a, **k: None)
        else:
            m.setattr(attn_kernel, "pre_run_hooks", [lambda *a, **k: None])
        q, k, v = _qkv(8)
        assert torch.equal(rep.run(fn, q, k, v), _expect(q, k, v))
        assert fast_launch.counts()["replayed"] == replayed and len(runs) == 4
    assert rep.plan is not None and rep.refused is None
    q, k, v = _qkv(9)
    assert torch.equal(rep.run(fn, q, k, v), _expect(q, k, v))
    assert fast_launch.counts()["replayed"] == replayed + 1


def test_a_launch_switch_set_otherwise_runs_the_call_itself(kern, monkeypatch):
    """The kernels read SPARSE_ATTN_LOOP, _RESCALE and _TMA at each launch: a plan recorded under other values is not
    replayed (the call runs itself and is planned again)."""
    rep, fn, runs = _planned(kern)
    replayed = fast_launch.counts()["replayed"]
    monkeypatch.setenv("SPARSE_ATTN_LOOP", "ahead")
    q, k, v = _qkv(8)
    assert torch.equal(rep.run(fn, q, k, v), _expect(q, k, v))
    assert fast_launch.counts()["replayed"] == replayed and len(runs) == 4 and rep.plan is None


def test_every_switch_the_kernels_read_at_a_launch_is_a_launch_switch():
    """A switch read by the kernels (os.environ in kernels/) that no replay watches would be ignored by replays."""
    import re
    from pathlib import Path
    root = Path(replay.__file__).parent
    read = set()
    for path in root.glob("*.py"):
        read |= set(re.findall(r'os\.environ\.get\("(SPARSE_ATTN_\w+)"', path.read_text()))
    # not read at launches: tuning persistence (_triton_common.tune_*), the direct path's own switch, this module's,
    # the anchor's grouping graphs and side stream (grouping_graph.py, side_stream.py: never in a reuse call)
    assert read - {"SPARSE_ATTN_TUNE", "SPARSE_ATTN_FAST_LAUNCH", "SPARSE_ATTN_REPLAY",
                   "SPARSE_ATTN_GROUPING_GRAPH", "SPARSE_ATTN_SIDE_STREAM"} == set(replay.LAUNCH_ENV)


def test_an_output_that_is_not_the_launchs_is_never_replayed(kern):
    kernel, compiled, calls = kern
    rep, runs = replay.CallReplay(), []
    inner = _call(kernel, runs=runs)

    def fn(q, k, v):
        inner(q, k, v)
        return torch.empty_like(q)  # not what the launch wrote
    for i in range(5):
        rep.run(fn, *_qkv(i))
    assert len(runs) == 5 and rep.refused == "q, k, v or its output is not an argument of the launch"
