"""Relaunch a tuned, compiled Triton kernel without Triton's per-call dispatch.

At 4 608 tokens a reuse call is host-bound, and about half of a bare kernel call's host time is Triton's launch
path: the autotuner's key, the heuristics, the JIT's argument binding and specialisation, its cache lookup
(docs/benchmarks.md, "Host overhead at 4 608 tokens"). All of that is a function of the arguments' metadata: the
integer and float values, each tensor's dtype and whether its address is 16-byte aligned (what Triton specialises
on), the constexprs and the current device. ``launch`` keys a memo on exactly that, runs the normal path once per
key (which tunes and compiles as before), remembers the compiled kernel with every argument Triton bound for it,
and from then on calls the compiled kernel's launcher directly with the call's own tensors.

The direct path is taken only where it is known to be equivalent: GPU tensors, not under the interpreter, a
compiled kernel that exposes its launcher, no config pre-hook, no launch hook installed (profilers), no debug or
instrumentation mode, no pre-run hook on the JIT function but the memo's own. Anything else keeps Triton's path (a
kernel that cannot take the direct path is logged once). ``SPARSE_ATTN_FAST_LAUNCH=0`` turns it off.
docs/kernel_notes.md, "v12", has the measurements.
"""

from __future__ import annotations

import logging
import os
import threading

import torch

from .backend import interpreting

log = logging.getLogger(__name__)

MEMO_LIMIT = 512  # keys per kernel; a process that sees more shapes starts the memo over
_UNSUPPORTED = object()
_warned: set[str] = set()
_counts = {"direct": 0, "normal": 0, "replayed": 0}
_recording = threading.local()  # .launches: the list a ``recording()`` block appends each launch to


def enabled() -> bool:
    """The direct path may run: not under the interpreter, not turned off by SPARSE_ATTN_FAST_LAUNCH=0."""
    return os.environ.get("SPARSE_ATTN_FAST_LAUNCH", "1") != "0" and not interpreting()


def counts() -> dict[str, int]:
    """Launches through the direct path, through Triton's own, and replays of a recorded launch (``relaunch``), since
    the process started (or ``reset``)."""
    return dict(_counts)


def reset() -> None:
    """Forget every memo and zero the counts (tests, benchmarks timing both paths)."""
    _memos.clear()
    _counts.update(direct=0, normal=0, replayed=0)


def _jit_of(kernel):
    """The JITFunction under autotuner / heuristics wrappers."""
    from triton.runtime.jit import JITFunction
    fn = kernel
    while not isinstance(fn, JITFunction):
        fn = getattr(fn, "fn", None)
        if fn is None:
            return None
    return fn


def _sig(a):
    """One argument's part of the key: an int's value; a tensor's dtype and 16-byte alignment; any other value with
    its type (True == 1 == 1.0 in Python, but Triton compiles a bool, an int and a float argument differently)."""
    if a.__class__ is int:
        return a
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() & 15 == 0)
    return (a.__class__, a)


def _key(args: tuple, constexprs: dict, device: int) -> tuple:
    """What Triton specialises and tunes on: values of scalars, dtype and 16-byte alignment of tensors."""
    return (device, tuple(map(_sig, args)), tuple((k, _sig(v)) for k, v in constexprs.items()))


def on_gpu(t: torch.Tensor) -> bool:
    """The call's tensors are on a GPU (CPU tensors run through Triton's own path: the interpreter, or its error)."""
    return t.is_cuda


def current_device() -> int:
    """The device Triton launches on (its driver's current device, as its own launch path reads it)."""
    from triton.runtime import driver
    return driver.active.get_current_device()


def current_stream(device: int) -> int:
    """The raw handle of ``device``'s current stream, as Triton's own launch path reads it."""
    from triton.runtime import driver
    return driver.active.get_current_stream(device)


class _Entry:
    __slots__ = ("kernel", "tail", "grid", "config", "jit")

    def __init__(self, kernel, tail, grid, config, jit):
        self.kernel, self.tail, self.grid, self.config, self.jit = kernel, tail, grid, config, jit


_memos: dict[int, tuple] = {}  # id(kernel) -> (kernel, memo): the kernel is held, so its id is never reused


def _tritons_path_needed(knobs) -> bool:
    """Triton's path does per-call work for a setting: a launch hook (a profiler: Triton builds launch metadata for
    it; newer Tritons hold the hooks in a chain that is never None, empty when nothing is installed), or debug /
    instrumentation modes, which are part of Triton's own compile key."""
    for name in ("launch_enter_hook", "launch_exit_hook"):
        hook = getattr(knobs.runtime, name, None)
        if hook is not None and (not hasattr(hook, "calls") or hook.calls):
            return True
    if getattr(knobs.runtime, "debug", False):
        return True
    return bool(getattr(getattr(knobs, "compilation", None), "instrumentation_mode", ""))


def _build(kernel, jit, grid, args, compiled, seen) -> object:
    """The memo entry for a launch the normal path just made, or _UNSUPPORTED (with the reason logged once).
    seen: (positional, keyword) arguments of the JIT's own run, or None."""
    name = getattr(jit, "__name__", "kernel")
    best = getattr(kernel, "best_config", None)
    why, bound = None, None
    if compiled is None or not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
        why = "the launch returned no compiled kernel"
    elif best is not None and getattr(best, "pre_hook", None) is not None:
        why = "its config has a pre-hook"
    elif seen is None or len(seen[0]) != len(args) or any(s is not a for s, a in zip(seen[0], args)):
        return None  # not seen this time (another thread's launch of the same JIT function): try again next call
    else:
        names = list(jit.arg_names)
        bound = dict(zip(names, seen[0]))
        bound.update((k, v) for k, v in seen[1].items() if k in names)
        # a parameter left to its default reaches the JIT's run unbound; the JIT binds the default and passes it to
        # the launcher like any other (a defaulted constexpr once kept the TMA kernels off this path, unnoticed but
        # for a GPU test: docs/kernel_notes.md, "v15")
        bound.update((p.name, p.default) for p in getattr(jit, "params", ())
                     if p.name not in bound and getattr(p, "has_default", False))
        missing = [n for n in names if n not in bound]
        if missing:
            why = f"arguments {missing} were not bound"
    if why is not None:
        if name not in _warned:
            _warned.add(name)
            log.info("sparse attention: %s launches through Triton's own path (%s)", name, why)
        return _UNSUPPORTED
    # a callable grid is resolved once: it may read only the bound scalars and constexprs, all in the key; a tuple
    # grid is each call's own (launch)
    return _Entry(compiled, tuple(bound[n] for n in names[len(args):]), _grid3(grid(bound)) if callable(grid) else None,
                  best, jit)


def _grid3(grid) -> tuple:
    """A grid of one to three sizes as three."""
    g = tuple(grid)
    return (g + (1, 1))[:3]


def launch(kernel, grid, args: tuple, constexprs: dict, before=None):
    """``kernel[grid](*args, **constexprs)``, relaunching the compiled kernel directly once this key was seen.

    kernel: a ``triton.jit`` function, possibly under ``triton.autotune`` / ``triton.heuristics``, whose
    non-constexpr parameters come first; args: those positional arguments in order, tensors and scalars, the first
    a tensor (the direct path runs for GPU tensors only); constexprs: the constexprs the caller sets (the autotuner
    and heuristics add the rest); grid: a tuple (taken from each call), or a callable of the bound arguments as
    Triton's that depends only on scalar arguments and constexprs (resolved once per key); before: a callable run
    before the launch on either path, and again before each replay of it (``relaunch``): the state the launch needs
    (the TMA kernels' scratch allocator). Inside a ``recording()`` block each launch is appended to the block's list:
    a ``Launch`` for a direct launch, None for one through Triton's path. Returns the compiled kernel (what Triton's
    path returns)."""
    if before is not None:
        before()
    rec = getattr(_recording, "launches", None)
    if not enabled() or not on_gpu(args[0]):
        return _normal(kernel, grid, args, constexprs, rec)
    import triton
    knobs = getattr(triton, "knobs", None)
    if knobs is None or _tritons_path_needed(knobs):
        return _normal(kernel, grid, args, constexprs, rec)
    device = current_device()
    held = _memos.get(id(kernel))
    if held is None:
        held = _memos[id(kernel)] = (kernel, {})
    memo = held[1]
    key = _key(args, constexprs, device)
    entry = memo.get(key)
    if entry is not None and entry is not _UNSUPPORTED and not entry.jit.pre_run_hooks:
        # a tuple grid is the call's own (it may depend on what the key does not hold: the batch size sets the
        # grid of kernels that take no B argument, and a batch of 2 has a batch of 1's strides)
        k, g = entry.kernel, entry.grid if callable(grid) else _grid3(grid)
        k.run(g[0], g[1], g[2], current_stream(device), k.function, k.packed_metadata, None, None,
              None, *args, *entry.tail)
        if entry.config is not None:  # as the autotuner's own run leaves it (kernels' last_config reads it)
            kernel.best_config = entry.config
        _counts["direct"] += 1
        if rec is not None:
            rec.append(Launch(kernel, entry, g, device, args, before))
        return k
    jit = _jit_of(kernel) if entry is None else None
    hooks = getattr(jit, "pre_run_hooks", None)
    if hooks is None:  # unsupported key, someone else's pre-run hook, or a Triton without pre-run hooks
        if entry is None:
            memo[key] = _UNSUPPORTED
        return _normal(kernel, grid, args, constexprs, rec)
    _counts["normal"] += 1
    if rec is not None:
        rec.append(None)
    me, seen = threading.get_ident(), []

    def capture(*a, **kw):  # the arguments of the JIT's own run: ours plus the tuned config and heuristics
        if threading.get_ident() == me:  # another GPU's thread may launch the same kernel meanwhile
            seen[:] = [(a, kw)]

    hooks.append(capture)
    try:
        compiled = kernel[grid](*args, **constexprs)
    finally:
        hooks.remove(capture)
    built = _build(kernel, jit, grid, args, compiled, seen[0] if seen else None)
    if built is not None:
        if len(memo) >= MEMO_LIMIT:
            memo.clear()
        memo[key] = built
    return compiled


def _normal(kernel, grid, args, constexprs, rec):
    """Triton's own launch path (counted, and recorded as None in a ``recording()`` block)."""
    _counts["normal"] += 1
    if rec is not None:
        rec.append(None)
    return kernel[grid](*args, **constexprs)


class Launch:
    """A direct launch as ``recording()`` saw it: the kernel, its memo entry, the three grid sizes, the device, the
    positional arguments and the ``before`` callable. ``relaunch`` repeats it with other arguments."""

    __slots__ = ("kernel", "entry", "grid", "device", "args", "before")

    def __init__(self, kernel, entry, grid, device, args, before):
        self.kernel, self.entry, self.grid, self.device, self.args, self.before = \
            kernel, entry, grid, device, args, before


class recording:
    """``with recording() as launches:``: every ``launch`` made by this thread inside the block is appended to
    ``launches`` (a ``Launch``, or None for a launch through Triton's own path). Blocks nest; each sees its own."""

    def __enter__(self) -> list:
        self.outer = getattr(_recording, "launches", None)
        _recording.launches = []
        return _recording.launches

    def __exit__(self, *exc):
        _recording.launches = self.outer
        return False


def relaunch(done: Launch, args: tuple) -> bool:
    """Launch ``done`` again with ``args`` in place of its arguments, which must have the same key (the same scalars,
    tensor dtypes and 16-byte alignment; kernels/replay.py checks that), on the current stream of its device (recorded
    as a ``Launch`` inside a ``recording()`` block). False,
    launching nothing, where the direct path may not run now (turned off, a launch hook or debug mode installed since,
    another device current, a pre-run hook added to the JIT function)."""
    if not enabled():
        return False
    import triton
    knobs = getattr(triton, "knobs", None)
    entry = done.entry
    if knobs is None or _tritons_path_needed(knobs) or entry.jit.pre_run_hooks or current_device() != done.device:
        return False
    if done.before is not None:
        done.before()
    k, g = entry.kernel, done.grid
    k.run(g[0], g[1], g[2], current_stream(done.device), k.function, k.packed_metadata, None, None, None, *args,
          *entry.tail)
    if entry.config is not None:
        done.kernel.best_config = entry.config
    _counts["replayed"] += 1
    rec = getattr(_recording, "launches", None)
    if rec is not None:  # a replay inside a recorded call is one of its launches
        rec.append(Launch(done.kernel, entry, g, done.device, tuple(args), done.before))
    return True
