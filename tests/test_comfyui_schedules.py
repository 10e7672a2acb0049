"""Run-relative schedules inside ComfyUI: a tiny random Wan sampled through ComfyUI's own samplers at 4, 8, 20
and 50 steps and as a KSamplerAdvanced-style split (start/end steps); which steps were dense, anchor and
reuse; real schedulers' sigmas placed in their run; an anchor beyond the run rejected before sampling."""

import pytest
from comfy_subprocess import run_in_comfyui
from conftest import ROOT, comfyui_path

pytestmark = pytest.mark.comfyui


@pytest.fixture(scope="module")
def results():
    return run_in_comfyui(comfyui_path(), f"""
        import sys, torch
        sys.path.insert(0, {str(ROOT / "tests")!r})
        import comfy_child as C
        C.load_pack()
        import comfy.sample, comfy.samplers
        from comfyui_sparse_attention.nodes.patch import install
        from comfyui_sparse_attention.nodes.run_clock import clock_for, sampling_coordinates
        from comfyui_sparse_attention.nodes.report import render_report
        from comfyui_sparse_attention.engine import SparseConfig, locate_run
        model, latent, pos, neg = C.build("wan")
        cfg = SparseConfig(method="block_topk", density=0.5, warmup_steps="10%", anchor_steps="50%", min_tokens=0,
                           block_q=64, block_k=64, backend="torch")
        m, p = install(model, cfg)
        out = {{}}
        for steps in (4, 8, 20, 50):
            C.sample(m, latent, pos, neg, steps=steps)
            out[str(steps)] = [p.last_stats.schedule_line(), p.clock.offset, p.clock.total, p.clock.source]
        noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(0))
        for name, (start, last) in dict(high=(0, 10), low=(10, 10000)).items():
            comfy.sample.sample(m, noise, 20, 3.0, "euler", "simple", pos, neg, latent, start_step=start,
                                last_step=last, disable_pbar=True, seed=0)
            out[name] = [p.last_stats.schedule_line(), p.clock.offset, p.clock.total, p.clock.source]
        # a whole-run preset's anchors (0, 20 %, 53 %) on the second sampler of a split: its first step stands in
        m2, p2 = install(model, cfg.replace(warmup_steps=0, anchor_steps="20%, 53%"))
        for total, start in ((20, 10), (50, 25)):
            comfy.sample.sample(m2, noise, total, 3.0, "euler", "simple", pos, neg, latent, start_step=start,
                                last_step=10000, disable_pbar=True, seed=0)
            out[f"stand_in_{{total}}"] = [p2.last_stats.schedule_line(), p2.clock.offset, p2.clock.total]
        out["report"] = render_report(p, -1)[0]
        # real schedulers: a split at several points is placed in its run
        ms = m.get_model_object("model_sampling")
        coords = sampling_coordinates(ms)
        placed, spaced = {{}}, {{}}
        for sched in ("simple", "normal", "sgm_uniform", "karras", "beta"):
            for total in (8, 20, 30):
                full = comfy.samplers.calculate_sigmas(ms, sched, total)
                for start, end in ((0, total // 2), (total // 2, total), (total // 4, 3 * total // 4), (0, total)):
                    c = clock_for(full[start:end + 1], ms)
                    placed[f"{{sched}}-{{total}}-{{start}}-{{end}}"] = [c.offset, c.total]
                    if sched == "simple":  # the spacing fallback alone (no schedule search)
                        c = locate_run(full[start:end + 1].tolist(), coords)
                        spaced[f"{{sched}}-{{total}}-{{start}}-{{end}}"] = [c.offset, c.total]
        out["placed"], out["spaced"] = placed, spaced
        custom = [1.0, 0.9, 0.5, 0.2, 0.05, 0.0]  # hand-made sigmas: no scheduler made them
        c = clock_for(torch.tensor(custom[2:]), ms)
        out["custom"] = [c.offset, c.total, c.source]
        # an anchor step beyond a 6-step run: rejected before any step runs
        bad, bp = install(model, cfg.replace(anchor_steps="2,9"))
        try:
            C.sample(bad, latent, pos, neg, steps=6)
            out["beyond"] = None
        except ValueError as exc:
            out["beyond"] = str(exc)
        out["beyond_calls"] = 0 if bp.last_stats is None else bp.last_stats.totals()["calls"]
        emit(out)
    """, timeout=900)


def test_whole_runs_of_any_length(results):
    assert results["4"][:3] == ["ArAr", 0, 4]
    assert results["8"][:3] == ["DArrArrr", 0, 8]
    assert results["20"][:3] == ["DDArrrrrrrArrrrrrrrr", 0, 20]
    assert results["50"][:3] == ["DDDDDA" + "r" * 19 + "A" + "r" * 24, 0, 50]


def test_a_split_run_places_warmup_and_anchors_in_the_whole_run(results):
    assert results["high"][:3] == ["DDArrrrrrr", 0, 20]   # steps 0-9 of 20: warm-up 2, first sparse step anchors
    assert results["low"][:3] == ["Arrrrrrrrr", 10, 20]   # steps 10-19 of the same 20: the 50 % anchor at step 10
    assert "20-step 'simple' schedule this sampler is part of" in results["low"][3]
    assert "run: 20 steps" in results["report"] and "this sampler ran steps 10-19" in results["report"]


def test_a_later_samplers_first_anchor_serves_the_presets_next_one(results):
    """Wan 2.2's low-noise expert under a Wan 2.1 preset: the anchor at its first step (50 %) serves the 53 % anchor
    one step later at 20 steps (two at 50), instead of anchoring twice in a row (docs/decisions.md)."""
    assert results["stand_in_20"] == ["A" + "r" * 9, 10, 20]
    assert results["stand_in_50"] == ["A" + "r" * 24, 25, 50]


def test_real_schedulers_are_placed(results):
    for table in ("placed", "spaced"):
        for key, (offset, total) in results[table].items():
            sched, n, start, end = key.split("-")
            if sched == "sgm_uniform" and end != n:
                # sgm_uniform at T steps is normal at T + 1 without its last step: a slice short of the end fits both
                assert offset == int(start) and total in (int(n), int(n) + 1), (table, key)
                continue
            assert (offset, total) == (int(start), int(n)), (table, key)
    assert results["custom"][:2] == [0, 3] and "could not be placed" in results["custom"][2]


def test_an_anchor_beyond_the_run_is_rejected_before_sampling(results):
    assert results["beyond"] is not None and "anchor_steps" in results["beyond"] and "[9]" in results["beyond"]
    assert results["beyond_calls"] == 0
