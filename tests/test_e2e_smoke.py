"""bench/e2e.py runs end to end (shrunken models on the CPU), so the GPU benchmark does not rot."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, comfyui_path

pytestmark = pytest.mark.comfyui


def test_e2e_benchmark_smoke(tmp_path):
    env = dict(os.environ, COMFYUI_PATH=str(comfyui_path()), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "e2e.py"), "--out", str(tmp_path), "--tiny",
                           "--models", "wan13b", "--methods", "mc_sparse", "--densities", "0.25"],
                          cwd=str(comfyui_path()), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads((tmp_path / "e2e.json").read_text())["rows"]
    assert [r["mode"] for r in rows] == ["dense", "mc_sparse@0.25"]
    sparse = rows[1]
    assert 0.1 < sparse["density_kept"] < 0.4 and sparse["projected_s"] > 0 and sparse["ceiling_speedup"] >= 1.0
    assert (tmp_path / "e2e.md").read_text().count("| wan13b |") == 2


def test_e2e_times_later_anchors(tmp_path):
    """--anchors-timed 2: steps 0 and 1 are anchors (the second replaces the cache's entries), the projection counts
    the first anchor once and the preset's other anchors at the later anchors' time."""
    import re
    env = dict(os.environ, COMFYUI_PATH=str(comfyui_path()), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "e2e.py"), "--out", str(tmp_path), "--tiny",
                           "--models", "wan13b", "--modes", "block_topk@0.15", "--anchors-timed", "2"],
                          cwd=str(comfyui_path()), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    dense, row = json.loads((tmp_path / "e2e.json").read_text())["rows"]
    assert len(row["anchor_times_s"]) == 2 and row["later_anchor_s"] == row["anchor_times_s"][1]
    warm, anchors, rest = map(int, re.search(r"(\d+) dense warm-up, (\d+) anchor\(s\), (\d+) reuse",
                                             row["schedule"]).groups())
    assert anchors >= 2
    want = warm * row["dense_s"] + row["anchor_s"] + (anchors - 1) * row["later_anchor_s"] + rest * row["step_s"]
    assert abs(row["projected_s"] - want) < 1e-9


def test_e2e_pattern_times_reuse_after_a_later_anchor(tmp_path):
    """--pattern ArAr: anchors at steps 0 and 2, reuse steps 1 and 3 (the second after a later anchor); each step's
    engine phases and memory probe are kept, and --profile-step writes the profiled step's operator tables and
    keeps that step out of the medians."""
    env = dict(os.environ, COMFYUI_PATH=str(comfyui_path()), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "e2e.py"), "--out", str(tmp_path), "--tiny",
                           "--models", "wan13b", "--modes", "mc_sparse@0.25", "--pattern", "ArAr",
                           "--profile-step", "3", "--trace-memory"],
                          cwd=str(comfyui_path()), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _, row = json.loads((tmp_path / "e2e.json").read_text())["rows"]
    times = row["step_times_s"]
    assert row["pattern"] == "ArAr" and len(times) == 4
    # the profiled step 3 (profiler overhead) is left out of the reuse median: another reuse step was timed
    assert row["anchor_times_s"] == [times[0], times[2]] and row["reuse_times_s"] == [times[1]]
    assert row["profiled_step"] == 3 and row["later_anchor_s"] == times[2] and row["step_s"] == times[1]
    sel = {int(k): v["selection"] for k, v in row["step_seconds"].items()}
    assert sorted(sel) == [0, 1, 2, 3] and sel[0] > 0 and sel[2] > 0 and sel[1] == sel[3] == 0
    assert sorted(row["reuse_layer_seconds"]) == ["1", "3"]
    assert [p["step"] for p in row["step_probe"]] == [0, 1, 2, 3]
    assert row["step_probe"][-1]["cache"]["device_bytes"] > 0  # the run's cache, read while it is alive
    prof = (tmp_path / "profile-wan13b-mc_sparse_0.25.txt").read_text()
    assert prof.startswith("step 3,") and "aten::" in prof
    # --trace-memory: one line per self-attention call of every timed step, with the cache's bytes
    traced = re.findall(r"memory: step (\d+) layer (\d+): allocated [\d.]+ MiB, reserved [\d.]+ MiB, driver free "
                        r"[\d.]+ MiB, cache ([\d.]+) MiB on the device", proc.stderr)
    assert {int(st) for st, _, _ in traced} >= {0, 1, 2, 3}
    assert any(float(c) > 0 for st, _, c in traced if st == "2")


def test_e2e_whole_run_times_every_step_of_the_presets_schedule(tmp_path):
    """--whole-run --total-steps 5: the preset's own schedule (anchors at 0, 20 %, 53 %: steps 0, 1, 3 of 5) timed
    step by step in one sampling run; its time is the row's run time and the speed-up is taken from it;
    --warmup-layers 0 runs a variant with every layer sparse, labelled as one."""
    env = dict(os.environ, COMFYUI_PATH=str(comfyui_path()), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "e2e.py"), "--out", str(tmp_path), "--tiny",
                           "--models", "wan13b", "--modes", "block_topk@0.25", "--whole-run", "--total-steps", "5",
                           "--warmup-layers", "0"],
                          cwd=str(comfyui_path()), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    dense, row = json.loads((tmp_path / "e2e.json").read_text())["rows"]
    times = row["step_times_s"]
    assert row["whole_run"] and row["pattern"] == "AArAr" and len(times) == 5
    assert row["anchor_times_s"] == [times[0], times[1], times[3]] and row["reuse_times_s"] == [times[2], times[4]]
    assert row["projected_s"] == pytest.approx(sum(times))
    md = (tmp_path / "e2e.md").read_text()
    assert "(timed whole run)" in md and "block_topk@0.25 (wl0)" in md
    assert row["variant"] == "wl0" and row["warmup_layers"] == 0
    # this variant runs both layers of the tiny model sparse at each reuse step
    assert row["sparse_calls_per_step"] == 2
    assert row["speedup"] == pytest.approx(5 * dense["dense_s"] / sum(times))
    tot = {int(k): v for k, v in row["step_seconds"].items()}
    assert sorted(tot) == [0, 1, 2, 3, 4] and tot[3]["selection"] > 0 and tot[2]["selection"] == 0


def test_whole_run_pattern_follows_the_engines_schedule(bench_import):
    """Warm-up steps are D, the first sparse step and the schedule's anchors A, the rest r: as schedule_counts
    resolves them."""
    e2e = bench_import("e2e")
    from comfyui_sparse_attention import engine as eng
    cfg = eng.SparseConfig(method="block_topk", warmup_steps=2, anchor_steps="50%")
    pattern = e2e.whole_run_pattern(cfg, 8)
    assert pattern == "DDArArrr"
    assert e2e.schedule_counts(cfg, 8) == (pattern.count("D"), pattern.count("A"))
    assert e2e.whole_run_pattern(cfg.replace(warmup_steps=0, anchor_steps="20%, 53%"), 30) == (
        "A" + "r" * 5 + "A" + "r" * 9 + "A" + "r" * 13)


@pytest.mark.parametrize("argv, message", [
    (["--pattern", "rA"], "--pattern: letters A (anchor) and r (reuse), starting with A"),
    (["--whole-run", "--pattern", "ArAr"], "--whole-run times the preset's own schedule"),
    (["--whole-run", "--anchors-timed", "2"], "--whole-run times the preset's own schedule"),
])
def test_e2e_rejects_contradicting_arguments(bench_import, monkeypatch, capsys, tmp_path, argv, message):
    """Checked before anything is built or imported from ComfyUI (in-process: no model, no subprocess)."""
    e2e = bench_import("e2e")
    monkeypatch.setattr(sys, "argv", ["e2e.py", "--out", str(tmp_path), "--tiny", "--models", "wan13b", *argv])
    with pytest.raises(SystemExit) as exc:
        e2e.main()
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_merged_table_takes_each_mode_from_the_newest_run(tmp_path):
    """bench/plot_e2e.py --table: runs listed newest first; a (model, mode) comes from the first run holding it."""
    def run(name, rows):
        d = tmp_path / name
        d.mkdir()
        (d / "e2e.json").write_text(json.dumps({"meta": "", "rows": rows}))
        return str(d / "e2e.json")
    base = dict(model="wan14b", anchor_s=30.0, ceiling_speedup=1.83, of_ceiling=0.9, peak_gb=70.0, cache_gpu_mb=1.0,
                cache_cpu_mb=0.0, cache_fallbacks=0, steady_speedup=2.0, projected_s=700.0)
    new = run("new", [dict(base, mode="block_topk@0.15", step_s=10.66, speedup=1.67)])
    old = run("old", [dict(model="wan14b", mode="dense", step_s=23.0, speedup=1.0),
                      dict(base, mode="block_topk@0.15", step_s=10.79, speedup=1.64),
                      dict(model="wan14b", mode="sol@0.15", step_s=12.02, speedup=1.62, steady_speedup=1.91,
                           projected_s=711.0, peak_gb=41.5),
                      dict(model="wan14b", mode="mc_sparse@0.1", skipped="budget")])
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "plot_e2e.py"), "--table", new, old],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = [x for x in proc.stdout.splitlines() if x.startswith("| wan14b")]
    assert len(lines) == 2  # dense and skipped rows are left out
    assert "10.66" in lines[0] and "| new |" in lines[0] and "10.79" not in proc.stdout
    assert "sol@0.15" in lines[1] and "| old |" in lines[1]


def test_e2e_small_card_with_fp8_weights_smoke(tmp_path):
    """--weights fp8 --vram-gb: the model is built in float8_e4m3fn weights that ComfyUI computes in bf16 (manual
    cast), handed to ComfyUI from host memory (on the CPU the move is a no-op, but the path runs);
    --residual-precision overrides the preset's and names the row."""
    env = dict(os.environ, COMFYUI_PATH=str(comfyui_path()), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "e2e.py"), "--out", str(tmp_path), "--tiny",
                           "--models", "wan14b", "--modes", "block_topk@0.15", "--weights", "fp8", "--vram-gb", "16",
                           "--residual-precision", "int4"],
                          cwd=str(comfyui_path()), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads((tmp_path / "e2e.json").read_text())
    assert "fp8 weights" in doc["meta"]
    dense, sparse = doc["rows"]
    assert dense["mode"] == "dense" and dense["weights_gb"] > 0 and sparse["mode"] == "block_topk@0.15"
    assert dense["weight_dtype"] == "float8_e4m3fn"
    assert sparse["projected_s"] > 0
    assert sparse["residual_precision"] == "int4" and sparse["variant"] == "int4 residuals"
    assert "block_topk@0.15 (int4 residuals)" in (tmp_path / "e2e.md").read_text()


def test_multigpu_benchmark_on_two_cpu_device_keys(tmp_path):
    """bench/multigpu.py --cpu-devices: ComfyUI's MultiGPU CFG Split over the keys "cpu" and "cpu:1"; each key
    gets its own engine, no cache tensor crosses keys, and the split sparse run equals the one-device run."""
    if not (comfyui_path() / "comfy" / "multigpu.py").exists():
        pytest.skip("this ComfyUI has no MultiGPU CFG Split (ComfyUI 0.33.0 or later)")
    env = dict(os.environ, COMFYUI_PATH=str(comfyui_path()), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "multigpu.py"), "--out", str(tmp_path),
                           "--models", "wan13b", "--cpu-devices"],
                          cwd=str(comfyui_path()), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads((tmp_path / "multigpu.json").read_text())["rows"]
    runs = {(r["gpus"], r["mode"].split("@")[0]): r for r in rows if r["mode"] != "compare"}
    assert set(runs) == {(1, "block_topk"), (1, "dense"), (2, "block_topk"), (2, "dense")}
    split = runs[(2, "block_topk")]
    assert sorted(split["engines"]) == ["cpu", "cpu:1"]
    for key, e in split["engines"].items():
        assert e["anchors"] >= 1 and e["reuses"] >= 1, (key, e)
    assert split["cache_on_own_device"] and runs[(1, "block_topk")]["cache_on_own_device"]
    assert all(c["n_violations"] == 0 and c["puts"] > 0 for c in split["cache_check"].values())
    # the CPU keys share one memory, so the device check can only compare types there; that each key's cache was
    # used by its own device's thread alone is what shows nothing crossed between them
    threads = [set(c["threads"]) for c in split["cache_check"].values()]
    assert all(len(t) == 1 for t in threads) and not threads[0] & threads[1]
    (cmp,) = [r for r in rows if r["mode"] == "compare"]
    assert cmp["sparse_equal_within_tolerance"] and cmp["sparse_rel_l2"] <= cmp["tolerance"]


def test_e2e_benchmark_builds_hunyuan_video(tmp_path):
    """HunyuanVideo's parameters differ between ComfyUI releases (0.33.0 added ``meanflow_sum``): the benchmark
    builds and samples it with whichever ComfyUI the tests run against."""
    env = dict(os.environ, COMFYUI_PATH=str(comfyui_path()), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "e2e.py"), "--out", str(tmp_path), "--tiny",
                           "--models", "hyv", "--modes", "block_topk@0.15"],
                          cwd=str(comfyui_path()), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads((tmp_path / "e2e.json").read_text())["rows"]
    assert [(r["model"], r["mode"]) for r in rows] == [("hyv", "dense"), ("hyv", "block_topk@0.15")]
    assert rows[1]["projected_s"] > 0


def test_compile_log_hooks_name_the_kernel_and_time(caplog, bench_import):
    """--log-compiles installs Triton's runtime hooks; a compile is logged with its kernel and seconds."""
    import logging

    pytest.importorskip("triton")
    from triton import knobs

    e2e = bench_import("e2e")
    saved = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    try:
        assert e2e.log_triton_compiles()
        with caplog.at_level(logging.INFO, logger="bench.e2e"):
            assert knobs.runtime.jit_cache_hook(repr="_token_fwd[num_warps=8](MAX_K: i32)") is None
            knobs.runtime.jit_post_compile_hook(repr="_token_fwd[num_warps=8](MAX_K: i32)", key=("i32", "D16"),
                                                already_compiled=False)
        assert any("triton compile" in r.message and "_token_fwd" in r.message and "D16" in r.message
                   for r in caplog.records)
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = saved


def test_prewarm_tunes_the_reuse_path_whatever_the_timed_pattern(bench_import):
    """The kernel warm-up runs an anchor then a reuse call even when the timed pattern's step 1 is an anchor (AAr):
    otherwise the reuse kernels were tuned inside the first timed reuse step."""
    e2e = bench_import("e2e")
    from comfyui_sparse_attention import engine as eng
    cfg = eng.SparseConfig(method="mc_sparse", density=0.25, anchor_steps="0,1", min_tokens=0, backend="torch",
                           group_size=64, block_q=64, block_k=64)
    stats = e2e.prewarm(eng, cfg, (1, 2, 512, 64), torch.float32, torch.device("cpu"))
    assert stats.totals()["anchors"] == 1 and stats.totals()["reuses"] == 1


def test_prewarm_tunes_the_mass_weighted_variants(bench_import, monkeypatch):
    """The warm-up anchors once at step 0 (the residual kept fixed) and once at step 1, where a block selection's
    anchor writes the residual's mass and the reuse call reads it: the kernel variants of a timed run's first and
    later anchors are both tuned before timing."""
    e2e = bench_import("e2e")
    from comfyui_sparse_attention import engine as eng
    from comfyui_sparse_attention import kernels
    seen = []
    anchor = kernels.block_anchor_attention
    monkeypatch.setattr(kernels, "block_anchor_attention", lambda *a, **kw: seen.append(kw["return_mass"]) or
                        anchor(*a, **kw))
    cfg = eng.SparseConfig(method="block_topk", density=0.25, min_tokens=0, backend="torch", block_q=64, block_k=64,
                           residual_weighting="mass")
    stats = e2e.prewarm(eng, cfg, (1, 2, 512, 64), torch.float32, torch.device("cpu"))
    # per memory order (e2e.PREWARM_MEMORY): the first anchor's variant, then the mass-weighted one
    assert seen == [False, True] * len(e2e.PREWARM_MEMORY)
    assert stats.totals()["anchors"] == 1 and stats.totals()["reuses"] == 1


def test_step_probe_profiles_step_zero_and_closes_a_running_profile(bench_import, tmp_path):
    """--profile-step 0 starts the profiler before sampling (the hook's step -1); a profile still running when
    sampling ends is stopped and written by close()."""
    e2e = bench_import("e2e")
    probe = e2e.StepProbe(None, torch.device("cpu"), str(tmp_path), "m-x@0.1", profile_step=0)
    probe(-1)
    torch.ones(8).sum()
    probe(0)
    assert (tmp_path / "profile-m-x_0.1.txt").read_text().startswith("step 0,")
    assert [r["step"] for r in probe.rows] == [0] and "host_available_gb" in probe.rows[0]
    late = e2e.StepProbe(None, torch.device("cpu"), str(tmp_path), "late", profile_step=1)
    late(-1)
    late(0)  # starts the profiler for step 1, which never comes
    late.close()
    assert (tmp_path / "profile-late.txt").exists() and late.prof is None


def test_e2e_times_another_presets_whole_run(tmp_path):
    """--preset times that preset's schedule and settings on the model (here the quality variant: no dense step,
    anchors at 0, 10 %, 23 %, 40 % and 63 % of a 10-step run), and the row names the preset."""
    env = dict(os.environ, COMFYUI_PATH=str(comfyui_path()), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "e2e.py"), "--out", str(tmp_path), "--tiny",
                           "--models", "wan13b", "--preset", "wan21_t2v_14b_quality", "--modes", "block_topk@0.15",
                           "--whole-run", "--total-steps", "10"],
                          cwd=str(comfyui_path()), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _, row = json.loads((tmp_path / "e2e.json").read_text())["rows"]
    assert row["preset"] == "wan21_t2v_14b_quality" and row["pattern"] == "AAArArArrr"
    assert len(row["step_times_s"]) == 10 and row["warmup_layers"] == 1
    assert "block_topk@0.15 (wan21_t2v_14b_quality)" in (tmp_path / "e2e.md").read_text()
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "e2e.py"), "--out", str(tmp_path / "bad"), "--tiny",
                          "--models", "wan13b", "--preset", "no_such_preset"],
                         cwd=str(comfyui_path()), env=env, capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "no preset named 'no_such_preset'" in bad.stderr


def test_prewarm_warms_both_memory_orders_of_the_models_calls(bench_import):
    """bench/e2e.py's prewarm hands the engine q/k/v in both memory orders the models' calls have: Wan's (B, N, H, D)
    memory viewed as (B, H, N, D), and the contiguous (B, H, N, D) of the families that call with skip_reshape. The
    Gluon kernels specialise on it; a variant left out compiled inside the timed steps (docs/benchmarks.md, "Whole
    runs on the Gluon kernels")."""
    e2e = bench_import("e2e")
    shape = (2, 3, 40, 8)
    assert set(e2e.PREWARM_MEMORY) == {"bnhd", "bhnd"}
    bnhd = e2e.prewarm_qkv(shape, torch.float32, torch.device("cpu"), "bnhd")
    bhnd = e2e.prewarm_qkv(shape, torch.float32, torch.device("cpu"), "bhnd")
    for t in bnhd:
        assert t.shape == shape and t.stride() == (40 * 3 * 8, 8, 3 * 8, 1)  # heads inside tokens
    for t in bhnd:
        assert t.shape == shape and t.is_contiguous()
    assert not torch.equal(bnhd[0], bnhd[1])  # q, k and v are drawn apart
