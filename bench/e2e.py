"""End-to-end denoising speed of real-dimension models (random bf16 weights) with the patch applied exactly
as the node applies it (issue 7).

    COMFYUI_PATH=/path/to/ComfyUI python bench/e2e.py --out DIR [--models wan13b,flux] [--steps 4]
        [--methods mc_sparse,block_topk] [--densities 0.25,0.15,0.1] [--tiny]

Per model: one dense run (the engine with every step dense, so attention time is measured with CUDA
events) and one run per method and density with warm-up 1 step and no later anchors, so step 0 is
dense, step 1 an anchor and the rest reuse steps. Each step is timed at the sampler's callback (device
synchronised). The full run is projected for the preset's step count: warm-up steps x dense time +
anchors x anchor time + the rest x reuse time. Also reported: speedup over dense, attention's share of
a dense step, peak GPU memory, cache memory, and the Amdahl ceiling of that schedule (attention at
reuse steps costing exactly the density kept, anchors dense). ``--tiny`` shrinks every model for a CPU
smoke run. Writes DIR/e2e.json and DIR/e2e.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

log = logging.getLogger("bench.e2e")

# name: (supported_models class, unet config, latent shape, text tokens x dim, extra cond, cfg, preset)
MODELS = {
    "wan13b": ("WAN21_T2V", {"image_model": "wan2.1", "model_type": "t2v", "dim": 1536, "ffn_dim": 8960,
                             "freq_dim": 256, "text_dim": 4096, "in_dim": 16, "out_dim": 16, "num_heads": 12,
                             "num_layers": 30, "patch_size": (1, 2, 2), "text_len": 512},
               (1, 16, 21, 60, 104), (512, 4096), {}, 5.0, "wan21_t2v_1.3b"),
    "wan14b": ("WAN21_T2V", {"image_model": "wan2.1", "model_type": "t2v", "dim": 5120, "ffn_dim": 13824,
                             "freq_dim": 256, "text_dim": 4096, "in_dim": 16, "out_dim": 16, "num_heads": 40,
                             "num_layers": 40, "patch_size": (1, 2, 2), "text_len": 512},
               (1, 16, 21, 90, 160), (512, 4096), {}, 5.0, "wan21_t2v_14b"),
    "hyv": ("HunyuanVideo", {"image_model": "hunyuan_video", "in_channels": 16, "out_channels": 16,
                             "vec_in_dim": 768, "context_in_dim": 4096, "hidden_size": 3072, "mlp_ratio": 4.0,
                             "num_heads": 24, "depth": 20, "depth_single_blocks": 40, "axes_dim": [16, 56, 56],
                             "theta": 256, "patch_size": [1, 2, 2], "qkv_bias": True, "guidance_embed": True},
            (1, 16, 33, 90, 160), (256, 4096), {"pooled": 768, "guidance": 6.0}, 1.0, "hunyuan_video"),
    "flux": ("Flux", {"image_model": "flux", "in_channels": 16, "out_channels": 16, "vec_in_dim": 768,
                      "context_in_dim": 4096, "hidden_size": 3072, "mlp_ratio": 4.0, "num_heads": 24, "depth": 19,
                      "depth_single_blocks": 38, "axes_dim": [16, 56, 56], "theta": 10000, "qkv_bias": True,
                      "guidance_embed": True, "patch_size": 2},
             (1, 16, 128, 128), (512, 4096), {"pooled": 768, "guidance": 3.5}, 1.0, "flux"),
    "h3d": ("Hunyuan3Dv2", {"image_model": "hunyuan3d2", "in_channels": 64, "context_in_dim": 1536,
                            "hidden_size": 1024, "num_heads": 16, "depth": 16, "depth_single_blocks": 32},
            (1, 64, 4096), (1370, 1536), {}, 5.0, "hunyuan3d_2"),
}
TINY = {"dim": 128, "ffn_dim": 256, "hidden_size": 128, "num_heads": 2, "num_layers": 2, "depth": 1,
        "depth_single_blocks": 1, "text_dim": 64, "context_in_dim": 64, "vec_in_dim": 32, "axes_dim": [16, 24, 24],
        "freq_dim": 64}


def comfy_setup(cpu: bool):
    root = os.environ.get("COMFYUI_PATH")
    if not root:
        raise SystemExit("set COMFYUI_PATH to a ComfyUI source tree")
    sys.path.insert(0, root)  # a benchmark script, not pack code
    sys.argv = [sys.argv[0]] + (["--cpu"] if cpu else [])
    import comfy.options
    comfy.options.enable_args_parsing()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _pack import load
    return load("nodes.patch"), load("engine.presets"), load("engine")


def build(name: str, tiny: bool, device):
    import comfy.model_patcher
    import comfy.supported_models as sm

    cls, config, latent, (txt_len, txt_dim), extra, cfg, preset = MODELS[name]
    config = dict(config)
    if tiny:
        config.update({k: v for k, v in TINY.items() if k in config})
        txt_len, txt_dim = 16, config.get("text_dim", config.get("context_in_dim", 64))
        if name == "h3d":
            txt_dim = config["context_in_dim"]
        latent = latent[:2] + tuple(max(2, s // 8) for s in latent[2:]) if len(latent) > 3 else (1, 64, 256)
        if "pooled" in extra:
            extra = dict(extra, pooled=config["vec_in_dim"])
    dtype = torch.float32 if tiny else torch.bfloat16
    mc = getattr(sm, cls)(config)
    mc.set_inference_dtype(dtype, None)
    model = mc.get_model({}, "", device)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.diffusion_model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, device=device, dtype=torch.float32).to(p.dtype) * 0.02)
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=device, offload_device=torch.device("cpu"))

    def cond(seed):
        gg = torch.Generator().manual_seed(seed)
        d = {}
        if "pooled" in extra:
            d["pooled_output"] = torch.randn(1, extra["pooled"], generator=gg)
        if "guidance" in extra:
            d["guidance"] = extra["guidance"]
        return [[torch.randn(1, txt_len, txt_dim, generator=gg), d]]
    return patcher, torch.randn(latent, generator=torch.Generator().manual_seed(1)), cond(2), cond(3), cfg, preset


def timed_run(model, latent, pos, neg, cfg, steps, device):
    """Seconds of each denoising step (sampler callback, device synchronised) and peak memory."""
    import comfy.sample

    marks = []

    def callback(step, x0, x, total):
        if device.type == "cuda":
            torch.cuda.synchronize()
        marks.append(time.perf_counter())
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(0))
    comfy.sample.sample(model, noise, steps, cfg, "euler", "simple", pos, neg, latent, denoise=1.0,
                        disable_pbar=True, seed=0, callback=callback)
    times = [b - a for a, b in zip([t0] + marks[:-1], marks)]
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    return times, peak


def bench_model(name, args, patch_mod, presets, eng, device):
    model, latent, pos, neg, cfg, preset_name = build(name, args.tiny, device)
    preset = presets.load_preset(preset_name)
    total_steps = args.total_steps or 50
    warm = min(preset.warmup_steps, total_steps)
    anchors = 1 + sum(1 for s in preset.anchor_steps.steps if warm < s < total_steps)
    common = dict(min_tokens=0 if args.tiny else preset.min_tokens, backend="auto")
    # dense: every step through the engine as a dense call (attention timed by the engine's events)
    dense_cfg = eng.SparseConfig(method="static", warmup_steps=10_000, **common)
    dm, dp = patch_mod.install(model, dense_cfg)
    timed_run(dm, latent, pos, neg, cfg, 2, device)  # warm-up: compile, autotune, allocator
    times, peak = timed_run(dm, latent, pos, neg, cfg, args.steps, device)
    t_dense = sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else times[0]
    attn = dp.last_stats.totals()["seconds"]["attention"] / max(1e-9, sum(times))
    rows = [dict(model=name, mode="dense", step_s=t_dense, projected_s=total_steps * t_dense, speedup=1.0,
                 attention_share=attn, peak_gb=peak / 2**30)]
    log.info("%s dense: %.3f s/step, attention %.0f %% of the step", name, t_dense, 100 * attn)
    for method in args.methods.split(","):
        for dens in (float(x) for x in args.densities.split(",")):
            c = preset.replace(method=method, density=dens, warmup_steps=1, anchor_steps=eng.AnchorSchedule(),
                               **common)
            sm, sp = patch_mod.install(model, c)
            timed_run(sm, latent, pos, neg, cfg, 3, device)  # compile / autotune outside the timing
            times, peak = timed_run(sm, latent, pos, neg, cfg, args.steps, device)
            t_anchor, reuse = times[1], times[2:] or [times[1]]
            t_reuse = sorted(reuse)[len(reuse) // 2]
            stats = sp.last_stats
            tot = stats.totals()
            sparse_calls = tot["anchors"] + tot["reuses"]
            d_kept = ((tot["density"] * tot["calls"] - tot["dense"]) / sparse_calls) if sparse_calls else 1.0
            projected = warm * t_dense + anchors * t_anchor + max(0, total_steps - warm - anchors) * t_reuse
            ceiling = (warm + anchors) * t_dense + max(0, total_steps - warm - anchors) * t_dense * (
                1 - attn * (1 - d_kept))
            row = dict(model=name, mode=f"{method}@{dens}", step_s=t_reuse, anchor_s=t_anchor, dense_s=t_dense,
                       projected_s=projected, speedup=total_steps * t_dense / projected,
                       ceiling_speedup=total_steps * t_dense / ceiling, density_kept=d_kept,
                       peak_gb=peak / 2**30, cache_gpu_mb=stats.cache.get("peak_device_bytes", 0) / 2**20,
                       cache_cpu_mb=stats.cache.get("peak_cpu_bytes", 0) / 2**20,
                       schedule=f"{total_steps} steps: {warm} dense, {anchors} anchor(s)")
            row["of_ceiling"] = row["speedup"] / row["ceiling_speedup"]
            rows.append(row)
            log.info("%s %s: reuse %.3f s, anchor %.3f s, projected %.1f s (%.2fx; ceiling %.2fx)", name,
                     row["mode"], t_reuse, t_anchor, projected, row["speedup"], row["ceiling_speedup"])
    return rows


def render(rows, meta) -> str:
    lines = [f"{meta}", "", "| model | mode | dense s/step | anchor s | reuse s | projected run s | speedup | "
             "Amdahl ceiling | of ceiling | density kept | attention share (dense) | peak GB | cache GPU/CPU MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['mode']} | {r.get('dense_s', r['step_s']):.3f} | "
                     f"{r.get('anchor_s', float('nan')):.3f} | {r['step_s']:.3f} | {r['projected_s']:.1f} | "
                     f"{r['speedup']:.2f} | {r.get('ceiling_speedup', 1.0):.2f} | {r.get('of_ceiling', 1.0):.2f} | "
                     f"{r.get('density_kept', 1.0):.3f} | {r.get('attention_share', float('nan')):.2f} | "
                     f"{r['peak_gb']:.1f} | {r.get('cache_gpu_mb', 0):.0f}/{r.get('cache_cpu_mb', 0):.0f} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="wan13b,wan14b,hyv,flux,h3d")
    ap.add_argument("--methods", default="mc_sparse,block_topk")
    ap.add_argument("--densities", default="0.25,0.15,0.1")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per run (>= 3: dense, anchor, reuse)")
    ap.add_argument("--total-steps", type=int, default=0, help="steps of the projected run (default 50)")
    ap.add_argument("--tiny", action="store_true", help="shrunken models on the CPU (smoke test)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    patch_mod, presets, eng = comfy_setup(cpu=device.type == "cpu")
    rows = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = (f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}, "
            f"{time.strftime('%Y-%m-%d %H:%M')}, timed steps per run {args.steps}")
    for name in args.models.split(","):
        rows += bench_model(name, args, patch_mod, presets, eng, device)
        (out / "e2e.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    (out / "e2e.md").write_text(render(rows, meta))
    sys.stdout.write(render(rows, meta))


if __name__ == "__main__":
    main()
