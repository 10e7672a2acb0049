"""Given per-head allocations sampled side by side on the quality testbed (docs/calibration.md, "A model of the
output"): the dense reference once per video, then the uniform density and every named allocation, each video
compared with its own dense run. Made for the CPU too, where one 30-step video takes minutes: videos are sampled
--batch at a time (1 by default) and the JSON is rewritten after each call, so a run cut short keeps every video it
finished.

    python bench/quality_allocations.py --testbed DIR --out OUT --method mc_sparse --density 0.1 --seeds 8,9,10,11 \\
        --alloc "searched={0: [0.48, 0.96], ...}" --alloc "model r0.75=$(python bench/search_model.py S.json \\
        --factors 0.75)" [--steps 30 --warmup 2 --anchors 2,10 --size 64] [--device cpu]
    python bench/quality_allocations.py --testbed DIR --out OUT --random-init-small --steps 3 --warmup 0 \\
        --anchors 0 --seeds 0,1 --alloc "a={0: [2, 1]}"      # CPU check of the whole path

Each allocation is a ``layer_densities`` text (factors of the average; unlisted layers and heads keep 1), scaled so
the factors average 1: every allocation computes the uniform density's pairs. "NAME=anchors F0,F1; [LAYER_DENSITIES]"
also sets the density factor of each layer's first, second, ... anchor (SparseConfig.anchor_density_factors); choosing
factors that keep the reuse steps' mean density is the caller's part. Writes OUT/allocations.json
(settings, per-video PSNR / SSIM of every allocation, means, gains over uniform) and OUT/allocations.md (the table).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from quality import sha256, versions, write_json
from quality_engine import EngineAttention
from quality_search import as_layer_densities, ints, sampling_arguments, say, testbed_arguments, testbed_setup
from search_model import start_factors


def parse_allocs(specs: list[str]) -> list[tuple[str, str | None, str]]:
    """['NAME=[anchors F0,F1,...;] LAYER_DENSITIES', ...] -> [(name, layer_densities text or None, anchor density
    factors text or "")]; names unique, not 'uniform'. "anchors 1.5,0.8;" alone keeps every head at the uniform
    density and sets the anchors' factors (SparseConfig.anchor_density_factors)."""
    out = []
    for spec in specs:
        name, sep, text = spec.partition("=")
        name, text, anchors = name.strip(), text.strip(), ""
        if text.startswith("anchors"):
            anchors, _, text = text.removeprefix("anchors").partition(";")
            anchors, text = anchors.strip(), text.strip()
        if not sep or not name or not (text or anchors):
            raise SystemExit(f"--alloc {spec!r}: expected NAME=LAYER_DENSITIES, e.g. 'searched={{0: [0.5, 1]}}', "
                             "or NAME=anchors F0,F1; [LAYER_DENSITIES]")
        if name == "uniform" or name in (n for n, _, _ in out):
            raise SystemExit(f"--alloc {spec!r}: the name {name!r} is taken")
        out.append((name, text or None, anchors))
    return out


def table(doc: dict) -> str:
    """The markdown table of allocations.json: mean / worst PSNR, gain over uniform per video and in the mean."""
    res, seeds = doc["results"], doc["meta"]["seeds"]
    done = len(res["uniform"]["psnr"])
    lines = [f"{doc['meta']['method']} at density {doc['meta']['density']}, {doc['meta']['steps']} steps, warm-up "
             f"{doc['meta']['warmup']}, anchors {doc['meta']['anchors']}, groups / blocks of {doc['meta']['size']}; "
             f"videos (seeds) {seeds[:done]} of {seeds}; device {doc['meta']['device']}.", "",
             "| allocation | PSNR dB mean (worst) | gain over uniform, mean (per video) | SSIM mean |",
             "|---|---|---|---|"]
    base = res["uniform"]["psnr"]
    for name, r in res.items():
        p = r["psnr"]
        if len(p) < done:
            continue
        gains = [a - b for a, b in zip(p, base)]
        g = "–" if name == "uniform" else (f"{sum(gains) / len(gains):+.2f} ("
                                           + ", ".join(f"{x:+.2f}" for x in gains) + ")")
        lines.append(f"| {name} | {sum(p) / len(p):.2f} ({min(p):.2f}) | {g} | {sum(r['ssim']) / len(p):.4f} |")
    return "\n".join(lines) + "\n"


def run(args) -> dict:
    import torch

    clock0 = time.perf_counter()
    seeds, anchors = ints(args.seeds), ints(args.anchors)
    if not seeds:
        raise SystemExit("--seeds: give at least one seed")
    if args.batch < 1:
        raise SystemExit("--batch: at least 1")
    _, layer_density, device, ev, net, base_fields = testbed_setup(args, "allocations base")
    M, cfg = ev.M, net.cfg
    layers, heads = cfg.num_layers, cfg.num_heads
    allocs, anchor_factors = [("uniform", None)], {}
    for name, text, factors_text in parse_allocs(args.alloc):
        if factors_text:
            anchor_factors[name] = layer_density.parse_anchor_factors(factors_text)
        if text is None:
            allocs.append((name, None))
            continue
        factors = start_factors(text, layers, heads, layer_density.parse_layer_densities)
        allocs.append((name, layer_density.layer_densities_text(as_layer_densities(factors, heads))))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    weights = Path(args.testbed) / "weights.safetensors"
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "threads": torch.get_num_threads(), "versions": versions(), "date": time.strftime("%Y-%m-%d %H:%M"),
            "command": "python bench/quality_allocations.py " + " ".join(sys.argv[1:]), "method": args.method,
            "density": args.density, "steps": args.steps, "warmup": args.warmup, "anchors": anchors,
            "size": args.size, "batch": args.batch, "seeds": seeds, "allocations": dict(allocs),
            "anchor_density_factors": {name: list(f) for name, f in anchor_factors.items()},
            "testbed": {"layers": layers, "heads": heads, "tokens": math.prod(cfg.grid),
                        "random_init": bool(args.random_init_small),
                        "weights_sha256": None if args.random_init_small else sha256(weights)}}
    results = {name: {"psnr": [], "ssim": [], "density_sparse": [], "seconds": []} for name, _ in allocs}
    doc = {"meta": meta, "results": results}

    def sample(part, attn):
        noise = ev.make_noise(cfg, part)
        labels = torch.tensor([s % cfg.num_classes for s in part], dtype=torch.long)
        return ev.sample(net, noise, labels, steps=args.steps, shift=args.shift, batch=len(part), attn=attn,
                         device=device)

    for i in range(0, len(seeds), args.batch):
        part = seeds[i:i + args.batch]
        t = time.perf_counter()
        ref = sample(part, M.sdpa_attention)
        say(f"videos {i + 1}-{i + len(part)} of {len(seeds)} (seeds {part}): dense in {time.perf_counter() - t:.0f} s")
        for name, text in allocs:
            config = dict(base_fields)
            if text is not None:
                config["layer_densities"] = text
            if name in anchor_factors:
                config["anchor_density_factors"] = anchor_factors[name]
            attn = EngineAttention(config, args.steps, M.CONTEXT, dense_fn=M.sdpa_attention)
            t = time.perf_counter()
            with attn.run():
                video = sample(part, attn)
            r = results[name]
            r["psnr"] += [round(x, 3) for x in ev.psnr(video, ref)]
            r["ssim"] += [round(x, 4) for x in ev.ssim(video, ref)]
            r["density_sparse"].append(attn.stats["density_sparse"])
            r["seconds"].append(round(time.perf_counter() - t, 1))
            say(f"  {name}: PSNR {sum(r['psnr'][-len(part):]) / len(part):.2f} dB ({r['seconds'][-1]:.0f} s)")
        meta["wall_s"] = round(time.perf_counter() - clock0, 1)
        write_json(out / "allocations.json", doc)
        (out / "allocations.md").write_text(table(doc))
    say(table(doc))
    say(f"wrote {out / 'allocations.json'} and {out / 'allocations.md'} ({meta['wall_s']:.0f} s)")
    return doc


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    testbed_arguments(ap)
    ap.add_argument("--alloc", action="append", default=[], help="NAME=LAYER_DENSITIES or NAME=anchors F0,F1,...; "
                    "[LAYER_DENSITIES] (repeat for more)")
    ap.add_argument("--seeds", default="8,9,10,11", help="videos (class = seed %% 8); default: 4 of the search's "
                    "check videos")
    ap.add_argument("--batch", type=int, default=1, help="videos per sampling call (the JSON is rewritten after "
                    "each call); 1 on a CPU, 8 on a GPU")
    sampling_arguments(ap)
    run(ap.parse_args(argv))


if __name__ == "__main__":
    main()
