"""Calibrated against uniform density on the quality testbed, in one process: record the q/k/v of one video for
every layer at a few steps of the dense reference run, calibrate per-layer / per-head densities on them with the
engine (engine/calibrate.py), then sample all videos with the uniform and the calibrated configuration at equal
average density under the same schedule, and compare PSNR / SSIM against the dense reference.

    python bench/quality_calibration.py --testbed DIR --out OUT [--densities 0.1,0.15]
        [--methods mc_sparse,block_topk] [--steps 30] [--warmup 2] [--anchors 2,10] [--size 64]
        [--record-steps 2,5,9,10,15,25] [--seeds 0,..,7] [--device cuda]
    python bench/quality_calibration.py --testbed DIR --out OUT --random-init-small --steps 4 --warmup 0 \\
        --anchors 0,2 --record-steps 0,1,2,3 --seeds 0,1     # CPU check of the whole path

Writes OUT/calibration.json (settings, allocations, per-run PSNR / SSIM / statistics), OUT/calibration.md (the
section for docs/calibration.md), OUT/presets/<method>_d<density>.yaml (the calibrated presets) and
OUT/calibration-report.md (+ .png when matplotlib imports: error against density per layer). The testbed loader
and the engine adapter are bench/quality.py's and bench/quality_engine.py's.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

from _pack import load
from quality import build_model, load_testbed, sha256, versions, write_json
from quality_engine import EngineAttention


def say(msg: str) -> None:
    print(f"[calibration] {msg}", flush=True)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


class Recorder:
    """The testbed's attention with q/k/v of video 0 recorded at chosen (layer, step) pairs into a RecordingBuffer
    (engine/recording.py); returns ``dense_fn(q, k, v)`` unchanged. q, k, v: (B, H, N, D)."""

    def __init__(self, dense_fn, context: dict, layers, steps, buffer, layout_cls):
        self.dense_fn, self.context = dense_fn, context
        self.layers, self.steps, self.buffer, self.layout_cls = set(layers), set(steps), buffer, layout_cls

    def __call__(self, q, k, v):
        c = self.context
        layer, step = c.get("layer"), c.get("step")
        if (c.get("batch_offset", 0) == 0 and layer in self.layers and step in self.steps
                and not self.buffer.has(layer, step)):
            self.buffer.add(layer, step, q[0], k[0], v[0], self.layout_cls(grid=tuple(c["grid"])))
        return self.dense_fn(q, k, v)


def section(doc: dict) -> str:
    """The markdown section for docs/calibration.md: setting, table of uniform vs calibrated, gains, allocations."""
    m = doc["meta"]
    lines = ["## Measured on the quality testbed", "",
             f"{m['device']}, torch {m['versions'].get('torch')}, Triton {m['versions'].get('triton')}; {m['date']}; "
             f"`{m['command']}` ({m['wall_s']:.0f} s in all, calibration {m['calibration_s']:.1f} s).", "",
             f"Testbed: {m['testbed']['layers']} layers x {m['testbed']['heads']} heads, {m['testbed']['tokens']} "
             f"tokens" + (" (random weights, --random-init-small)" if m["testbed"]["random_init"] else
                          f", weights sha256 {str(m['testbed']['weights_sha256'])[:12]}…")
             + f"; {len(m['seeds'])} videos, {m['steps']} Euler steps. Schedule for every row: warm-up "
             f"{m['warmup']} dense steps, anchors {m['anchors']}, residual on, blocks / groups of {m['size']}. "
             f"Recording: video {m['seeds'][0]}, every layer at steps {m['record_steps']} of the dense reference "
             f"({m['recording_mb']:.0f} MB); calibration pairs (anchor → later step) {doc['pairs']}. "
             "*Uniform*: one density for every layer and head. *Calibrated*: the per-layer / per-head densities "
             "`tools/calibrate.py` allocates from the recording alone for the same computed density (objective: "
             "reuse-step error with the residual). *Within layers*: the same, but each layer keeps the pairs the "
             "uniform density gives it and only its heads share them (`--scope layer`). *+ sensitivity*: the same "
             "allocation with each layer's error "
             "weighted by how much pixel error that layer alone causes (a sampling run per layer with only that "
             "layer sparse; `--layer-weights` of tools/calibrate.py). PSNR / SSIM against the dense reference, mean "
             "of the videos (worst video). *Predicted*: 10·log10 of the calibration's summed squared attention "
             "error, uniform over calibrated, on the recording.", "",
             "| method | density | uniform PSNR dB | calibrated PSNR dB (gain) | within layers PSNR dB (gain) | "
             "+ sensitivity PSNR dB (gain) | SSIM uniform / calibrated / within layers / + sensitivity | density of "
             "sparse calls (uniform / calibrated / within layers) | predicted gain dB (calibrated / within layers) |",
             "|---|---|---|---|---|---|---|---|---|"]
    rows = {(r["method"], r["density"], r["kind"]): r for r in doc["rows"] if "error" not in r}

    def cell(r, u):
        return "–" if r is None else f"{r['psnr_mean']:.2f} ({r['psnr_mean'] - u['psnr_mean']:+.2f})"
    for a in doc["allocations"]:
        u = rows.get((a["method"], a["target"], "uniform"))
        c = rows.get((a["method"], a["target"], "calibrated"))
        w = rows.get((a["method"], a["target"], "calibrated+sensitivity"))
        hl = rows.get((a["method"], a["target"], "calibrated within layers"))
        if u is None or c is None:
            continue

        def pred(cost):
            return "–" if cost is None else f"{10 * math.log10(a['cost_uniform'] / cost):+.2f}" if cost > 0 else "inf"
        ssim = " / ".join("–" if r is None else f"{r['ssim_mean']:.4f}" for r in (u, c, hl, w))
        dens = " / ".join("–" if r is None else f"{r['stats']['density_sparse']:.3f}" for r in (u, c, hl))
        within = (a.get("within_layers") or {}).get("cost_calibrated")
        lines.append(f"| {a['method']} | {a['target']:g} | {u['psnr_mean']:.2f} ({u['psnr_min']:.2f}) | {cell(c, u)} | "
                     f"{cell(hl, u)} | {cell(w, u)} | {ssim} | {dens} | {pred(a['cost_calibrated'])} / "
                     f"{pred(within)} |")
    gains = [g for g in doc["gains"] if g["target"] == 0.1]
    if gains:
        best = max(gains, key=lambda g: g["gain_db"])
        verdict = "met" if best["gain_db"] >= 1.5 else "missed"
        lines += ["", f"Target (+1.5 dB PSNR at density 0.10): **{verdict}** — best {best['method']} {best['kind']} "
                      f"{best['gain_db']:+.2f} dB."]
    lines += ["", "Calibrated densities (factors of the average; layer: [head 0, head 1]):", ""]
    for a in doc["allocations"]:
        lines.append(f"- {a['method']} at {a['target']:g}: `{a['layer_densities']}`")
        if a.get("within_layers"):
            lines.append(f"- {a['method']} at {a['target']:g} within layers: `{a['within_layers']['layer_densities']}`")
    for sens in doc.get("sensitivity", []):
        lw = ", ".join(f"{la}: {w:.2f}" for la, w in sens["layer_weights"].items())
        pm = sens["predicted_mse"]
        lines.append(f"- {sens['method']} at {sens['target']:g} + sensitivity (layer weights {lw}): "
                     f"`{sens['layer_densities']}`; pixel MSE predicted from single-layer runs "
                     f"({sens['videos']} videos): uniform {pm['uniform']:.2e}, calibrated {pm['calibrated']:.2e}, "
                     f"+ sensitivity {pm['calibrated+sensitivity']:.2e}")
    lines.append("")
    return "\n".join(lines)


def run(args) -> dict:
    import torch

    clock0 = time.perf_counter()
    eng = load("engine")
    cal, recording, layer_density = load("engine.calibrate"), load("engine.recording"), load("engine.layer_density")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    ev = load_testbed(args.testbed, need_weights=not args.random_init_small)
    M = ev.M
    net = build_model(ev, args.testbed, args.random_init_small, device)
    cfg = net.cfg
    if args.video:  # smaller videos than the training size: the tokens' grid follows the noise (CPU checks)
        cfg.frames, cfg.height, cfg.width = ints(args.video)
    seeds = ints(args.seeds)
    noise = ev.make_noise(cfg, seeds)
    labels = torch.tensor([s % cfg.num_classes for s in seeds], dtype=torch.long)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    targets = [float(x) for x in args.densities.split(",") if x.strip()]
    anchors, rec_steps = ints(args.anchors), ints(args.record_steps)
    if not set(anchors) <= set(rec_steps):
        raise SystemExit(f"--record-steps {rec_steps} must include the anchors {anchors}")
    if max(rec_steps) >= args.steps:
        raise SystemExit(f"--record-steps {rec_steps} must lie within the {args.steps} steps")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    say(f"testbed: grid {cfg.grid}, {math.prod(cfg.grid)} tokens, {cfg.num_layers} layers, {cfg.num_heads} heads, "
        f"device {device}")

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def sample(attn):
        return ev.sample(net, noise, labels, steps=args.steps, shift=args.shift, batch=args.batch, attn=attn,
                         device=device).to(device)

    # 1. the dense reference, recording video 0 of the first batch on the way
    buffer = recording.RecordingBuffer(int(args.max_record_mb * 1e6))
    recorder = Recorder(M.sdpa_attention, M.CONTEXT, range(cfg.num_layers), rec_steps, buffer, eng.TokenLayout)
    sync()
    t = time.perf_counter()
    ref = sample(recorder)
    sync()
    ref_s = time.perf_counter() - t
    say(f"dense reference with recording: {ref_s:.1f} s, {buffer.nbytes / 1e6:.0f} MB recorded")
    tmp = Path(tempfile.mkdtemp(prefix="quality-calibration-"))
    rec_path = buffer.save(tmp / "testbed_qkv.safetensors", {"family": "testbed", "total_steps": args.steps,
                                                             "seed": seeds[0], "model": "quality testbed"})
    rec_mb = buffer.nbytes / 1e6
    del buffer, recorder
    rec = recording.load_recording(rec_path)

    # 2. calibrate on the device, with the schedule's anchors among the recorded steps
    size = args.size
    base_fields = dict(block_q=size, block_k=size, group_size=size, warmup_steps=args.warmup,
                       anchor_steps=anchors, residual=True, min_tokens=0, backend="auto")
    base = eng.SparseConfig.from_dict(base_fields, source="calibration base")
    sync()
    t = time.perf_counter()
    curves, allocs, pairs, _ = cal.calibrate(rec, methods, targets, base=base, anchors=anchors, device=device)
    sync()
    cal_s = time.perf_counter() - t
    say(f"calibrated {len(methods)} method(s) x {len(targets)} densit(ies) in {cal_s:.1f} s; pairs {pairs}")
    command = "python bench/quality_calibration.py " + " ".join(sys.argv[1:])
    (out / "presets").mkdir(exist_ok=True)
    for a in allocs:
        p = out / "presets" / f"{a.method}_d{a.target:g}.yaml"
        cal.write_preset(p, cal.preset_text(a, rec, cal.plain_fields(base), command=command))
        say(f"{a.method} at {a.target:g}: layer_densities {cal.layer_densities_text(a.factors)}; predicted error² "
            f"{a.cost_uniform:.5f} -> {a.cost_calibrated:.5f}")
    png = out / "calibration-report.png"
    drew = cal.plot(curves, allocs, png)
    pair_w = cal.pair_weights(pairs, anchors, rec.total_steps)
    (out / "calibration-report.md").write_text(cal.report_markdown(rec, curves, allocs, pairs=pairs, weights=pair_w,
                                                                   plot_name=png.name if drew else None,
                                                                   command=command, seconds=cal_s))
    rec_path.unlink()

    # 3. uniform against calibrated, same schedule and average density
    rows, sensitivity = [], []
    heads_of = {}  # (method, target) -> the allocation among each layer's heads (scope "layer")
    spans_of = {}  # (method, target, kind) -> the anchor spans' factors chosen from the recording

    def run_config(config, n=None):
        """(videos, stats) of the first n videos (all by default) sampled with the engine configuration."""
        attn = EngineAttention(config, args.steps, M.CONTEXT, dense_fn=M.sdpa_attention)
        with attn.run():
            video = ev.sample(net, noise[:n], labels[:n], steps=args.steps, shift=args.shift, batch=args.batch,
                              attn=attn, device=device).to(device)
        sync()
        return video, attn.stats

    def measure_row(a, kind, factors, spans=None):
        config = dict(base_fields, method=a.method, density=a.target)
        if factors is not None:
            config["layer_densities"] = layer_density.layer_densities_dict(factors)
        if spans is not None:
            config["anchor_density_factors"] = list(spans.factors)
        row = {"method": a.method, "density": a.target, "kind": kind, "config": _jsonable(config)}
        t = time.perf_counter()
        try:
            video, stats = run_config(config)
        except Exception as exc:  # keep going with the other settings
            row["error"] = f"{type(exc).__name__}: {exc}"
            rows.append(row)
            say(f"{a.method} d{a.target:g} {kind}: FAILED {row['error'][:300]}")
            return
        p, q = ev.psnr(video, ref), ev.ssim(video, ref)
        row.update(psnr=[round(x, 3) for x in p], ssim=[round(x, 5) for x in q],
                   psnr_mean=round(sum(p) / len(p), 3), psnr_min=round(min(p), 3),
                   ssim_mean=round(sum(q) / len(q), 5), ssim_min=round(min(q), 5),
                   mse=_mse(video, ref), time_s=round(time.perf_counter() - t, 2), stats=stats)
        rows.append(row)
        say(f"{a.method} d{a.target:g} {kind}: PSNR {row['psnr_mean']:.2f} dB (min {row['psnr_min']:.2f}), SSIM "
            f"{row['ssim_mean']:.4f}, density of sparse calls {stats['density_sparse']:.4f}, {row['time_s']:.1f} s")
        if device.type == "cuda":
            torch.cuda.empty_cache()

    for a in allocs:
        measure_row(a, "uniform", None)
        measure_row(a, "calibrated", a.factors)
        mine = [c for c in curves if c.method == a.method]
        heads = cal.allocate(mine, a.target, a.objective, source=rec.path.name, scope="layer")
        heads_of[(a.method, a.target)] = heads
        say(f"{a.method} d{a.target:g} within layers: layer_densities {cal.layer_densities_text(heads.factors)}")
        measure_row(heads, "calibrated within layers", heads.factors)
        if args.anchor_spans:  # density moved between the anchors' spans, chosen from the recording
            for kind, factors, dens in (("uniform+spans", None, None), ("calibrated+spans", a.factors, a.densities)):
                sp = cal.allocate_spans(mine, a.target, a.objective, args.steps, warmup_steps=args.warmup,
                                        densities=dens, source=rec.path.name)
                spans_of[(a.method, a.target, kind)] = {"factors": list(sp.factors), "steps": list(sp.steps),
                                                        "cost_uniform": sp.cost_uniform,
                                                        "cost_calibrated": sp.cost_calibrated,
                                                        "costs_by_first_factor": _first_span_costs(
                                                            cal, mine, a, dens, args.steps, sp.steps)}
                say(f"{a.method} d{a.target:g} {kind}: anchor_density_factors {list(sp.factors)} over span steps "
                    f"{list(sp.steps)}; predicted error² {sp.cost_uniform:.5f} -> {sp.cost_calibrated:.5f}")
                measure_row(a, kind, factors, sp)
        if args.sensitivity_videos <= 0:
            continue
        # how strongly each layer's attention error reaches the videos: only layer l sparse (uniform density), the
        # others dense; the pixel MSE per unit of the layer's calibration cost weights the layer in a second allocation
        n = min(args.sensitivity_videos, len(seeds))
        cost = cal.layer_costs(mine, a.objective, a.target)
        per_layer = {}
        t = time.perf_counter()
        for layer in sorted(cost):
            config = dict(base_fields, method=a.method, density=a.target,
                          dense_layers=[x for x in range(cfg.num_layers) if x != layer])
            video, _ = run_config(config, n)
            per_layer[layer] = _mse(video, ref[:n])
        weights = {la: (per_layer[la] / cost[la] if cost[la] > 0 else 0.0) for la in cost}
        mean_w = sum(weights.values()) / len(weights) or 1.0
        weights = {la: w / mean_w for la, w in weights.items()}
        weighted = cal.allocate(mine, a.target, a.objective, source=rec.path.name, layer_weights=weights)
        sensitivity.append({"method": a.method, "target": a.target, "videos": n, "mse_single_layer": per_layer,
                            "layer_cost": cost, "layer_weights": weights, "seconds": round(time.perf_counter() - t, 2),
                            "layer_densities": cal.layer_densities_text(weighted.factors),
                            "predicted_mse": {k: sum(weights[la] * c for la, c in cal.layer_costs(mine, a.objective, d)
                                                     .items()) * mean_w
                                              for k, d in (("uniform", a.target), ("calibrated", a.densities),
                                                           ("calibrated+sensitivity", weighted.densities))}})
        say(f"{a.method} d{a.target:g}: layer sensitivities {', '.join(f'{la}: {w:.2f}' for la, w in weights.items())}"
            f" ({sensitivity[-1]['seconds']:.1f} s); layer_densities {cal.layer_densities_text(weighted.factors)}")
        p = out / "presets" / f"{a.method}_d{a.target:g}_sensitivity.yaml"
        cal.write_preset(p, cal.preset_text(weighted, rec, cal.plain_fields(base), command=command))
        measure_row(weighted, "calibrated+sensitivity", weighted.factors)
    gains = []
    for a in allocs:
        found = {r["kind"]: r for r in rows
                 if r["method"] == a.method and r["density"] == a.target and "error" not in r}
        for kind in ("calibrated", "calibrated within layers", "calibrated+sensitivity", "uniform+spans",
                     "calibrated+spans"):
            if "uniform" in found and kind in found:
                u, c = found["uniform"], found[kind]
                gains.append({"method": a.method, "target": a.target, "kind": kind,
                              "gain_db": round(c["psnr_mean"] - u["psnr_mean"], 3),
                              "ssim_gain": round(c["ssim_mean"] - u["ssim_mean"], 5)})
    weights = Path(args.testbed) / "weights.safetensors"
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "versions": versions(), "date": time.strftime("%Y-%m-%d %H:%M"), "command": command,
            "steps": args.steps, "warmup": args.warmup, "anchors": anchors, "size": size, "seeds": seeds,
            "record_steps": rec_steps, "recording_mb": rec_mb, "reference_s": round(ref_s, 2),
            "calibration_s": round(cal_s, 2), "wall_s": round(time.perf_counter() - clock0, 1),
            "testbed": {"layers": cfg.num_layers, "heads": cfg.num_heads, "tokens": math.prod(cfg.grid),
                        "grid": list(cfg.grid), "random_init": bool(args.random_init_small),
                        "weights_sha256": None if args.random_init_small else sha256(weights)}}
    doc = {"meta": meta, "pairs": pairs, "pair_weights": pair_w, "rows": rows, "gains": gains,
           "sensitivity": sensitivity,
           "spans": [{"method": m, "target": t, "kind": k, **v} for (m, t, k), v in spans_of.items()],
           "allocations": [{"method": a.method, "target": a.target, "objective": a.objective,
                            "cost_uniform": a.cost_uniform, "cost_calibrated": a.cost_calibrated,
                            "layer_densities": cal.layer_densities_text(a.factors),
                            "within_layers": {"layer_densities": cal.layer_densities_text(
                                heads_of[(a.method, a.target)].factors),
                                "cost_calibrated": heads_of[(a.method, a.target)].cost_calibrated}
                            if (a.method, a.target) in heads_of else None,
                            "densities": {f"{la}.{h}": d for (la, h), d in sorted(a.densities.items())}}
                           for a in allocs],
           "curves": [{"method": c.method, "layer": c.layer, "head": c.head, "densities": list(c.densities),
                       "fresh": c.fresh, "reuse": c.reuse, "reuse_plain": c.reuse_plain, "achieved": c.achieved,
                       "weight": c.weight, "anchors": list(c.anchors), "reuse_spans": c.reuse_spans,
                       "reuse_plain_spans": c.reuse_plain_spans} for c in curves]}
    write_json(out / "calibration.json", doc)
    (out / "calibration.md").write_text(section(doc))
    say(f"wrote {out / 'calibration.json'} and {out / 'calibration.md'} ({meta['wall_s']:.0f} s in all)")
    for g in gains:
        say(f"{g['method']} at {g['target']:g}: {g['kind']} {g['gain_db']:+.2f} dB PSNR, {g['ssim_gain']:+.4f} SSIM")
    return doc


FIRST_FACTORS = (0.6, 1.0, 1.2, 1.35, 1.5, 1.7, 2.0, 2.5)  # the first span's factors the testbed sampled (docs)


def _first_span_costs(cal, curves, a, densities, total_steps, steps) -> dict:
    """{f0: predicted cost} with the first span at f0 and the later spans sharing the rest equally (so the reuse
    steps keep their pairs): the calibration's view of the first-span factors docs/calibration.md sampled."""
    out = {}
    rest = sum(steps[1:])
    for f0 in FIRST_FACTORS:
        if not rest or steps[0] * f0 >= sum(steps):
            continue
        f1 = (sum(steps) - steps[0] * f0) / rest
        out[f0] = cal.span_cost(curves, a.target, a.objective, total_steps, [f0, f1], densities=densities)
    return out


def _mse(video, ref) -> float:
    """Mean squared error of (B, 3, T, H, W) videos with pixels mapped from [-1, 1] to [0, 1] (as the PSNR)."""
    return float((((video.float().clamp(-1, 1) - ref.float().clamp(-1, 1)) / 2) ** 2).mean())


def _jsonable(config: dict) -> dict:
    return json.loads(json.dumps(config, default=str))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--testbed", required=True, help="folder with the testbed's model.py, evaluate.py, weights")
    ap.add_argument("--out", required=True)
    ap.add_argument("--densities", default="0.1,0.15")
    ap.add_argument("--methods", default="mc_sparse,block_topk")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--anchors", default="2,10")
    ap.add_argument("--record-steps", default="2,5,9,10,15,25",
                    help="steps recorded for the calibration (must include the anchors)")
    ap.add_argument("--size", type=int, default=64, help="blocks (block_topk) and query groups (mc_sparse)")
    ap.add_argument("--seeds", default="0,1,2,3,4,5,6,7")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--shift", type=float, default=3.0)
    ap.add_argument("--max-record-mb", type=float, default=4000.0)
    ap.add_argument("--sensitivity-videos", type=int, default=2,
                    help="videos sampled per layer to measure how strongly each layer's error reaches the output, "
                         "for the 'calibrated+sensitivity' rows (0: off)")
    ap.add_argument("--anchor-spans", action="store_true",
                    help="also sample the anchor spans' density factors chosen from the recording "
                         "(engine/calibrate.py allocate_spans), on the uniform and on the calibrated per-head "
                         "densities: rows 'uniform+spans' and 'calibrated+spans'")
    ap.add_argument("--device", default=None)
    ap.add_argument("--video", default=None, help="F,H,W pixels of the sampled videos (default: the testbed's); "
                    "smaller videos make a CPU check of the trained model affordable")
    ap.add_argument("--random-init-small", action="store_true",
                    help="the testbed's --random-init --small: a tiny random model (CPU check, no weights)")
    run(ap.parse_args(argv))


if __name__ == "__main__":
    main()
