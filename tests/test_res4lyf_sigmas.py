"""RES4LYF's padded sigmas (ClownsharKSampler / ClownsharkChainsampler): the zeros it adds at both ends of the sigmas
it hands ComfyUI, and the sigma_min it inserts before the final 0, are no steps of the run (nodes/forward.py,
``run_sigmas``; docs/method.md, "Schedule"). Unit tests on the sigma arrays RES4LYF builds, and the same through
ComfyUI on a tiny random Wan with a sampler function that pads and strips its sigmas as RES4LYF does.

The arrays follow RES4LYF's code (ClownsharkBatwing/RES4LYF): beta/samplers.py pads "resample" as [0, sigmas, 0]
and "unsample" as [flipped sigmas, 0]; beta/rk_noise_sampler_beta.py ``prepare_sigmas`` strips that padding and,
on a schedule that ends at 0, inserts the model's sigma_min before the 0 when the last sigma is more than 1e-4 away
from it (or raises a last sigma below sigma_min to it). A chained sampler ("resample" after a sampler stopped by
steps_to_run) receives the first sampler's prepared sigmas, padded again."""

import pytest
import torch
from comfy_subprocess import run_in_comfyui
from conftest import ROOT, comfyui_path

from comfyui_sparse_attention.engine import RunClock, SparseConfig, SparseEngine
from comfyui_sparse_attention.nodes.families import BY_NAME
from comfyui_sparse_attention.nodes.forward import Forward, rising, run_sigmas, step_index

SHIFT, TABLE = 8.0, 1000  # Wan's flow model sampling (comfy/supported_models.py WAN21_T2V; comfy/model_sampling.py)


def _flow_sigma(t: float) -> float:
    return SHIFT * t / (1 + (SHIFT - 1) * t)


SIGMA_MIN = _flow_sigma(1 / TABLE)  # 0.00794, the model's sigma_min


def _simple(steps: int) -> list[float]:
    """ComfyUI's "simple" scheduler (comfy/samplers.py, simple_scheduler) on Wan's sigma table, in float32."""
    table = [_flow_sigma(i / TABLE) for i in range(1, TABLE + 1)]
    ss = len(table) / steps
    return torch.tensor([table[-(1 + int(x * ss))] for x in range(steps)] + [0.0]).tolist()


def _prepared(sig: list[float]) -> list[float]:
    """RES4LYF's prepare_sigmas on a falling schedule that ends at 0 (beta/rk_noise_sampler_beta.py)."""
    out = list(sig)
    if out[-1] == 0:
        if out[-2] < SIGMA_MIN:
            out[-2] = SIGMA_MIN
        elif abs(out[-2] - SIGMA_MIN) > 1e-4:
            out = out[:-1] + [SIGMA_MIN, 0.0]
    return out


def _resample(sig):
    return [0.0] + list(sig) + [0.0]


def _unsample(sig):
    return list(reversed(sig)) + [0.0]


FULL = _simple(20)
CHAINED = _resample(_prepared(FULL))  # [0, s0 .. s19, sigma_min, 0, 0]: the ClownsharkChainsampler after a 10-step stop
UNSAMPLE = _unsample(_simple(10))  # [0, s9 .. s0, 0]: ClownsharKSampler in "unsample" mode


def test_the_arrays_are_res4lyfs():
    assert len(CHAINED) == 24 and CHAINED[:2] == [0.0, FULL[0]] and CHAINED[-4:] == [FULL[-2], SIGMA_MIN, 0.0, 0.0]
    assert UNSAMPLE[0] == 0.0 and UNSAMPLE[-2:] == [1.0, 0.0] and len(UNSAMPLE) == 12


def test_comfyuis_own_schedules_are_read_unchanged():
    flip = list(reversed(_simple(10)))
    flip[0] = 1e-4  # FlipSigmas
    karras_like = FULL[:-2] + [SIGMA_MIN, 0.0]  # a schedule that ends at sigma_min itself (no padding)
    for sig in (FULL, FULL[:11], FULL[10:], flip, karras_like, [1.0, 0.0], [0.5, 0.25]):
        assert run_sigmas(sig) == sig and run_sigmas(sig, SIGMA_MIN) == sig
    assert not rising(FULL) and rising(flip)


def test_resample_padding_is_no_step():
    assert run_sigmas(_resample(FULL)) == FULL  # a ClownsharkChainsampler that starts a run
    assert run_sigmas(_resample(FULL), SIGMA_MIN) == FULL  # its last sigma is no sigma_min: kept
    assert run_sigmas(CHAINED, SIGMA_MIN) == FULL  # the chained 20-step run, without RES4LYF's sigma_min
    assert run_sigmas(CHAINED) == FULL[:-1] + [SIGMA_MIN, 0.0]  # sigma_min unknown: kept
    assert run_sigmas([0.0] + FULL[10:] + [0.0]) == FULL[10:]  # denoise < 1: the tail of a longer run
    assert run_sigmas(FULL + [0.0, 0.0]) == FULL  # repeated trailing zeros are one
    assert run_sigmas([0.0, 0.5, 0.0, 0.0]) == [0.5, 0.0]  # a one-step run


def test_unsample_padding_leaves_a_rising_schedule():
    sig = run_sigmas(UNSAMPLE)
    assert sig == [0.0] + list(reversed(_simple(10)))[1:]  # from its low end up, without the trailing flag
    assert rising(sig) and rising(UNSAMPLE)  # first and last are both 0: the non-zero part rises
    assert run_sigmas(UNSAMPLE, SIGMA_MIN) == sig


def _steps(sched, calls):
    return [step_index({"sigmas": torch.tensor([s]), "sample_sigmas": torch.tensor(sched)}) for s in calls]


def test_unsample_counts_its_steps_forward_like_flipsigmas():
    up = list(reversed(_simple(10)))
    flip = [1e-4] + up[1:]
    # RES4LYF runs it from sigma_min (prepare_sigmas, UNSAMPLE_FROM_ZERO); res_2m evaluates once between too
    calls = [SIGMA_MIN, 0.03] + up[1:-1]
    assert _steps(UNSAMPLE, calls) == [(0, 10), (0, 10)] + [(i, 10) for i in range(1, 10)]
    assert [s for s, _ in _steps(UNSAMPLE, calls)] == [s for s, _ in _steps(flip, [1e-4, 0.03] + up[1:-1])]


def test_the_chained_sampler_counts_steps_ten_to_nineteen_of_twenty():
    # res_2s: a call at each sigma and one between it and the next; the chain sampler runs steps 10-19
    calls = [c for i in range(10, 20) for c in (FULL[i], (FULL[i] + FULL[i + 1]) / 2)]
    want = [s for i in range(10, 20) for s in (i, i)]
    assert [s for s, _ in _steps(CHAINED, calls)] == want
    assert [s for s, _ in _steps(_prepared(FULL), calls)] == want  # sample_sigmas unpadded by RES4LYF itself
    # with the run clock of that sampler (the whole 20-step run: clock_for): steps 10-19 of 20; a call at the
    # sigma_min the clock left out belongs to the last step
    clock = RunClock(0, 20, "the sampler's sigma schedule")
    for sched in (CHAINED, _prepared(FULL)):
        fwds = [Forward(BY_NAME["wan"], (1, 16, 3, 16, 16),
                        {"sigmas": torch.tensor([c]), "sample_sigmas": torch.tensor(sched)}, {}, clock)
                for c in calls + [SIGMA_MIN]]
        assert [f.step for f in fwds] == want + [19] and {f.total for f in fwds} == {20}


def _line(steps, total, anchors, warmup):
    """The engine's dense / anchor / reuse letter of each step, from the steps' labels (as the report shows)."""
    from comfyui_sparse_attention.engine import CallContext, TokenLayout

    eng = SparseEngine(SparseConfig(method="block_topk", density=0.5, warmup_steps=warmup, anchor_steps=anchors,
                                    min_tokens=0, block_q=64, block_k=64, backend="torch"))
    eng.begin_run()
    lay = TokenLayout(grid=(1, 16, 16))
    for i, step in enumerate(steps):
        q, k, v = (torch.randn(1, 1, 256, 32, generator=torch.Generator().manual_seed(i + j)) for j in range(3))
        eng.attend(q, k, v, CallContext(layer=0, step=step, total_steps=total, layout=lay))
    return eng.end_run(log_summary=False).schedule_line()


def test_unsample_anchors_like_flipsigmas():
    up = list(reversed(_simple(10)))
    steps = [s for s, _ in _steps(UNSAMPLE, [SIGMA_MIN, 0.03] + up[1:-1])]
    assert _line(steps, 10, "50%", 2) == "DDArrArrrr"  # was DrArArArA: steps counted down, each a restart


@pytest.fixture(scope="module")
def results():
    if comfyui_path() is None:
        pytest.skip("COMFYUI_PATH is not set")
    return run_in_comfyui(comfyui_path(), f"""
        import sys, time, torch
        sys.path.insert(0, {str(ROOT / "tests")!r})
        import comfy_child as C
        C.load_pack()
        import comfy.sample, comfy.samplers
        from comfyui_sparse_attention.nodes.patch import install
        from comfyui_sparse_attention.nodes.run_clock import clock_for
        from comfyui_sparse_attention.engine import SparseConfig
        calls = C.log_layer0_decisions(lambda ctx, d: [ctx.step, ctx.total_steps])
        model, latent, pos, neg = C.build("wan")
        ms = model.get_model_object("model_sampling")
        smin = ms.sigma_min.reshape(1).float()
        Z = torch.zeros(1)

        def prepared(sig):  # RES4LYF beta/rk_noise_sampler_beta.py, prepare_sigmas, on a falling schedule
            sig = sig.clone()
            if sig[-1] == 0:
                if sig[-2] < smin[0]:
                    sig[-2] = smin[0]
                elif (sig[-2] - smin[0]).abs() > 1e-4:
                    sig = torch.cat((sig[:-1], smin, sig[-1:]))
            return sig

        def resample(sig):  # beta/samplers.py: the "resample" padding
            return torch.cat([Z, sig, Z])

        def unsample(sig):  # beta/samplers.py: the "unsample" flip and padding
            return torch.cat([sig.flip(0), Z])

        out = {{"clocks": {{}}}}
        slowest = 0.0
        for name in ("simple", "normal", "beta", "karras", "exponential"):
            full = comfy.samplers.calculate_sigmas(ms, name, 20).float()
            half = comfy.samplers.calculate_sigmas(ms, name, 40).float()[20:]  # denoise 0.5 (RES4LYF get_sigmas)
            for what, sig in dict(plain=full, fresh=resample(full), chained=resample(prepared(full)),
                                  half=resample(prepared(half)), unsample=unsample(full)).items():
                t0 = time.perf_counter()
                c = clock_for(sig, ms)
                slowest = max(slowest, time.perf_counter() - t0)
                out["clocks"][name + " " + what] = [c.offset, c.total, c.exact]
        out["slowest"] = slowest

        def res4lyf_like(start, stop=None, sync=False):
            # a KSAMPLER function that strips the padding as RES4LYF's prepare_sigmas does and runs euler steps
            # start .. stop of the result (steps_to_run; a chained sampler continues at the first one's end_step)
            def fn(model, x, sigmas, extra_args=None, callback=None, disable=None):
                s = sigmas.float().cpu()
                from_zero = False
                if s[0] == 0:
                    from_zero = bool(s[-1] == 0)
                    s = s[1:]
                    if s[-1] == 0:
                        s = s[:-1]
                s = s[torch.cat((torch.tensor([True]), torch.diff(s) != 0))]
                if s[-1] == 0:
                    s = prepared(s)
                elif from_zero and not torch.isclose(s[0], smin[0]):
                    s = torch.cat([smin, s])
                extra_args = dict(extra_args or {{}})
                if sync:  # RES4LYF (rk_sampler_beta.py) may set sample_sigmas to the sigmas it runs
                    extra_args["model_options"]["transformer_options"]["sample_sigmas"] = s
                ones = x.new_ones([x.shape[0]])
                for i in range(start, len(s) - 1 if stop is None else stop):
                    d = (x - model(x, s[i] * ones, **extra_args)) / s[i]
                    x = x + d * (s[i + 1] - s[i])
                return x
            return comfy.samplers.KSAMPLER(fn)

        def run(m, p, sampler, sig, cfg=3.0):
            calls.clear()
            noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(0))
            comfy.sample.sample_custom(m, noise, cfg, sampler, sig, pos, neg, latent, disable_pbar=True, seed=0)
            return [p.last_stats.schedule_line(), sorted({{c[0] for c in calls}}), sorted({{c[1] for c in calls}}),
                    [p.clock.offset, p.clock.total]]

        cfg = SparseConfig(method="block_topk", density=0.5, warmup_steps=0, anchor_steps="20%, 50%", min_tokens=0,
                           block_q=64, block_k=64, backend="torch")
        full = comfy.samplers.calculate_sigmas(ms, "simple", 20).float()
        with torch.inference_mode():
            m, p = install(model, cfg)
            out["high"] = run(m, p, res4lyf_like(0, 10), full)  # ClownsharKSampler, steps_to_run 10
            out["low"] = run(m, p, res4lyf_like(10), resample(prepared(full)))  # ClownsharkChainsampler, resample
            out["low_synced"] = run(m, p, res4lyf_like(10, sync=True), resample(prepared(full)))
            m, p = install(model, cfg.replace(warmup_steps=2, anchor_steps="50%"))
            ten = comfy.samplers.calculate_sigmas(ms, "simple", 10).float()
            flip = ten.flip(0).clone()
            flip[0] = 1e-4  # FlipSigmas
            out["flip"] = run(m, p, comfy.samplers.sampler_object("euler"), flip, cfg=1.0)
            out["unsample"] = run(m, p, res4lyf_like(0), unsample(ten), cfg=1.0)
        emit(out)
    """, timeout=900)


@pytest.mark.comfyui
def test_res4lyf_sigmas_are_placed_in_their_run(results):
    clocks = results["clocks"]
    for name in ("simple", "normal", "beta", "karras", "exponential"):
        for what in ("plain", "fresh", "chained"):
            assert clocks[f"{name} {what}"] == [0, 20, True], (name, what, clocks[f"{name} {what}"])
        assert clocks[f"{name} half"][:2] == [20, 40], (name, clocks[f"{name} half"])  # was (0, 21) or (0, 23)
        assert clocks[f"{name} unsample"][:2] == [0, 20], (name, clocks[f"{name} unsample"])  # was 21 steps
    assert results["slowest"] < 5.0, results["slowest"]


@pytest.mark.comfyui
def test_a_res4lyf_chain_split_counts_the_steps_of_one_run(results):
    assert results["high"] == ["ArrrArrrrr", list(range(10)), [20], [0, 20]]
    want = ["Arrrrrrrrr", list(range(10, 20)), [20], [0, 20]]  # was ArArrrrrrr, run of 23 steps
    assert results["low"] == want
    assert results["low_synced"] == want


@pytest.mark.comfyui
def test_res4lyf_unsample_runs_its_steps_forward_like_flipsigmas(results):
    line, steps, totals, clock = results["unsample"]
    assert line == results["flip"][0] == "DDArrArrrr", (line, results["flip"])  # was DrArArArA
    assert steps == list(range(10)) and totals == [10] and clock == [0, 10]
