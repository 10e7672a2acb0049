"""Run steps of samplers whose calls do not walk a descending schedule one sigma at a time: heunpp2 (evaluates two
sigmas ahead within a step), rising sigmas (FlipSigmas, for inversion / unsampling) and the samplers ComfyUI runs
with the penultimate sigma dropped (uni_pc, dpm_2) split across KSamplerAdvanced nodes. Unit tests on CPU, and the
same through ComfyUI's own samplers on a tiny random Wan."""

import pytest
import torch
from comfy_subprocess import run_in_comfyui
from conftest import ROOT, comfyui_path

from comfyui_sparse_attention.engine import CallContext, SparseConfig, SparseEngine, TokenLayout
from comfyui_sparse_attention.nodes.forward import step_index

SMALL = dict(method="block_topk", density=0.5, warmup_steps=0, min_tokens=0, block_q=64, block_k=64,
             backend="torch")


def _steps(sched, calls):
    return [step_index({"sigmas": torch.tensor([s]), "sample_sigmas": torch.tensor(sched)}) for s in calls]


def test_rising_sigmas_count_their_steps_forward_from_the_start():
    rising = [1e-4, 0.47, 0.67, 0.77, 1.0]  # FlipSigmas of a 4-step schedule (its 0 made 1e-4)
    assert _steps(rising, rising[:-1]) == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert _steps(rising, [0.3, 0.7, 0.9]) == [(0, 4), (2, 4), (3, 4)]  # intermediate sigmas (heun): their step
    falling = list(reversed(rising))[:-1] + [0.0]  # unchanged for the usual descending schedule
    assert _steps(falling, falling[:-1] + [0.9, 0.5]) == [(0, 4), (1, 4), (2, 4), (3, 4), (0, 4), (2, 4)]


def _letters(schedule, total, ran):
    eng = SparseEngine(SparseConfig(anchor_steps=schedule, **SMALL))
    eng.begin_run()
    lay = TokenLayout(grid=(1, 16, 16))
    letters = ""
    for step in ran:
        q, k, v = (torch.randn(1, 1, 256, 32, generator=torch.Generator().manual_seed(step + i)) for i in range(3))
        before = eng.stats.totals()["anchors"]
        eng.attend(q, k, v, CallContext(layer=0, step=step, total_steps=total, layout=lay))
        letters += "A" if eng.stats.totals()["anchors"] > before else "r"
    eng.end_run()
    return letters


def test_a_two_sigma_look_ahead_is_no_restart():
    # heunpp2: step i evaluates at sigma i, i + 1, i + 2, so the next step starts one step behind the last call
    ran = [s for i in range(8) for s in (i, i + 1, i + 2)]
    letters = _letters("5", 10, ran)
    assert letters.count("A") == 2, letters  # the first sparse step and step 5 (first reached by a look-ahead)
    assert letters[ran.index(5)] == "A"


def test_a_restart_without_begin_run_still_selects_afresh():
    assert _letters("", 30, list(range(30)) + [0, 1, 2]) == "A" + "r" * 29 + "Arr"  # back to the start
    assert _letters("", 10, [0, 1, 2, 3, 1, 2]) == "ArrrAr"  # two steps back


@pytest.fixture(scope="module")
def results():
    if comfyui_path() is None:
        pytest.skip("COMFYUI_PATH is not set")
    return run_in_comfyui(comfyui_path(), f"""
        import sys, torch
        sys.path.insert(0, {str(ROOT / "tests")!r})
        import comfy_child as C
        C.load_pack()
        import comfy.sample, comfy.samplers
        from comfyui_sparse_attention.nodes.patch import install
        from comfyui_sparse_attention.nodes.run_clock import clock_for, drops_penultimate
        from comfyui_sparse_attention.engine import SparseConfig
        calls = C.log_layer0_decisions(lambda ctx, d: [ctx.step, d])
        model, latent, pos, neg = C.build("wan")
        cfg = SparseConfig(method="block_topk", density=0.5, warmup_steps=0, anchor_steps="20%, 53%", min_tokens=0,
                           block_q=64, block_k=64, backend="torch")
        out = {{}}
        m, p = install(model, cfg)
        with torch.inference_mode():
            for sampler in ("heun", "heunpp2"):
                C.sample(m, latent, pos, neg, steps=20, sampler=sampler)
                out[sampler] = [p.last_stats.schedule_line(), p.last_stats.totals()["anchors"]]
            # FlipSigmas: the rising schedule of inversion / unsampling
            m, p = install(model, cfg.replace(warmup_steps=2, anchor_steps="50%"))
            ms = m.get_model_object("model_sampling")
            sig = comfy.samplers.calculate_sigmas(ms, "simple", 10).flip(0).clone()
            sig[0] = 1e-4  # as FlipSigmas does
            calls.clear()
            comfy.sample.sample_custom(m, torch.zeros(latent.shape), 1.0, comfy.samplers.sampler_object("euler"), sig,
                                       pos, neg, latent, disable_pbar=True, seed=0)
            out["flip"] = [p.last_stats.schedule_line(), [c[0] for c in calls], p.clock.total]
            # a sampler whose steps hold no reuse step runs dense (same picture, anchors cost more than dense)
            m, p = install(model, cfg)
            for steps in (3, 4):
                dense = C.sample(model, latent, pos, neg, steps=steps)
                o = C.sample(m, latent, pos, neg, steps=steps)
                t = p.last_stats.totals()
                out[f"no_reuse_{{steps}}"] = [t["anchors"], t["reuses"], dict(p.fallbacks), bool(torch.equal(o, dense))]
        # KSamplerAdvanced splits: the halves of the sigmas KSampler makes, placed with the sampler that runs them
        split = {{}}
        for name in ("uni_pc", "uni_pc_bh2", "dpm_2", "dpm_2_ancestral", "euler", "heun"):
            ks = comfy.samplers.KSampler(m, 20, "cpu", name, "simple", 1.0, m.model_options)
            sampler = comfy.samplers.sampler_object(name)
            halves = (ks.sigmas[:11], ks.sigmas[10:])
            split[name] = [[clock_for(h, ms, sampler=sampler).offset, clock_for(h, ms, sampler=sampler).total]
                           for h in halves] + [clock_for(halves[0], ms).total, drops_penultimate(sampler)]
        out["split"] = split
        # a flow model whose timestep is sigma itself, in [0, 1] (Flux): both parts of a split, and denoise 0.5
        flux, *_ = C.build("flux")
        fms = flux.get_model_object("model_sampling")
        full = comfy.samplers.KSampler(flux, 12, "cpu", "euler", "simple", 1.0, flux.model_options).sigmas
        half = comfy.samplers.KSampler(flux, 12, "cpu", "euler", "simple", 0.5, flux.model_options).sigmas
        out["flux_split"] = [[c.offset, c.total] for c in (clock_for(full[:5], fms), clock_for(full[4:], fms),
                                                           clock_for(half, fms), clock_for(full, fms))]
        # the same through the patch, as KSamplerAdvanced runs the first half (its OUTER_SAMPLE wrapper passes the
        # sampler to the run clock)
        with torch.inference_mode():
            m, p = install(model, cfg)
            noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(0))
            comfy.sample.sample(m, noise, 20, 1.0, "uni_pc", "simple", pos, neg, latent, start_step=0, last_step=10,
                                force_full_denoise=False, disable_pbar=True, seed=0)
            out["patched_split"] = [p.clock.offset, p.clock.total]
            # SamplerCustomAdvanced with BasicScheduler + SplitSigmas: the same sampler on a plain schedule
            plain = comfy.samplers.calculate_sigmas(ms, "simple", 20)
            comfy.sample.sample_custom(m, noise, 1.0, comfy.samplers.sampler_object("uni_pc"), plain[:11], pos, neg,
                                       latent, disable_pbar=True, seed=0)
            out["custom_split"] = [p.clock.offset, p.clock.total]
        out["drops"] = {{n: drops_penultimate(comfy.samplers.sampler_object(n))
                        for n in ("heunpp2", "dpmpp_2m", "ddim", "dpm_fast")}}
        out["drops"]["none"] = drops_penultimate(None)
        emit(out)
    """, timeout=900)


@pytest.mark.comfyui
def test_heunpp2_anchors_like_heun(results):
    assert results["heun"] == ["ArrrArrrrrrArrrrrrrr", 6]
    assert results["heunpp2"] == results["heun"]  # was AAAAAAAAAAAAAAAAAAAr, 46 anchor calls


@pytest.mark.comfyui
def test_flipped_sigmas_run_their_steps_forward(results):
    line, steps, total = results["flip"]
    assert total == 10 and line == "DDArrArrrr"  # warm-up at the start; was DAAAAAAAA, counted from step 9 down
    assert steps == sorted(steps) and steps[0] == 0 and steps[-1] == 9


@pytest.mark.comfyui
def test_both_halves_of_a_split_penultimate_dropping_run_share_its_length(results):
    for name in ("uni_pc", "uni_pc_bh2", "dpm_2", "dpm_2_ancestral"):
        first, second, unknown_sampler, drops = results["split"][name]
        assert drops and first == [0, 20] and second == [10, 20], (name, results["split"][name])
        assert unknown_sampler == 21  # the tie: without the sampler the plain 21-step schedule wins
    for name in ("euler", "heun"):
        first, second, unknown_sampler, drops = results["split"][name]
        assert not drops and first == [0, 20] and second == [10, 20] and unknown_sampler == 20, name
    assert not any(results["drops"].values()), results["drops"]
    assert results["patched_split"] == [0, 20]
    assert results["custom_split"] == [0, 20]  # not KSampler: nothing was dropped, the plain schedule wins


@pytest.mark.comfyui
def test_a_sampler_with_no_reuse_step_runs_dense(results):
    """3 steps under anchors '20%, 53%' anchor at 0, 1 and 2: with the residual each anchor costs more than a dense
    call and gives the dense output, so the run is dense (the same picture, bit for bit); 4 steps reuse at step 3."""
    anchors, reuses, fallbacks, equal = results["no_reuse_3"]
    assert anchors == 0 and reuses == 0 and equal
    assert any("no reuse step" in k for k in fallbacks), fallbacks
    anchors, reuses, fallbacks, equal = results["no_reuse_4"]
    assert anchors > 0 and reuses > 0 and not any("no reuse step" in k for k in fallbacks)


@pytest.mark.comfyui
def test_a_split_of_a_flow_model_with_timesteps_in_zero_to_one_is_placed_in_its_run(results):
    """Flux (and Qwen-Image, LTX-2, Chroma, Lumina 2): the second part of a split and a denoise-0.5 run were taken
    for whole runs (engine/schedule.py, Coordinate.unit)."""
    assert results["flux_split"] == [[0, 12], [4, 12], [12, 24], [0, 12]]


@pytest.mark.comfyui
def test_a_sampler_that_scales_the_models_sigma_is_counted_by_its_reported_steps():
    """Detail Daemon and LyingSigmaSampler hand the model a sigma scaled by a few percent while the sampler walks the
    plain schedule; near the top of Wan's shift-8 schedule that moved calls by steps (anchors early, or steps
    "going back" taken for restarts). The steps the sampler reports through its callback place them. A sampler
    that reports more than once per step (RES4LYF's implicit steps) is placed by its sigmas, as before."""
    if comfyui_path() is None:
        pytest.skip("COMFYUI_PATH is not set")
    r = run_in_comfyui(comfyui_path(), f"""
        import sys, torch
        sys.path.insert(0, {str(ROOT / "tests")!r})
        import comfy_child as C
        C.load_pack()
        import comfy.sample, comfy.samplers
        from comfyui_sparse_attention.nodes.patch import install
        from comfyui_sparse_attention.engine import SparseConfig
        model, latent, pos, neg = C.build("wan")
        cfg = SparseConfig(method="block_topk", density=0.5, warmup_steps=0, anchor_steps="20%, 50%", min_tokens=0,
                           block_q=64, block_k=64, backend="torch")
        ms = model.get_model_object("model_sampling")
        sigmas = comfy.samplers.calculate_sigmas(ms, "simple", 20)

        def euler(scale, reports=1, numbers=1):
            def sample(model, x, sigmas, extra_args=None, callback=None, disable=None):
                s_in = x.new_ones([x.shape[0]])
                for i in range(len(sigmas) - 1):
                    denoised = model(x, sigmas[i] * scale * s_in, **(extra_args or {{}}))
                    for j in range(reports):
                        if callback is not None:
                            callback({{"x": x, "i": i * numbers + j * (numbers > 1), "sigma": sigmas[i],
                                      "sigma_hat": sigmas[i], "denoised": denoised}})
                    x = x + (x - denoised) / sigmas[i] * (sigmas[i + 1] - sigmas[i])
                return x
            return comfy.samplers.KSAMPLER(sample)

        import comfy.model_management as mm
        real_free = mm.get_free_memory
        out = {{}}
        with torch.inference_mode():
            for name, scale, reports, numbers in (("plain", 1.0, 1, 1), ("lower", 0.9, 1, 1),
                                                  ("higher", 1.08, 1, 1), ("twice", 1.0, 2, 1),
                                                  ("twice_numbered", 1.0, 2, 2), ("higher_split", 1.08, 1, 1)):
                m, p = install(model, cfg)
                if name.endswith("split"):  # memory "low": cond and uncond run as two calls
                    mm.get_free_memory = lambda dev=None, torch_free_too=False: (1, 1) if torch_free_too else 1
                try:
                    comfy.sample.sample_custom(m, torch.randn(latent.shape,
                                                              generator=torch.Generator().manual_seed(0)),
                                               3.0 if name.endswith("split") else 1.0,
                                               euler(scale, reports, numbers), sigmas, pos, neg, latent,
                                               disable_pbar=True, seed=0)
                finally:
                    mm.get_free_memory = real_free
                out[name] = [p.last_stats.schedule_line(), p.last_stats.totals()["anchors"]]
            # dpm_fast steps on a grid of its own and reports those steps: its calls are placed by their sigmas
            m, p = install(model, cfg)
            C.sample(m, latent, pos, neg, steps=20, sampler="dpm_fast")
            out["dpm_fast"] = max(p.last_stats.step_kinds())
        emit(out)
    """)
    assert r["plain"][0] == "ArrrArrrrrArrrrrrrrr", r
    for name in ("lower", "higher", "twice"):  # 1.08 x step 10's sigma is step 5's: one call that does not fit
        assert r[name] == r["plain"], (name, r)
    # ... and twice in one step when cond and uncond run apart: still one contradicted step
    assert r["higher_split"][0] == r["plain"][0], r
    assert r["dpm_fast"] >= 17, r  # its late calls reach the run's last steps (by its reports alone: step 7)
    # two numbered reports per step: the count runs ahead until two calls at schedule sigmas show it (steps 1 and 2
    # are taken for 2 and 4), then the sigmas place the calls: without that, every step from the tenth on would be
    # taken for the last
    line, anchors = r["twice_numbered"]
    assert line.endswith(r["plain"][0][5:]) and anchors == r["plain"][1], r
