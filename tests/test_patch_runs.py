"""The patch's state under threads, without ComfyUI: sampling runs that overlap in time keep their own caches
(clones of a patched model share the patch object), and within one run each device key gets its own engine
(ComfyUI's MultiGPU CFG Split evaluates cond and uncond on two GPUs in worker threads). The ComfyUI side of
the contract — wrappers, options, the override call — is driven the way ComfyUI drives it (nodes/patch.py).
CPU only."""

import threading

import torch

from comfyui_sparse_attention.engine import SparseConfig
from comfyui_sparse_attention.nodes.patch import RUN_KEY, SamplingRun, SparseAttentionPatch

SDPA = torch.nn.functional.scaled_dot_product_attention
CFG = SparseConfig(method="mc_sparse", density=0.25, min_tokens=0, backend="torch", group_size=64,
                   anchor_steps="every 2")
STEPS = 4
SIGMAS = torch.linspace(1.0, 0.0, STEPS + 1)


def model_attention(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                    **kwargs):
    """The model's own attention (ComfyUI's ``func``): (B, H, N, D) in and out in this test."""
    return SDPA(q, k, v)


class Guider:
    """What an OUTER_SAMPLE executor's ``class_obj`` offers: the run's copy of the model options."""

    def __init__(self):
        self.model_options = {"transformer_options": {}}


class Executor:
    def __init__(self, fn, guider=None):
        self.fn, self.class_obj = fn, guider

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def qkv(seed, step, b=1):
    g = torch.Generator().manual_seed(seed)
    base = [torch.randn(b, 2, 256, 32, generator=g) for _ in range(3)]
    drift = torch.Generator().manual_seed(1000 * seed + step)
    return [t + 0.05 * torch.randn(t.shape, generator=drift) for t in base]


def forward(patch, options, step, seed, extra=None, layers=2, wait=None):
    """One model evaluation: the APPLY_MODEL wrapper, then ``layers`` self-attention calls through the override."""
    to = dict(options)
    to.update(sigmas=SIGMAS[step:step + 1], sample_sigmas=SIGMAS, cond_or_uncond=[seed % 2], **(extra or {}))
    outs = []

    def model(x, t, transformer_options):
        for layer in range(layers):
            if wait is not None:
                wait()
            q, k, v = qkv(seed + layer, step)
            outs.append(patch(model_attention, q, k, v, 2, transformer_options=transformer_options,
                              skip_reshape=True, skip_output_reshape=True))
    patch.apply_model(Executor(model), torch.zeros(1, 4, 16, 16), None, transformer_options=to)
    return outs


def sample(patch, seed, wait=None):
    """One sampling run through the OUTER_SAMPLE wrapper; returns every attention output of the run."""
    guider = Guider()
    outs = []

    def run(noise, latent, sampler, sigmas):
        for step in range(STEPS):
            outs.extend(forward(patch, guider.model_options["transformer_options"], step, seed, wait=wait))
    patch.outer_sample(Executor(run, guider), None, None, None, SIGMAS)
    return outs


def sample_with(patch, model, steps=4):
    """A sampling run of ``steps`` steps through the OUTER_SAMPLE and APPLY_MODEL wrappers whose forward is
    ``model(x, t, transformer_options, step)`` (it makes its own attention calls, and may raise)."""
    guider = Guider()

    def run(noise, latent, sampler, sigmas):
        for step in range(steps):
            to = dict(guider.model_options["transformer_options"])
            to.update(sigmas=SIGMAS[step:step + 1], sample_sigmas=SIGMAS, cond_or_uncond=[0])
            patch.apply_model(Executor(lambda x, t, transformer_options, s=step: model(x, t, transformer_options, s)),
                              torch.zeros(1, 4, 16, 16), None, transformer_options=to)
    patch.outer_sample(Executor(run, guider), None, None, None, SIGMAS)


def test_runs_overlapping_in_time_keep_their_own_caches():
    alone = {seed: sample(SparseAttentionPatch(CFG), seed) for seed in (1, 2)}
    shared = SparseAttentionPatch(CFG)  # both samplers use clones of one patched model: one patch object
    barrier = threading.Barrier(2)
    got, errors = {}, []

    def worker(seed):
        try:
            got[seed] = sample(shared, seed, wait=lambda: barrier.wait(timeout=30))  # every call in lockstep
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)
    threads = [threading.Thread(target=worker, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for seed in (1, 2):
        assert len(got[seed]) == len(alone[seed]) == 2 * STEPS
        assert all(torch.equal(a, b) for a, b in zip(got[seed], alone[seed])), seed
    assert shared.runs == 2 and shared.cache_bytes() == 0
    assert shared.last_stats.totals()["anchors"] == 4  # the last run's own statistics: 2 layers x anchors 0, 2


def test_one_run_gets_an_engine_per_device_key_in_worker_threads():
    def split_run(patch, threaded):
        guider = Guider()
        outs = {}

        def run(noise, latent, sampler, sigmas):
            for step in range(STEPS):
                def work(cond, device):
                    outs[cond, step] = forward(patch, guider.model_options["transformer_options"], step, cond,
                                               extra={"multigpu_thread_device": device})
                jobs = [threading.Thread(target=work, args=(c, d)) for c, d in ((0, "cuda:0"), (1, "cuda:1"))]
                if threaded:
                    for j in jobs:
                        j.start()
                    for j in jobs:
                        j.join()
                else:
                    work(0, "cuda:0")
                    work(1, "cuda:1")
        patch.outer_sample(Executor(run, guider), None, None, None, SIGMAS)
        return outs
    seen = {}
    real = SamplingRun.engine_for

    def spy(self, q, to):
        eng = real(self, q, to)
        seen.setdefault(to["multigpu_thread_device"], set()).add(id(eng))
        return eng
    SamplingRun.engine_for = spy
    try:
        patch = SparseAttentionPatch(CFG)
        together = split_run(patch, threaded=True)
    finally:
        SamplingRun.engine_for = real
    alone = split_run(SparseAttentionPatch(CFG), threaded=False)
    assert set(seen) == {"cuda:0", "cuda:1"} and all(len(ids) == 1 for ids in seen.values())
    assert seen["cuda:0"] != seen["cuda:1"]  # one engine per device key
    assert all(torch.equal(a, b) for key in alone for a, b in zip(together[key], alone[key]))
    stats = patch.last_stats
    assert stats.cache["devices"] == 2 and stats.totals()["anchors"] == 8  # 2 devices x 2 layers x steps 0, 2
    assert patch.cache_bytes() == 0


def test_calls_outside_a_run_use_the_idle_state_until_cleanup():
    patch = SparseAttentionPatch(CFG)
    outs = forward(patch, {}, 0, 3)
    assert all(torch.allclose(o, SDPA(*qkv(3 + i, 0)), atol=1e-5) for i, o in enumerate(outs))  # anchors: exact
    assert patch.cache_bytes() > 0 and patch.last_stats is None
    patch.cleanup(None)
    assert patch.cache_bytes() == 0


def test_a_stale_run_in_the_options_is_not_used():
    patch = SparseAttentionPatch(CFG)
    sample(patch, 1)
    ended = patch.last_run
    outs = forward(patch, {RUN_KEY: ended}, 0, 1)  # options kept past their run
    assert len(outs) == 2 and ended.engines.cache_bytes == 0 and patch.idle.engines.cache_bytes > 0


def test_any_engine_exception_sends_the_call_and_its_layer_dense(monkeypatch):
    from comfyui_sparse_attention.engine.policy_mc_sparse import McSparsePolicy

    def broken(self, *a, **k):
        raise KeyError("simulated")
    monkeypatch.setattr(McSparsePolicy, "select", broken)
    patch = SparseAttentionPatch(CFG)
    outs = sample(patch, 1)
    dense = [SDPA(*qkv(1 + layer, step)) for step in range(STEPS) for layer in range(2)]
    assert all(torch.allclose(o, d, atol=1e-5) for o, d in zip(outs, dense))
    assert patch.fallbacks == {"an engine error (KeyError)": 2}  # once per layer: the layer then stays dense
    assert patch.last_stats.totals()["fallbacks"] == 2 * (STEPS - 1)


def test_an_interruption_is_never_swallowed(monkeypatch):
    import sys
    import types

    from comfyui_sparse_attention.engine.policy_mc_sparse import McSparsePolicy

    class InterruptProcessingException(Exception):
        pass
    fake = types.ModuleType("comfy.model_management")
    fake.InterruptProcessingException = InterruptProcessingException
    monkeypatch.setitem(sys.modules, "comfy.model_management", fake)

    def interrupted(self, *a, **k):
        raise InterruptProcessingException()
    monkeypatch.setattr(McSparsePolicy, "select", interrupted)
    patch = SparseAttentionPatch(CFG)
    try:
        sample(patch, 1)
    except InterruptProcessingException:
        pass
    else:
        raise AssertionError("the interruption was swallowed")
    assert patch.runs == 1 and patch.cache_bytes() == 0 and not patch.fallbacks


def test_an_override_that_calls_ours_back_does_not_recurse():
    """A pack installed after ours that wraps the override it found (ours) and calls it for every call: we chain it
    for our dense calls, and its call back into ours runs the model's attention."""
    patch = SparseAttentionPatch(CFG.replace(warmup_steps=2))
    seen = []

    def wrapping(func, *args, **kwargs):
        seen.append(1)
        return patch(func, *args, **kwargs)  # the override it found when it was installed
    guider = Guider()
    guider.model_options["transformer_options"]["optimized_attention_override"] = wrapping  # installed after ours
    outs = []

    def run(noise, latent, sampler, sigmas):
        for step in range(STEPS):
            outs.extend(forward(patch, guider.model_options["transformer_options"], step, 1))
    patch.outer_sample(Executor(run, guider), None, None, None, SIGMAS)
    assert len(outs) == 2 * STEPS and all(torch.isfinite(o).all() for o in outs)
    dense = [SDPA(*qkv(1 + layer, step)) for step in range(2) for layer in range(2)]
    assert all(torch.allclose(o, d, atol=1e-5) for o, d in zip(outs, dense))  # the warm-up steps: dense
    assert len(seen) == patch.last_stats.totals()["dense"] == 4


def test_an_error_reading_the_call_or_drawing_the_picture_never_fails_the_run(monkeypatch):
    from comfyui_sparse_attention.engine.selection import TokenSelection
    from comfyui_sparse_attention.nodes import forward as forward_mod

    def broken_layout(self, n, transformer_options):
        raise TypeError("a family layout this pack cannot read")
    with monkeypatch.context() as m:
        m.setattr(forward_mod.Forward, "layout", broken_layout)
        patch = SparseAttentionPatch(CFG)
        outs = sample(patch, 1)
    dense = [SDPA(*qkv(1 + layer, step)) for step in range(STEPS) for layer in range(2)]
    assert all(torch.allclose(o, d, atol=1e-5) for o, d in zip(outs, dense))
    assert patch.fallbacks == {"an error reading the call (TypeError)": 2 * STEPS}

    def broken_picture(self, n, width=256):
        raise RuntimeError("no picture")
    monkeypatch.setattr(TokenSelection, "picture", broken_picture)
    patch = SparseAttentionPatch(CFG)
    sample(patch, 1)
    assert patch.last_stats.totals()["reuses"] > 0 and not patch.snapshots and not patch.fallbacks


def test_samplers_whose_reports_do_not_count_the_schedules_steps_keep_their_callback():
    """dpm_fast, dpm_adaptive (a step grid of their own) and ar_video (the schedule once per frame block) are placed
    by their sigmas: their callback is passed on untouched; any other sampler's is wrapped to count its reports."""
    from comfyui_sparse_attention.nodes.patch import OWN_STEP_SAMPLERS, SamplingRun, _with_progress

    def sampler(name):
        def fn(*a, **k):
            return None
        fn.__name__ = name
        return type("KSAMPLER", (), {"sampler_function": staticmethod(fn)})()

    def callback(*a):
        seen.append(a)
    seen = []
    for name in sorted(OWN_STEP_SAMPLERS):
        args = (None, None, sampler(name), None, None, callback)
        assert _with_progress(SamplingRun(SparseConfig(), None), args, {})[0][5] is callback
    run = SamplingRun(SparseConfig(), None)
    args, _ = _with_progress(run, (None, None, sampler("sample_euler"), None, None, callback), {})
    for step in (0, 0, 1, 2):  # a step reported twice counts once
        args[5](step, "x0", "x", 20)
    assert run.done == 3 and len(seen) == 4  # and the original callback got every report
