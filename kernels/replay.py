"""Replay a kernel call: the one launch a cached selection's reuse call makes, repeated for new q, k, v.

At 4 608 tokens a block_topk reuse call is host-bound (docs/benchmarks.md, "Replaying the reuse call"). Once
kernels/fast_launch.py took Triton's dispatch out of it, what is left of the kernel call's host time is this pack's
own Python around the launch: the argument checks, the TMA decision, the residual and mass arguments, the launch
arguments built afresh and fast_launch's key over ~50 of them. All of that depends only on the call's metadata and on
the cached tensors, which every reuse call of one cached entry shares.

``CallReplay.run(fn, q, k, v, key)`` records what ``fn(q, k, v)`` does: every PyTorch operator (through a dispatch
mode) and every launch (fast_launch's ``recording``). When two recorded calls with the same ``key`` show that the
call is exactly allocations, views and one direct launch, whose other tensor arguments are the same memory both
times (the first call's are held while the second runs, so a temporary of the second cannot reuse a temporary's
address) and whose scalars are equal, later calls whose q, k and v have the recorded shapes, strides, dtype, device
and 16-byte alignment allocate the output as the call did and relaunch, nothing else. Anything else (another
operator: a copy, a fill, a read of a value; two launches; a launch through Triton's own path; a different key or
metadata; the switches of LAUNCH_ENV set otherwise than when the plan was recorded; a profiler's launch hook) runs
``fn`` itself. The engine keeps one ``CallReplay`` per cached entry, so a run's plans end with its entries.
"""

from __future__ import annotations

import logging
import os

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import fast_launch

log = logging.getLogger(__name__)

ENABLED = os.environ.get("SPARSE_ATTN_REPLAY", "1") != "0"  # SPARSE_ATTN_REPLAY=0 (read at import): no replays
ATTEMPTS = 4  # recordings that met Triton's own launch path (a first launch tunes and compiles) before giving up
REPLANS = 8  # plans dropped for a call of other layouts or key, before giving up
RECORDS = 16  # recordings in all before giving up (a key or layout that changes at every call)
# environment switches the kernels read at each launch (kernels/_hopper.py: the TMA kernels; kernels/_triton_common.py:
# the loop and the rescaling): a plan is replayed only under the values it was recorded with
# (tests/test_replay.py checks that every such switch the kernels read is listed)
LAUNCH_ENV = ("SPARSE_ATTN_TMA", "SPARSE_ATTN_GLUON", "SPARSE_ATTN_LOOP", "SPARSE_ATTN_RESCALE")

_aten = torch.ops.aten
_ALLOCATIONS = frozenset({_aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
                          _aten.new_empty.default, _aten.new_empty_strided.default})
_NOT_VIEWS = frozenset({_aten.lift_fresh.default})  # aliasing in its schema, but a tensor made from host data


def _harmless(func) -> bool:
    """An operator that neither reads nor writes a tensor's elements: an allocation or a view (``is_view``: aliasing
    arguments, none of them written)."""
    return func in _ALLOCATIONS or (getattr(func, "is_view", False) and func not in _NOT_VIEWS)


class _Operators(TorchDispatchMode):
    """Notes the first operator of a recorded call that is not an allocation or a view."""

    def __init__(self):
        super().__init__()
        self.other = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.other is None and not _harmless(func):
            self.other = str(func)
        return func(*args, **(kwargs or {}))


def _layout(t: torch.Tensor) -> tuple:
    """What a replay needs of q, k, v to be the recorded call: shape, strides, dtype, device, 16-byte alignment."""
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15 == 0)


def _held(t: torch.Tensor) -> tuple:
    """A tensor argument other than q, k, v and the output: the memory and layout the launch reads."""
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


def _environment() -> tuple:
    return tuple(os.environ.get(name) for name in LAUNCH_ENV)


class _Record:
    """One recorded call: its launch with the positions of q, k, v and the output emptied (a record must not keep a
    call's activations alive), where those positions are, the other arguments' identity (tensors by memory, scalars by
    type and value), the layouts and the launch switches. ``problem``: why such a call cannot be replayed, or None."""

    def __init__(self, done: fast_launch.Launch, out: torch.Tensor, q, k, v, key):
        roles = (q, k, v, out)
        self.problem = None
        if len({id(t) for t in roles}) < 4:  # a slot filled by two roles would be replayed with one of them
            self.problem = "q, k, v and its output are not four tensors"
        self.out_layout = _layout(out)
        self.slots = {0: [], 1: [], 2: [], 3: []}  # q, k, v, out -> positions in the launch's arguments
        # another tensor in the memory of q, k, v or the output (a view made by the call) would be replayed with the
        # recorded call's memory, which the next q may even occupy again: such a call is not replayed
        calls = {t.untyped_storage().data_ptr() for t in roles}
        sig, kept = [], []
        for i, a in enumerate(done.args):
            role = next((r for r, t in enumerate(roles) if a is t), None)
            if role is not None:
                self.slots[role].append(i)
                sig.append(role)
                a = None
            elif isinstance(a, torch.Tensor):
                if a.untyped_storage().data_ptr() in calls and self.problem is None:
                    self.problem = "it launches on a view of q, k, v or its output"
                sig.append(_held(a))
            else:
                sig.append((a.__class__, a))
            kept.append(a)
        if self.problem is None and not all(self.slots.values()):
            self.problem = "q, k, v or its output is not an argument of the launch"
        self.done = fast_launch.Launch(done.kernel, done.entry, done.grid, done.device, tuple(kept), done.before)
        self.sig = tuple(sig)
        self.layouts, self.environment = (_layout(q), _layout(k), _layout(v)), _environment()
        # what may legitimately differ from one recording to the next (then recording starts over)
        self.context = (key, self.layouts, self.out_layout, self.environment, done.kernel, done.entry, done.grid,
                        done.device, done.before)

    def comparable(self, other: "_Record") -> bool:
        return all(a is b or (type(a) is type(b) and a == b) for a, b in zip(self.context, other.context))


class _Plan:
    """The launch of a recorded call, ready to run again for new q, k, v of the recorded layouts."""

    __slots__ = ("done", "layouts", "template", "slots", "out_layout", "environment")

    def __init__(self, rec: _Record):
        self.done, self.out_layout, self.layouts, self.environment = rec.done, rec.out_layout, rec.layouts, \
            rec.environment
        self.template = list(rec.done.args)
        self.slots = tuple((role, tuple(pos)) for role, pos in rec.slots.items())

    def fits(self, q, k, v) -> bool:
        lq, lk, lv = self.layouts
        return (_layout(q) == lq and _layout(k) == lk and _layout(v) == lv and q is not k and k is not v
                and q is not v and _environment() == self.environment)

    def launch(self, q, k, v) -> torch.Tensor | None:
        """The output of the replayed launch, or None (nothing launched) where the direct path may not run now or the
        output's allocation is not aligned as the recorded one was."""
        shape, stride, dtype, device, aligned = self.out_layout
        out = torch.empty_strided(shape, stride, dtype=dtype, device=device)
        if (out.data_ptr() & 15 == 0) != aligned:
            return None
        args = self.template.copy()
        given = (q, k, v, out)
        for role, positions in self.slots:
            t = given[role]
            for i in positions:
                args[i] = t
        return out if fast_launch.relaunch(self.done, args) else None


class CallReplay:
    """Replays one call site's kernel call (module docstring). One per cached entry: its plan holds views of the
    entry's tensors, so it must not outlive them. Not thread-safe (the engine serialises its calls)."""

    def __init__(self):
        self.calls = 0
        self.plan: _Plan | None = None
        self.key = None
        self.last: _Record | None = None
        self.attempts = 0
        self.replans = 0
        self.records = 0
        self.replays = 0  # calls replayed so far
        self.refused: str | None = None  # why this call is never replayed, once known

    def run(self, fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key=()) -> torch.Tensor:
        """``fn(q, k, v)`` -> its output tensor, replayed where a plan for ``key`` and these layouts exists.

        q, k, v: the tensors ``fn`` attends with ((B, H, N, D) in the kernels; any tensors here); key: everything
        else ``fn`` depends on that can change between calls (scale, backend), compared with ``==``."""
        plan = self.plan
        if plan is not None and ENABLED and key == self.key and plan.fits(q, k, v):
            out = plan.launch(q, k, v)
            if out is None:  # a profiler's launch hook, another device current, ...: this call runs itself
                return fn(q, k, v)
            self.replays += 1
            return out
        self.calls += 1
        if self.refused is not None or not ENABLED or self.calls == 1 or not fast_launch.enabled() \
                or not fast_launch.on_gpu(q):  # the first call may tune and compile: not recorded
            return fn(q, k, v)
        if plan is not None:  # a call the plan does not fit: record afresh, a limited number of times
            self.plan, self.last, self.replans = None, None, self.replans + 1
            if self.replans > REPLANS:
                self._refuse("its calls keep changing layouts")
                return fn(q, k, v)
        self.records += 1
        if self.records > RECORDS:
            self._refuse(f"{RECORDS} recordings made no plan")
            return fn(q, k, v)
        out, rec = self._record(fn, q, k, v, key)
        if rec is None:
            return out
        if self.last is None or not self.last.comparable(rec):
            self.key, self.last = key, rec
        elif self.last.sig == rec.sig:
            self.plan, self.last, self.attempts = _Plan(rec), None, 0
            log.debug("sparse attention: a reuse call is replayed from now on")
        else:
            self._refuse("its launch's other arguments differ between calls")
        return out

    def _refuse(self, why: str) -> None:
        self.refused, self.last = why, None
        log.debug("sparse attention: a reuse call is not replayed: %s", why)

    def _record(self, fn, q, k, v, key):
        """(fn's output, the _Record of its one direct launch or None)."""
        watch = _Operators()
        with fast_launch.recording() as launches, watch:
            out = fn(q, k, v)
        if any(d is None for d in launches):  # Triton's own path (a new key): try again at a later call
            self.attempts += 1
            if self.attempts >= ATTEMPTS:
                self._refuse("its launches kept taking Triton's own path")
            return out, None
        why = None
        if watch.other is not None:
            why = f"it runs {watch.other}"
        elif len(launches) != 1:
            why = f"it makes {len(launches)} launches"
        elif not isinstance(out, torch.Tensor):
            why = "it returns more than one tensor"
        else:
            rec = _Record(launches[0], out, q, k, v, key)
            if rec.problem is None:
                return out, rec
            why = rec.problem
        self._refuse(why)
        return out, None
