"""End-to-end denoising speed of real-dimension models (random bf16 weights) with the patch applied exactly
as the node applies it.

    COMFYUI_PATH=/path/to/ComfyUI python bench/e2e.py --out DIR [--models wan13b,flux]
        [--methods mc_sparse,block_topk,sol] [--densities 0.25,0.15,0.1] [--budget-s 540] [--tiny]

Per model (steps timed at the sampler's callback, device synchronised; "long" steps are those over
``--long-step-s``, of which fewer are timed):
1. dense: the unpatched model (ComfyUI's own attention: PyTorch SDPA). A 1-step run warms up, then
   1 (long) or 3 steps are timed; the median is the dense step time.
2. attention share: one run of our patch with every call dense (the calls go to the same SDPA function),
   its CUDA-event attention time over the step time.
3. each method at each density with the preset's layers and settings but warm-up 0 and no later
   anchors: step 0 is the anchor, the next 1 (long) or 3 steps reuse steps (``--anchors-timed N``: steps 0 to
   N-1 are anchors, so a later anchor, which replaces cached entries, is timed too; ``--pattern ArAr``: the
   timed steps spelled out, A anchor, r reuse, so a reuse step after a later anchor is timed as a preset's run
   has it). After each step the row keeps the engine's phase seconds of that step, the memory held on device
   and host and the cache's placement (``step_probe``); ``--profile-step K`` profiles step K with
   torch.profiler (OUT/profile-MODEL-METHOD_DENSITY.txt). Kernels are compiled and
   autotuned beforehand on one layer's worth of random q/k/v of the model's own shapes (recorded during
   step 1), so no step includes compilation. ``--whole-run``: every step of the preset's run over ``total``
   steps (its warm-up, anchors and reuse steps) is timed in one sampling run; its time replaces the projection.
4. ``sol``: ComfyUI's own sparse kernel, comfy_kitchen.sol_attn, with ``topk_ratio`` = the density, on
   the calls ComfyUI's experimental sparse node sends to it (self-attention, head dim 128, CUDA, no mask,
   >= the preset's min_tokens), when comfy_kitchen is importable.

Projection for the preset's schedule over the model's usual step count (``total`` below):
    warm-up steps x dense + anchors x anchor + the rest x reuse  (sol: warm-up x dense + the rest x sol);
with several timed anchors the first counts once and the others at the later anchors' median; reuse steps at the
median of the timed reuse steps.
The Amdahl ceiling of that schedule: warm-up and anchor steps dense, each reuse step a dense step minus
(1 - density kept) of the dense self-attention time of its sparse layers (each recorded call timed alone
with SDPA; the preset's dense layers excluded).
Also reported: speedup over dense, the steady-state speedup of one reuse step, peak GPU memory, cache
memory on GPU and CPU. ``--tiny`` shrinks every model for a CPU smoke run. Writes DIR/e2e.json (after
every mode, so a run stopped by a time limit keeps what it measured) and DIR/e2e.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from pathlib import Path

import torch

log = logging.getLogger("bench.e2e")

# name: (supported_models class, unet config, latent shape, text tokens x dim, extra cond, cfg, preset,
#        steps of a usual run)
MODELS = {
    "wan13b": ("WAN21_T2V", {"image_model": "wan2.1", "model_type": "t2v", "dim": 1536, "ffn_dim": 8960,
                             "freq_dim": 256, "text_dim": 4096, "in_dim": 16, "out_dim": 16, "num_heads": 12,
                             "num_layers": 30, "patch_size": (1, 2, 2), "text_len": 512},
               (1, 16, 21, 60, 104), (512, 4096), {}, 5.0, "wan21_t2v_1.3b", 50),
    "wan14b": ("WAN21_T2V", {"image_model": "wan2.1", "model_type": "t2v", "dim": 5120, "ffn_dim": 13824,
                             "freq_dim": 256, "text_dim": 4096, "in_dim": 16, "out_dim": 16, "num_heads": 40,
                             "num_layers": 40, "patch_size": (1, 2, 2), "text_len": 512},
               (1, 16, 21, 90, 160), (512, 4096), {}, 5.0, "wan21_t2v_14b", 50),
    "hyv": ("HunyuanVideo", {"image_model": "hunyuan_video", "in_channels": 16, "out_channels": 16,
                             "vec_in_dim": 768, "context_in_dim": 4096, "hidden_size": 3072, "mlp_ratio": 4.0,
                             "num_heads": 24, "depth": 20, "depth_single_blocks": 40, "axes_dim": [16, 56, 56],
                             "theta": 256, "patch_size": [1, 2, 2], "qkv_bias": True, "guidance_embed": True,
                             "byt5": False, "meanflow": False, "use_cond_type_embedding": False,
                             "vision_in_dim": None},
            (1, 16, 33, 90, 160), (256, 4096), {"pooled": 768, "guidance": 6.0}, 1.0, "hunyuan_video", 50),
    "flux": ("Flux", {"image_model": "flux", "in_channels": 16, "out_channels": 16, "vec_in_dim": 768,
                      "context_in_dim": 4096, "hidden_size": 3072, "mlp_ratio": 4.0, "num_heads": 24, "depth": 19,
                      "depth_single_blocks": 38, "axes_dim": [16, 56, 56], "theta": 10000, "qkv_bias": True,
                      "guidance_embed": True, "patch_size": 2},
             (1, 16, 128, 128), (512, 4096), {"pooled": 768, "guidance": 3.5}, 1.0, "flux", 20),
    "h3d": ("Hunyuan3Dv2", {"image_model": "hunyuan3d2", "in_channels": 64, "context_in_dim": 1536,
                            "hidden_size": 1024, "num_heads": 16, "depth": 16, "depth_single_blocks": 32},
            (1, 64, 4096), (1370, 1536), {}, 5.0, "hunyuan3d_2", 50),
}
TINY = {"dim": 128, "ffn_dim": 256, "hidden_size": 128, "num_heads": 2, "num_layers": 2, "depth": 1,
        "depth_single_blocks": 1, "text_dim": 64, "context_in_dim": 64, "vec_in_dim": 32, "axes_dim": [16, 24, 24],
        "freq_dim": 64}


def comfy_setup(cpu: bool, vram_gb: float = 0.0):
    """Import ComfyUI from COMFYUI_PATH. ``vram_gb`` > 0 simulates a card of that size on a bigger GPU: a hard
    per-process limit for PyTorch, and ComfyUI's ``--reserve-vram`` set to the rest so its memory manager (and
    the pack's cache, which plans with it) sees only that much."""
    root = os.environ.get("COMFYUI_PATH")
    if not root:
        raise SystemExit("set COMFYUI_PATH to a ComfyUI source tree")
    sys.path.insert(0, root)  # a benchmark script, not pack code
    sys.argv = [sys.argv[0]] + (["--cpu"] if cpu else [])
    if vram_gb > 0 and not cpu:
        total = torch.cuda.get_device_properties(0).total_memory / 2**30
        torch.cuda.set_per_process_memory_fraction(min(1.0, vram_gb / total))
        sys.argv += ["--reserve-vram", f"{max(0.0, total - vram_gb):.2f}"]
    import comfy.options
    comfy.options.enable_args_parsing()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _pack import load
    return load("nodes.patch"), load("engine.presets"), load("engine")


def build(name: str, tiny: bool, device, weights: str = "bf16", offload: bool = False):
    """The model ``name`` of MODELS with random weights (fp32 and shrunk when ``tiny``), its inputs and settings.

    ``weights``: "bf16", or "fp8" (float8_e4m3fn weights computed in bf16, as ComfyUI runs its fp8 checkpoints).
    ``offload``: the weights are drawn on ``device`` (fast) and then moved to host memory, so that ComfyUI loads
    the model as it loads a checkpoint: fully, or partially (its low-VRAM mode) where the card is too small.
    Returns (ModelPatcher, latent (B, C, [T,] H, W) fp32 on the CPU, positive and negative conds, CFG, preset
    name, steps of a typical run)."""
    import comfy.model_patcher
    import comfy.supported_models as sm

    cls, config, latent, (txt_len, txt_dim), extra, cfg, preset, total = MODELS[name]
    config = dict(config)
    if name == "hyv":  # 0.33.0's HunyuanVideoParams has meanflow_sum (docs/benchmarks.md, "End to end under ComfyUI
        # 0.33.0"); its model detection sets False for HunyuanVideo 1.0
        import comfy.ldm.hunyuan_video.model as hv
        if "meanflow_sum" in getattr(hv.HunyuanVideoParams, "__dataclass_fields__", {}):
            config["meanflow_sum"] = False
    if tiny:
        config.update({k: v for k, v in TINY.items() if k in config})
        txt_len, txt_dim = 16, config.get("text_dim", config.get("context_in_dim", 64))
        if name == "h3d":
            txt_dim = config["context_in_dim"]
        latent = latent[:2] + tuple(max(2, s // 16 * 2) for s in latent[2:]) if len(latent) > 3 else (1, 64, 256)
        if "pooled" in extra:
            extra = dict(extra, pooled=config["vec_in_dim"])
    dtype = torch.float32 if tiny else torch.bfloat16
    if weights not in ("bf16", "fp8"):
        raise ValueError(f"weights: 'bf16' or 'fp8', not {weights!r}")
    mc = getattr(sm, cls)(config)
    if weights == "fp8":
        mc.set_inference_dtype(torch.float8_e4m3fn, dtype)
    else:
        mc.set_inference_dtype(dtype, None)
    model = mc.get_model({}, "", device)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.diffusion_model.parameters():
            p.copy_((torch.randn(p.shape, generator=g, device=device, dtype=torch.float32) * 0.02).to(p.dtype))
    if offload:
        model.to(torch.device("cpu"))
        model.device = torch.device("cpu")
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=device, offload_device=torch.device("cpu"))

    def cond(seed):
        gg = torch.Generator().manual_seed(seed)
        d = {}
        if "pooled" in extra:
            d["pooled_output"] = torch.randn(1, extra["pooled"], generator=gg)
        if "guidance" in extra:
            d["guidance"] = extra["guidance"]
        return [[torch.randn(1, txt_len, txt_dim, generator=gg), d]]
    return (patcher, torch.randn(latent, generator=torch.Generator().manual_seed(1)), cond(2), cond(3), cfg, preset,
            total)


def timed_run(model, latent, pos, neg, cfg, steps, device):
    """Seconds of each denoising step (sampler callback, device synchronised) and peak memory (bytes)."""
    times, peaks, _ = sample_timed(model, latent, pos, neg, cfg, steps, [device])
    return times, peaks[str(device)]


def sample_timed(model, latent, pos, neg, cfg, steps, devices, on_step=None):
    """Sample ``steps`` euler steps from seed-0 noise, timing each step at the sampler's callback with every
    device in ``devices`` (torch.devices) synchronised. ``on_step(i)``, when given, is called after step i's
    time is taken (and with i = -1 just before sampling starts), outside the timed interval of the next step.

    Returns (seconds per step, {str(device): peak bytes allocated during the run, 0 off CUDA}, final latent:
    the sampler's output, same shape as ``latent`` (B, C, [T,] H, W), on ComfyUI's intermediate device and dtype).
    """
    import comfy.sample

    cuda = [d for d in devices if d.type == "cuda"]
    starts, ends = [], []

    def sync():
        for d in cuda:
            torch.cuda.synchronize(d)

    def callback(step, x0, x, total):
        sync()
        ends.append(time.perf_counter())
        if on_step is not None:
            on_step(len(ends) - 1)
            sync()
        starts.append(time.perf_counter())  # the next step's time starts after the hook
    sync()
    for d in cuda:
        torch.cuda.reset_peak_memory_stats(d)
    if on_step is not None:
        on_step(-1)
        sync()
    starts.append(time.perf_counter())
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():  # as ComfyUI executes its nodes (cached tensors are inference tensors)
        out = comfy.sample.sample(model, noise, steps, cfg, "euler", "simple", pos, neg, latent, denoise=1.0,
                                  disable_pbar=True, seed=0, callback=callback)
    times = [b - a for a, b in zip(starts, ends)]
    peaks = {str(d): torch.cuda.max_memory_allocated(d) if d.type == "cuda" else 0 for d in devices}
    return times, peaks, out


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])


def with_override(model, fn):
    """A clone of ``model`` whose attention calls go through ``fn`` (ComfyUI's override contract)."""
    m = model.clone()
    m.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = fn
    return m


def to_bhnd(q, heads, skip_reshape):
    if skip_reshape:
        return q
    b, n, hd = q.shape
    return q.view(b, n, heads, hd // heads).transpose(1, 2)


def shape_recorder(shapes: list):
    """Override that records (B, H, N, D) of every self-attention call and runs the original."""
    def override(func, q, k, v, heads, *args, **kwargs):
        skip = kwargs.get("skip_reshape", False)
        qh, kh = to_bhnd(q, heads, skip), to_bhnd(k, heads, skip)
        if qh.shape[2] == kh.shape[2]:
            shapes.append((tuple(qh.shape), qh.dtype))
        return func(q, k, v, heads, *args, **kwargs)
    return override


def sol_override(density: float, min_tokens: int, counter: dict):
    """ComfyUI's experimental sparse node's use of comfy_kitchen.sol_attn (top-k ratio = density): dense for
    masks, cross-attention, head dims other than 128, non-CUDA tensors and short sequences."""
    from sol_attention import sol_attention

    def override(func, q, k, v, heads, mask=None, *args, **kwargs):
        skip, skip_out = kwargs.get("skip_reshape", False), kwargs.get("skip_output_reshape", False)
        qh, kh, vh = (to_bhnd(t, heads, skip) for t in (q, k, v))
        if (mask is not None or qh.shape != kh.shape or qh.shape[-1] != 128 or not qh.is_cuda
                or qh.shape[2] < min_tokens):
            counter["dense"] = counter.get("dense", 0) + 1
            return func(q, k, v, heads, mask, *args, **kwargs)
        counter["sol"] = counter.get("sol", 0) + 1
        out = sol_attention(qh, kh, vh, density, kwargs.get("scale"))  # (B, H, N, D)
        if skip_out:
            return out
        b, h, n, d = out.shape
        return out.transpose(1, 2).reshape(b, n, h * d)
    return override


def call_layout(patch_mod, model, latent, n_tokens: int):
    """The token layout the patch gives a self-attention call of ``n_tokens`` tokens in a forward of ``latent``
    (B, C, [T,] H, W): the model family's, as a sampling run computes it (checked equal to the run's for every model
    of MODELS); a family that needs the run's transformer options gives its fallback layout, and None where it
    raises (prewarm then compiles for a plain sequence)."""
    family = patch_mod.family_of(model.get_model_object("diffusion_model"))
    try:
        return family.layout(n_tokens, tuple(latent.shape), {})
    except Exception as exc:  # noqa: BLE001 - a family that needs the run's options: the plain sequence
        log.info("prewarm: no layout for %d tokens from the latent alone (%s): a plain sequence", n_tokens, exc)
        return None


def prewarm_qkv(shape, dtype, device, memory: str, seed: int = 5):
    """Random q, k, v (B, H, N, D) for ``prewarm``: contiguous (``memory`` "bhnd": the calls of Flux, HunyuanVideo
    and others, which hand ComfyUI (B, H, N, D) tensors with skip_reshape) or views of (B, N, H, D) memory ("bnhd":
    Wan's calls, (B, N, H·D) reshaped by ComfyUI's attention)."""
    b, h, n, d = shape
    g = torch.Generator(device=device).manual_seed(seed)
    if memory == "bhnd":
        return tuple(torch.randn((b, h, n, d), generator=g, device=device, dtype=dtype) for _ in range(3))
    return tuple(torch.randn((b, n, h, d), generator=g, device=device, dtype=dtype).transpose(1, 2) for _ in range(3))


PREWARM_MEMORY = ("bnhd", "bhnd")


def prewarm(eng, cfg, shape, dtype, device, layout=None):
    """Compile and autotune one configuration's kernels: two runs of an anchor and a reuse call on random q/k/v
    (their own schedule: whatever the timed pattern is, the step after the anchor reuses, so the reuse kernels are
    tuned before timing). The first run anchors at step 0 and the second at step 1, so both kernel variants a
    preset's run meets are tuned: a block selection's anchors at step 0 keep the residual fixed, later ones write
    and read the residual's mass (docs/method.md, "The residual weighted by the mass"). ``layout``: the run's
    token layout (``call_layout``): a video grid changes the selection's blocks and so the kernels' variants.
    Both memory orders a model's calls can have are warmed (``prewarm_qkv``): the Gluon kernels specialise on it
    (Q_BNHD / KV_BNHD), and a variant left out compiled inside the timed steps (docs/benchmarks.md, "Whole runs on
    the Gluon kernels"). Returns the engine's statistics of the last run's two calls."""
    e = eng.SparseEngine(cfg.replace(warmup_steps=0, warmup_layers=0, dense_layers=(), min_tokens=0,
                                     anchor_steps=eng.AnchorSchedule()))
    extra = {} if layout is None else {"layout": layout}
    for memory in PREWARM_MEMORY:
        q, k, v = prewarm_qkv(shape, dtype, device, memory)
        for first in (0, 1):
            e.begin_run()
            for step in (first, first + 1):
                e.attend(q, k, v, eng.CallContext(layer=0, step=step, **extra))
            stats = e.end_run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return stats


def sdpa_call_seconds(shape, dtype, device, reps=5):
    """Seconds of one dense self-attention call of ``shape`` with PyTorch SDPA (ComfyUI's default)."""
    g = torch.Generator(device=device).manual_seed(6)
    q, k, v = (torch.randn(shape, generator=g, device=device, dtype=dtype) for _ in range(3))
    f = torch.nn.functional.scaled_dot_product_attention
    f(q, k, v)
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(reps):
            f(q, k, v)
        return (time.perf_counter() - t0) / reps
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        f(q, k, v)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / reps


def schedule_counts(preset, total: int) -> tuple[int, int]:
    """(warm-up steps, anchor steps) of the preset's schedule over ``total`` steps (``whole_run_pattern``)."""
    pattern = whole_run_pattern(preset, total)
    return pattern.count("D"), pattern.count("A")


def whole_run_pattern(preset, total: int) -> str:
    """The preset's schedule over ``total`` steps as letters, resolved as the engine does (shares of the run against
    ``total``; the first sparse step is always an anchor): D dense warm-up step, A anchor, r reuse (e.g.
    "ArrrrrArrrrrrrrrArrrrrrrrrrrrr" for anchors 0, 6, 16 of 30 steps)."""
    from _pack import load
    warm = min(load("engine.schedule").resolve_warmup(preset.warmup_steps, total), total)
    return "".join("D" if s < warm else "A" if s == warm or preset.anchor_steps.is_anchor(s, warm, total) else "r"
                   for s in range(total))


def row_writer(out: Path, stem: str, meta: str, render):
    """(rows, emit): ``emit(row)`` appends a result row and rewrites OUT/STEM.json ({meta, rows}) and OUT/STEM.md
    (``render(rows, meta)``) at once, so a run stopped by a time limit keeps what it measured."""
    rows: list = []
    out.mkdir(parents=True, exist_ok=True)

    def emit(row):
        rows.append(row)
        (out / f"{stem}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        (out / f"{stem}.md").write_text(render(rows, meta))
    return rows, emit


class Clock:
    """Wall-clock budget of the whole benchmark (device calls have a hard limit)."""

    def __init__(self, budget_s: float):
        self.t0, self.budget = time.perf_counter(), budget_s

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.t0)


class StepProbe:
    """``on_step`` hook of sample_timed: after each timed step, the memory the run holds (device: allocated,
    reserved, free, the allocator's retries; host: available, pinned by torch) and the cache's placement and
    counters; optionally torch.profiler over one step (``profile_step``), written to OUT/profile-TAG.txt."""

    def __init__(self, patch, device, out: str, tag: str, profile_step: int = -1):
        self.patch, self.device, self.out, self.profile_step = patch, device, Path(out), profile_step
        self.tag = re.sub(r"[^A-Za-z0-9._-]", "_", tag)  # a plain file name (the device returns no others)
        self.rows: list[dict] = []
        self.prof = None

    def __call__(self, i: int) -> None:
        if self.prof is not None and i == self.profile_step:
            self.close()
        if i >= 0:
            self.rows.append(self.snapshot(i))
            c = self.rows[-1].get("cache") or {}
            log.info("step %d done: %s; cache fetched %s prefetched %s, CPU layers %s", i,
                     ", ".join(f"{k} {v:.1f}" for k, v in self.rows[-1].items() if k.endswith("_gb")),
                     c.get("fetched"), c.get("prefetched"), c.get("cpu_layers"))
        if i + 1 == self.profile_step:
            from torch.profiler import ProfilerActivity, profile
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self.prof = profile(activities=acts)
            self.prof.start()

    def close(self) -> None:
        """Stop a running profiler and write its tables (a sampling run that ended early leaves one running)."""
        if self.prof is not None:
            self.prof.stop()
            self._write_profile()
            self.prof = None

    def snapshot(self, i: int) -> dict:
        """{step, device memory GB (allocated, reserved, free), allocator retries and OOMs, pinned host GB (torch's
        allocator; the cache's own page-locked pool apart), host available GB, the cache's info (engine/cache.py
        ``SelectionCache.info``)} after step ``i``."""
        gb = 2 ** 30
        row = dict(step=i)
        if self.device.type == "cuda":
            st = torch.cuda.memory_stats(self.device)
            free, _ = torch.cuda.mem_get_info(self.device)
            row.update(allocated_gb=st.get("allocated_bytes.all.current", 0) / gb,
                       reserved_gb=st.get("reserved_bytes.all.current", 0) / gb, device_free_gb=free / gb,
                       alloc_retries=st.get("num_alloc_retries", 0), ooms=st.get("num_ooms", 0))
            try:
                hs = torch.cuda.host_memory_stats()
                row.update(pinned_host_gb=hs.get("allocated_bytes.current", 0) / gb,
                           pinned_host_active_gb=hs.get("active_bytes.current", 0) / gb)
            except Exception:  # noqa: BLE001 - a torch without host allocator statistics
                pass
        from _pack import load
        host = load("engine.cache").host_memory()
        if host is not None:
            row["host_available_gb"] = host[0] / gb
        run = self.patch.run_of({}) if self.patch is not None else None
        if run is not None and run is not self.patch.idle:  # the sampling run in progress
            engines = list(run.engines.engines().values())
            infos = [e.cache.info() for e in engines]
            row["cache"] = infos[0] if len(infos) == 1 else infos
            if engines:  # the page-locked pool of the engine's own modules (engine/pinned_pool.py), not torch's
                pool = getattr(sys.modules[type(engines[0].cache).__module__], "POOL", None)
                if pool is not None:
                    row.update(pool_pinned_gb=pool.held_bytes / gb, pool_free_gb=pool.free_bytes / gb)
        return row

    def _write_profile(self) -> None:
        ka = self.prof.key_averages()
        by = "cuda_time_total" if self.device.type == "cuda" else "cpu_time_total"
        text = (f"step {self.profile_step}, {self.tag}\n\nby {by}:\n" + ka.table(sort_by=by, row_limit=40)
                + "\n\nby cpu_time_total:\n" + ka.table(sort_by="cpu_time_total", row_limit=25))
        (self.out / f"profile-{self.tag}.txt").write_text(text)
        log.info("profile of step %d written to %s", self.profile_step, self.out / f"profile-{self.tag}.txt")


def log_triton_compiles() -> bool:
    """Log every Triton JIT compilation (kernel, specialisation, seconds) through Triton's runtime hooks, so a step
    that stalls on a compile says so. False when this Triton has no such hooks."""
    try:
        from triton import knobs
        rt = knobs.runtime
        if not hasattr(rt, "jit_cache_hook") or not hasattr(rt, "jit_post_compile_hook"):
            return False
    except Exception:  # noqa: BLE001 - an older Triton, or none
        return False
    started: dict = {}

    def before(*_, **kw):
        started[kw.get("repr")] = time.perf_counter()
        return None  # never claims the kernel: Triton compiles as usual

    def after(*_, **kw):
        rep = str(kw.get("repr"))
        sec = time.perf_counter() - started.pop(kw.get("repr"), time.perf_counter())
        log.info("triton compile %.2f s (already compiled on disk: %s): %s; key %s", sec, kw.get("already_compiled"),
                 rep[:300], str(kw.get("key"))[:600])
    rt.jit_cache_hook, rt.jit_post_compile_hook = before, after
    return True


def trace_memory(eng) -> None:
    """--trace-memory: after every self-attention call the engine takes, log its step and layer, the device memory
    allocated and reserved then (PyTorch's counters; under cudaMallocAsync the pool's attributes as the driver keeps
    them; no device synchronisation either way), the driver's free memory
    (cudaMemGetInfo, which does not synchronise either) and the cache's own bytes on the device
    and in host memory, so that memory held beyond the cache's accounting shows layer by layer (docs/benchmarks.md,
    "Issue 14's re-runs on the H200 with the Gluon kernels": mc_sparse's second anchor ran out of memory)."""
    real = eng.SparseEngine.attend
    mib = 2 ** 20

    def attend(self, q, k, v, ctx, **kw):
        out = real(self, q, k, v, ctx, **kw)
        if ctx.is_self:
            alloc = torch.cuda.memory_allocated(q.device) if q.is_cuda else 0
            reserved = torch.cuda.memory_reserved(q.device) if q.is_cuda else 0
            # the driver's free memory: memory freed by PyTorch but still held (a pool, a deferred free) shows here
            free = torch.cuda.mem_get_info(q.device)[0] if q.is_cuda else 0
            log.info("memory: step %s layer %s: allocated %.3f MiB, reserved %.3f MiB, driver free %.3f MiB, cache "
                     "%.3f MiB on the device / %.3f MiB in host memory", ctx.step, ctx.layer, alloc / mib,
                     reserved / mib, free / mib, self.cache.device_bytes / mib, self.cache.cpu_bytes / mib)
        return out
    eng.SparseEngine.attend = attend


def bench_model(name, args, patch_mod, presets, eng, device, clock, emit):
    # a simulated card: the weights start in host memory and ComfyUI loads them (partially where they do not fit)
    model, latent, pos, neg, cfg, preset_name, total = build(name, args.tiny, device, weights=args.weights,
                                                             offload=args.vram_gb > 0)
    total = args.total_steps or total
    preset_name = args.preset or preset_name
    preset = presets.load_preset(preset_name)
    if args.warmup_layers >= 0:  # a variant of the preset: its first N layers dense (the preset's own count otherwise)
        preset = preset.replace(warmup_layers=args.warmup_layers)
    warm, anchors = schedule_counts(preset, total)
    rest = max(0, total - warm - anchors)
    sched = f"{total} steps: {warm} dense warm-up, {anchors} anchor(s), {rest} reuse"
    min_tokens = 0 if args.tiny else preset.min_tokens
    n_layers = sum(model.model.model_config.unet_config.get(k, 0) for k in ("num_layers", "depth",
                                                                            "depth_single_blocks"))
    n_dense_layers = len(set(range(preset.warmup_layers)) | {i for i in preset.dense_layers if i < n_layers})
    sparse_layers = max(0, n_layers - n_dense_layers) / max(1, n_layers)
    earlier = [r for r in args.earlier_rows if r["model"] == name and r["mode"] == "dense"]
    if earlier:  # the dense measurements of an earlier run of this script (--reuse-dense)
        d = earlier[-1]
        t_dense, first, a_self = d["dense_s"], d["dense_s"], d["sdpa_self_attention_s"]
        call_shape, dtype = tuple(d["self_attn_shape"]), getattr(torch, d.get("dtype", "bfloat16"))
        n_timed = 1 if first > args.long_step_s else 3
        log.info("%s dense: %.3f s/step from %s", name, t_dense, args.reuse_dense)
        emit(dict(d, reused_from=args.reuse_dense, projected_s=total * t_dense, schedule=sched))
    else:
        # 1. dense, as ComfyUI runs it; the warm-up run also records the self-attention shapes
        shapes: list = []
        t = time.perf_counter()
        timed_run(with_override(model, shape_recorder(shapes)), latent, pos, neg, cfg, 1, device)
        first = time.perf_counter() - t
        n_timed = 1 if first > args.long_step_s else 3
        times, peak = timed_run(model, latent, pos, neg, cfg, n_timed, device)
        t_dense = median(times)
        (call_shape, dtype) = max(shapes, key=lambda s: s[0][2]) if shapes else (None, None)
        call_s = {sh: sdpa_call_seconds(sh, dt, device) for sh, dt in set(shapes)}
        a_self = sum(call_s[sh] for sh, _ in shapes)  # dense self-attention seconds of one step
        # 2. attention share of the dense step (our patch, every call dense: same SDPA, timed by events)
        dm, dp = patch_mod.install(model, eng.SparseConfig(method="static", warmup_steps=10_000, min_tokens=0))
        dtimes, _ = timed_run(dm, latent, pos, neg, cfg, 1, device)
        attn_share = dp.last_stats.totals()["seconds"]["attention"] / max(1e-9, sum(dtimes))
        emit(dict(model=name, mode="dense", dense_s=t_dense, step_s=t_dense, projected_s=total * t_dense,
                  speedup=1.0, steady_speedup=1.0, attention_share=attn_share, self_attention_share=a_self / t_dense,
                  peak_gb=peak / 2**30, weights_gb=model.model_size() / 2**30,
                  weight_dtype=str(model.model.get_dtype()).replace("torch.", ""),
                  weights_loaded_gb=getattr(model.model, "model_loaded_weight_memory", 0) / 2**30,
                  schedule=sched, self_attn_shape=list(call_shape) if call_shape else None,
                  dtype=str(dtype).replace("torch.", "") if dtype else None, self_attn_calls=len(shapes),
                  sdpa_self_attention_s=a_self))
        log.info("%s dense: %.3f s/step (%d timed), attention %.0f %% of the step (self-attention alone, SDPA: "
                 "%.0f %%, %d calls of %s); weights %.1f GB, %.1f GB of them on the GPU", name, t_dense, len(times),
                 100 * attn_share, 100 * a_self / t_dense, len(shapes), call_shape, model.model_size() / 2**30,
                 getattr(model.model, "model_loaded_weight_memory", 0) / 2**30)
    if args.whole_run:  # every step of the preset's run, timed: no projection needed
        pattern = whole_run_pattern(preset, total)
        if "A" not in pattern or "r" not in pattern:
            raise SystemExit(f"--whole-run: the {preset_name} preset's schedule over {total} steps is {pattern}: "
                             "no anchor and reuse step to time (raise --total-steps)")
    else:
        pattern = args.pattern or "A" * max(1, args.anchors_timed) + "r" * n_timed
    anchor_idx = [i for i, c in enumerate(pattern) if c == "A"]
    n_steps = len(pattern)
    if args.profile_step >= n_steps:
        log.warning("--profile-step %d: the timed steps are %s (from 0); nothing is profiled", args.profile_step,
                    pattern)
    timed_anchors = (eng.AnchorSchedule() if anchor_idx == [0]
                     else eng.AnchorSchedule.parse(",".join(str(s) for s in anchor_idx)))
    if args.modes:
        modes = [(m.split("@")[0], float(m.split("@")[1])) for m in args.modes.split(",")]
    else:  # density-major: a time limit cuts whole densities
        modes = [(m, float(d)) for d in args.densities.split(",") for m in args.methods.split(",")]
    reuse_share = 0.5 if args.whole_run else 1.0  # a whole run's many reuse steps, at about half a dense step
    for method, dens in modes:
        need = first * ({"mc_sparse": 5, "block_topk": 3}.get(method, 2) * len(anchor_idx)
                        + reuse_share * (n_steps - len(anchor_idx)) - 1)
        if clock.left() < need:
            log.warning("%s %s@%s skipped: the time budget is spent", name, method, dens)
            continue
        if method == "sol":  # projected from its steps, also under --whole-run
            emit(bench_sol(name, model, latent, pos, neg, cfg, dens, min_tokens, n_timed, device, t_dense,
                           total, warm, sched))
            continue
        c = preset.replace(method=method, density=dens, min_tokens=min_tokens, backend="auto")
        if not args.whole_run:  # the timed pattern's own schedule
            c = c.replace(warmup_steps=0, anchor_steps=timed_anchors)
        if args.host_gb > 0:
            c = c.replace(cpu_budget_mb=args.host_gb * 1024)
        if args.residual_precision:
            c = c.replace(residual_precision=args.residual_precision)
        if call_shape:
            t = time.perf_counter()
            prewarm(eng, c, call_shape, dtype, device, call_layout(patch_mod, model, latent, call_shape[2]))
            log.info("%s %s@%s: kernels ready in %.1f s", name, method, dens, time.perf_counter() - t)
        sm, sp = patch_mod.install(model, c)
        probe = StepProbe(sp, device, args.out, f"{name}-{method}@{dens}", args.profile_step)
        try:
            times, peak, _ = sample_timed(sm, latent, pos, neg, cfg, n_steps, [device], on_step=probe)
        finally:
            probe.close()
        peak = peak[str(device)]

        def kind_times(letter):  # the timed steps of one kind; a profiled step only when it is the only one
            idx = [i for i, k in enumerate(pattern) if k == letter]
            unprofiled = [i for i in idx if i != args.profile_step]
            return [times[i] for i in (unprofiled or idx)]
        a_times, r_times = kind_times("A"), kind_times("r")
        t_anchor, t_reuse = a_times[0], median(r_times)
        t_later = median(a_times[1:]) if len(a_times) > 1 else t_anchor
        t_warm = median(kind_times("D")) if "D" in pattern else t_dense
        stats = sp.last_stats
        tot = stats.totals()
        sparse_calls = tot["anchors"] + tot["reuses"]
        d_kept = ((tot["density"] * tot["calls"] - tot["dense"]) / sparse_calls) if sparse_calls else 1.0
        sparse_per_step = tot["reuses"] / max(1, len(r_times))  # per reuse step
        from_steps = warm * t_warm + min(anchors, 1) * t_anchor + max(0, anchors - 1) * t_later + rest * t_reuse
        projected = sum(times) if args.whole_run else from_steps  # a whole run: its own time
        t_ceil = max(1e-9, t_dense - a_self * sparse_layers * (1 - d_kept))
        ceiling = (warm + anchors) * t_dense + rest * t_ceil
        tags = ([f"wl{args.warmup_layers}"] if args.warmup_layers >= 0 else []) + \
            ([f"{args.residual_precision} residuals"] if args.residual_precision else [])  # variants asked for
        variant = ", ".join(tags) or None
        row = dict(model=name, mode=f"{method}@{dens}", variant=variant, preset=args.preset or None,  # --preset
                   warmup_layers=c.warmup_layers,
                   step_s=t_reuse, anchor_s=t_anchor, dense_s=t_dense,
                   later_anchor_s=t_later, anchor_times_s=a_times, reuse_times_s=r_times, pattern=pattern,
                   profiled_step=args.profile_step if args.profile_step >= 0 else None,
                   step_times_s=times, step_seconds=stats.step_totals(), step_probe=probe.rows,
                   reuse_layer_seconds={st: per for st, per in stats.step_seconds.items()
                                        if pattern[st:st + 1] == "r"},
                   projected_s=projected, whole_run=args.whole_run, from_steps_s=from_steps,
                   speedup=total * t_dense / projected,
                   ceiling_speedup=total * t_dense / ceiling, steady_speedup=t_dense / t_reuse,
                   density_kept=d_kept, sparse_calls_per_step=sparse_per_step, peak_gb=peak / 2**30,
                   cache_gpu_mb=stats.cache.get("peak_device_bytes", 0) / 2**20,
                   cache_cpu_mb=stats.cache.get("peak_cpu_bytes", 0) / 2**20,
                   cache_fallbacks=stats.cache.get("fallbacks", 0), engine_fallbacks=dict(sp.fallbacks),
                   residuals_dropped=stats.cache.get("residual_dropped", 0),
                   dropped_residual_layers=stats.cache.get("dropped_residual_layers", []),
                   residual_precision=c.residual_precision,  # "int4" packs every residual; these count "auto"'s
                   residuals_packed_for_room=stats.cache.get("residual_packed", 0),
                   layers_packed_for_room=stats.cache.get("packed_residual_layers", []),
                   seconds=tot["seconds"], anchor_fidelity=tot["fidelity_mean"], schedule=sched,
                   reuse_calls=tot["reuses"], replayed_calls=tot["replays"],
                   cache_info=dict(stats.cache))
        row["of_ceiling"] = row["speedup"] / row["ceiling_speedup"]
        emit(row)
        log.info("%s %s: anchor %.3f s (later anchors %.3f s), reuse %.3f s, %s %.1f s (%.2fx; ceiling %.2fx; "
                 "steady %.2fx), cache peak %.0f MB GPU / %.0f MB CPU", name, row["mode"], t_anchor, t_later, t_reuse,
                 f"whole run of {pattern}" if args.whole_run else "projected", projected,
                 row["speedup"], row["ceiling_speedup"], row["steady_speedup"], row["cache_gpu_mb"],
                 row["cache_cpu_mb"])
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_sol(name, model, latent, pos, neg, cfg, dens, min_tokens, n_timed, device, t_dense, total, warm, sched):
    from sol_attention import sol_unavailable

    why = sol_unavailable()
    if why:
        log.warning("sol skipped: %s", why)
        return dict(model=name, mode=f"sol@{dens}", skipped=why)
    counter: dict = {}
    sm = with_override(model, sol_override(dens, min_tokens, counter))
    times, peak = timed_run(sm, latent, pos, neg, cfg, n_timed + 1, device)
    t_sol = median(times[1:])
    projected = warm * t_dense + (total - warm) * t_sol
    row = dict(model=name, mode=f"sol@{dens}", step_s=t_sol, dense_s=t_dense, projected_s=projected,
               speedup=total * t_dense / projected, steady_speedup=t_dense / t_sol, peak_gb=peak / 2**30,
               sol_calls=counter.get("sol", 0), dense_calls=counter.get("dense", 0), schedule=sched)
    log.info("%s %s: %.3f s/step, projected %.1f s (%.2fx), %s", name, row["mode"], t_sol, projected,
             row["speedup"], counter)
    return row


def render(rows, meta) -> str:
    def f(v, fmt):
        return "–" if v is None else format(v, fmt)
    lines = [f"{meta}", "", "| model | mode | dense s/step | anchor s | reuse s | steady speedup | projected run s "
             "| speedup | Amdahl ceiling | of ceiling | density kept | attention share (dense) | peak GB "
             "| cache GPU/CPU MB |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['model']} | {r['mode']} | skipped: {r['skipped']} |||||||||||")
            continue
        tags = [r[k] for k in ("variant", "preset") if r.get(k)]
        mode = r["mode"] + (f" ({', '.join(tags)})" if tags else "")
        lines.append(f"| {r['model']} | {mode} | {f(r.get('dense_s'), '.3f')} | {f(r.get('anchor_s'), '.3f')} | "
                     f"{f(r['step_s'], '.3f')} | {f(r.get('steady_speedup'), '.2f')} | {r['projected_s']:.1f}"
                     f"{' (timed whole run)' if r.get('whole_run') else ''} | "
                     f"{r['speedup']:.2f} | {f(r.get('ceiling_speedup'), '.2f')} | {f(r.get('of_ceiling'), '.2f')} | "
                     f"{f(r.get('density_kept'), '.3f')} | {f(r.get('attention_share'), '.2f')} | "
                     f"{r['peak_gb']:.1f} | {f(r.get('cache_gpu_mb'), '.0f')}/{f(r.get('cache_cpu_mb'), '.0f')} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="wan13b,wan14b,hyv,flux,h3d")
    ap.add_argument("--methods", default="mc_sparse,block_topk,sol")
    ap.add_argument("--densities", default="0.25,0.15,0.1")
    ap.add_argument("--modes", default="", help="method@density list, in this order (instead of methods x densities)")
    ap.add_argument("--total-steps", type=int, default=0, help="steps of the projected run (default: the model's)")
    ap.add_argument("--long-step-s", type=float, default=5.0, help="steps longer than this are timed once")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip modes that would not finish in this time")
    ap.add_argument("--anchors-timed", type=int, default=1, help="anchor steps timed before the reuse steps (a "
                    "later anchor replaces the cache's entries: it reuses their memory)")
    ap.add_argument("--pattern", default="", help="the timed steps as letters, A anchor and r reuse (e.g. ArAr: the "
                    "reuse step after a later anchor, as a preset's run has them); overrides --anchors-timed")
    ap.add_argument("--whole-run", action="store_true", help="time every step of the preset's run (its warm-up, "
                    "anchors and reuse steps over --total-steps) instead of a pattern and a projection")
    ap.add_argument("--preset", default="", help="time this preset's settings and schedule instead of the model's "
                    "own preset (e.g. wan21_t2v_14b_quality), on every model of --models; --modes still names the "
                    "method and density")
    ap.add_argument("--warmup-layers", type=int, default=-1, help="run the preset with its first N layers dense "
                    "instead of its own warmup_layers (a variant to time; default: the preset's)")
    ap.add_argument("--profile-step", type=int, default=-1, help="profile this step of the timed ones (0-based) with "
                    "torch.profiler: OUT/profile-MODEL-METHOD_DENSITY.txt, operators by CUDA and by CPU time")
    ap.add_argument("--log-compiles", action="store_true", help="log each Triton compilation (kernel, specialisation, "
                    "seconds): which step compiled what")
    ap.add_argument("--trace-memory", action="store_true", help="log the device memory allocated and the cache's "
                    "bytes after every self-attention call (which layer's call holds what)")
    ap.add_argument("--reuse-dense", default="", help="e2e.json of an earlier run: take its dense rows instead of "
                    "measuring them again (GPU time is scarce)")
    ap.add_argument("--tiny", action="store_true", help="shrunken models on the CPU (smoke test)")
    ap.add_argument("--vram-gb", type=float, default=0.0, help="simulate a card with this much memory (a per-process "
                    "limit and ComfyUI's --reserve-vram for the rest)")
    ap.add_argument("--host-gb", type=float, default=0.0, help="cap the cache's host memory (cpu_budget_mb) at this")
    ap.add_argument("--residual-precision", choices=("fp8", "int4", "auto", "model"), default="",
                    help="store the residuals this way instead of as the preset says (docs/decisions.md, \"Residuals "
                    "at 4 bits\")")
    ap.add_argument("--weights", choices=("bf16", "fp8"), default="bf16", help="weight dtype: bf16, or fp8 "
                    "(float8_e4m3fn computed in bf16, as ComfyUI runs fp8 checkpoints)")
    args = ap.parse_args()
    bad = [m for m in args.modes.split(",") if not re.fullmatch(r"[a-z_]+@[0-9]*\.?[0-9]+", m)] if args.modes else []
    if bad:
        ap.error(f"--modes takes method@density entries (dense is always timed first), got {bad}")
    if args.pattern and (set(args.pattern) - {"A", "r"} or not args.pattern.startswith("A") or "r" not in args.pattern):
        ap.error("--pattern: letters A (anchor) and r (reuse), starting with A, with at least one r")
    if args.whole_run and (args.pattern or args.anchors_timed != 1):
        ap.error("--whole-run times the preset's own schedule: leave out --pattern and --anchors-timed")
    if args.profile_step >= 0 and args.pattern and args.profile_step >= len(args.pattern):
        ap.error(f"--profile-step: steps count from 0; the pattern {args.pattern} has {len(args.pattern)}")
    args.earlier_rows = json.loads(Path(args.reuse_dense).read_text())["rows"] if args.reuse_dense else []
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    patch_mod, presets, eng = comfy_setup(cpu=device.type == "cpu", vram_gb=args.vram_gb)
    if args.preset and args.preset not in presets.list_presets():
        ap.error(f"--preset: no preset named {args.preset!r} (presets/*.yaml: {', '.join(presets.list_presets())})")
    clock = Clock(args.budget_s)
    alloc = f", allocator {torch.cuda.get_allocator_backend()}" if device.type == "cuda" else ""
    meta = (f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}"
            f"{alloc}, {time.strftime('%Y-%m-%d %H:%M')}"
            + (f", simulated card {args.vram_gb:g} GB" if args.vram_gb else "")
            + (f", host cache cap {args.host_gb:g} GB" if args.host_gb else "")
            + (f", {args.weights} weights" if args.weights != "bf16" else ""))
    if args.log_compiles and not log_triton_compiles():
        log.warning("--log-compiles: this Triton has no compile hooks; nothing will be logged")
    if args.trace_memory:
        trace_memory(eng)
    rows, emit = row_writer(Path(args.out), "e2e", meta, render)
    for name in args.models.split(","):
        bench_model(name, args, patch_mod, presets, eng, device, clock, emit)
    sys.stdout.write(render(rows, meta))


if __name__ == "__main__":
    main()
