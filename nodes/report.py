"""The report: run statistics as text and a picture (selection map + density per layer) as an IMAGE."""

from __future__ import annotations

import torch

from ..engine.schedule import warmup_text

SIZE = 256


def render_report(patch, layer: int, samples=None) -> tuple[str, torch.Tensor]:
    """(text, image (1, SIZE, 2*SIZE, 3) float in [0, 1]) for a SparseAttentionPatch (or None): the run whose
    sampler returned ``samples`` (a sampler output tensor or NestedTensor; nodes/patch.py, ``run_for``), else the
    patch's last run, said so."""
    if patch is None:
        return ("No sparse-attention patch on this model: connect the MODEL output of a Sparse Attention node.",
                torch.zeros(1, SIZE, 2 * SIZE, 3))
    run, matched = (patch.last_run, True) if samples is None else patch.run_for(samples)
    stats = None if run is None else run.stats
    if stats is None:
        return ("The patched model has not been sampled yet.", torch.zeros(1, SIZE, 2 * SIZE, 3))
    fallbacks, snapshots = dict(run.fallbacks), run.snapshots
    d = stats.as_dict()
    t = d["totals"]
    cfg = getattr(run, "cfg", patch.cfg)
    lines = [stats.summary_line(), f"model family {patch.family.describe()}; method {cfg.method}, configured density "
             f"{cfg.density:.3f}, anchors {cfg.anchor_steps.describe()}, warm-up {warmup_text(cfg.warmup_steps)} "
             f"steps / {cfg.warmup_layers} layers, residual {'on' if cfg.residual else 'off'}",
             f"sparse calls: density {_sparse_density(d):.3f} (all calls {t['density']:.3f})"]
    if not matched:
        lines.insert(1, "These samples are not the output of a run of this patched model (another model's, a "
                        "denoised output, or a latent changed after sampling): this is the model's last run")
    if run.unreached:
        lines.insert(1, f"NOTHING RAN SPARSE: the model ran {run.forwards} forwards and not one attention call "
                        "reached the pack: most likely a node replaced the model's forward without passing "
                        "transformer_options on (TeaCache and MagCache do), so attention ran dense. ComfyUI's own "
                        "EasyCache and LazyCache work with the pack; or remove that node")
    elif not t["calls"] and fallbacks:
        why = "; ".join(f"{k}: {v}" for k, v in sorted(fallbacks.items()))
        lines.insert(1, f"NOTHING RAN SPARSE: every self-attention call ran the model's own dense attention ({why})"
                     + (f". Below min_tokens ({cfg.min_tokens}) a sparse call is not faster than a dense one "
                        "(docs/benchmarks.md, \"Host overhead at 4 608 tokens\"); larger images or videos make "
                        "longer sequences" if any("min_tokens" in k for k in fallbacks) else ""))
    lines += _run_lines(run.clock, stats)
    lines += _missing_layer_lines(cfg, d["layers"])
    lines += _layout_lines(dict(run.layouts))
    dropped = stats.cache.get("dropped_residual_layers") or []
    if dropped:
        lines.append(f"RESIDUALS DROPPED for lack of GPU and host memory at layer(s) {dropped}: those layers ran "
                     "dense at reuse steps until their next anchor (without its residual a layer's reuse step "
                     "loses the quality; dense keeps it and costs the time); more host memory (cpu_budget_mb) "
                     "keeps them sparse")
    packed = stats.cache.get("packed_residual_layers") or []
    if packed:
        lines.append(f"residuals stored at 4 bits for lack of room at fp8 at layer(s) {packed} (residual_precision "
                     "auto: -0.05 dB on the quality testbed; more memory keeps them at fp8)")
    if fallbacks:
        lines.append("dense fallbacks: " + ", ".join(f"{k}: {v}" for k, v in sorted(fallbacks.items())))
        messages = getattr(patch, "error_messages", {})
        lines += [f"  {k}: {messages[k][:200]}" for k in sorted(fallbacks) if messages.get(k)]
    lines.append("layer: calls dense/anchor/reuse density(all calls) anchor-rel-L2")
    for i, row in d["layers"].items():
        fid = "-" if row["fidelity"] is None else f"{row['fidelity']:.4f}"
        lines.append(f"  {i}: {row['calls']} {row['dense']}/{row['anchors']}/{row['reuses']} "
                     f"{row['density']:.3f} {fid}")
    chosen = layer if layer in snapshots else (min(snapshots) if snapshots else None)
    left = torch.zeros(SIZE, SIZE, 3)
    if chosen is not None:
        snap = snapshots[chosen]
        m = snap["map"].float()[None, None]
        m = torch.nn.functional.interpolate(m, size=(SIZE, SIZE), mode="nearest")[0, 0]
        left = torch.stack([m, m * 0.8, 0.2 + 0.0 * m], -1)
        rows = "query blocks" if snap["kind"] == "block" else "query groups"
        lines.append(f"picture: layer {chosen} ({snap['kind']} map; rows = {rows})")
    right = _density_bars(d["layers"])
    image = torch.cat([left, right], dim=1).clamp(0, 1).unsqueeze(0)
    return "\n".join(lines), image


def _missing_layer_lines(cfg, layers: dict) -> list[str]:
    """A line when dense_layers or layer_densities name layers beyond the last one the run's self-attention calls
    reached (they do nothing: a setting written for another model, or counted from 1). Layers within the range may
    exist with every call skipped (below min_tokens, text only), so they are not named."""
    if not layers:
        return []
    seen, last = set(layers), max(layers)
    named = {"dense_layers": sorted(v for v in set(cfg.dense_layers) if v > last),
             "layer_densities": sorted({layer for layer, _ in cfg.layer_densities if layer > last})}
    missing = "; ".join(f"{k} {', '.join(map(str, v[:12]))}{' ...' if len(v) > 12 else ''}"
                        for k, v in named.items() if v)
    if not missing:
        return []
    return [f"SETTINGS FOR LAYERS THIS RUN DID NOT HAVE (they did nothing): {missing}; the layers the engine saw "
            f"were {min(seen)}-{max(seen)} (numbered from 0 in model order)"]


def _run_lines(clock, stats) -> list[str]:
    """Where the sampler sat in the run and what each of its steps was (D dense, A anchor, r reuse)."""
    if clock is None:
        return []
    steps = stats.step_kinds()
    total = "unknown" if clock.total is None else str(clock.total)
    if steps:
        line = f"run: {total} steps, from {clock.source}; this sampler ran steps {min(steps)}-{max(steps)}"
    else:
        line = f"run: {total} steps, from {clock.source}; no call of this sampler reached the engine"
    if clock.total is None:
        line += " (steps counted; shares of the run in the schedule could not be resolved and were left out)"
    return [line, "steps (D dense, A anchor, r reuse): " + (stats.schedule_line() or "-")]


def _layout_lines(layouts: dict) -> list[str]:
    """The self-attention sequences the run saw: per stream, each layout (segments in order) and its calls."""
    if not layouts:
        return []
    lines = ["segments seen (self-attention calls):"]
    for (stream, layout), calls in sorted(layouts.items(), key=lambda kv: (kv[0][0] != "main", -kv[1])):
        lines.append(f"  {stream}: {layout} ({calls} calls)")
    return lines


def _sparse_density(d) -> float:
    """Mean density of the anchor and reuse calls only (dense and fallback calls count 1.0 each)."""
    sparse = sum(r["anchors"] + r["reuses"] for r in d["layers"].values())
    if not sparse:
        return 1.0
    total = sum(r["density"] * r["calls"] - r["dense"] for r in d["layers"].values())
    return total / sparse


def _density_bars(layers: dict) -> torch.Tensor:
    """A bar per layer, height = density of its sparse calls (blue), or 1.0 for dense-only layers (grey)."""
    img = torch.full((SIZE, SIZE, 3), 0.08)
    if not layers:
        return img
    items = sorted(layers.items())
    width = max(1, SIZE // len(items))
    for j, (_, row) in enumerate(items[:SIZE]):
        sparse = row["anchors"] + row["reuses"]
        dens = (row["density"] * row["calls"] - row["dense"]) / sparse if sparse else 1.0
        h = int(round(dens * (SIZE - 8)))
        color = torch.tensor([0.3, 0.6, 1.0]) if row["anchors"] + row["reuses"] else torch.tensor([0.6, 0.6, 0.6])
        x0 = j * width
        img[SIZE - h:, x0:x0 + max(1, width - 1)] = color
    return img
