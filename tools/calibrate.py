"""Calibrate per-layer and per-head densities on a q/k/v recording (the Sparse Attention Record node's file, or
the quality testbed's ``evaluate.py --dump``), and write a preset.

    python tools/calibrate.py RECORDING [--methods block_topk,mc_sparse] [--density 0.08] [--out preset.yaml]
        [--report calibration.md] [--base PRESET.yaml | --base wan21_t2v_1.3b] [--anchors 3,10]
        [--grid 0.02,0.05,0.1,0.2,0.4] [--objective reuse|reuse_plain|fresh] [--device cuda]

For each recorded layer and head and each method it measures the attention-output error against dense attention
at a grid of densities with the engine's own selection and kernels (docs/method.md, "Per-layer and per-head
density"), allocates the densities that minimise the summed squared error at the requested average density, and
writes a preset YAML with ``layer_densities`` (--out; with several methods, put ``{method}`` in the name), a
markdown report (--report, default beside the preset or the recording) and a plot (when matplotlib imports).
--base takes the other settings (block / group size, residual, schedule) from a preset, whose warm-up and dense
layers are left out of the allocation; --anchors pairs each later recorded step with the anchor before it (default:
consecutive recorded steps).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_pack():
    """The pack (the repository imported as the package ``comfyui_sparse_attention``, as ComfyUI does), through
    bench/_pack.py's loader."""
    sys.path.insert(0, str(ROOT / "bench"))  # a script beside the pack, not pack code
    from _pack import load
    return load("engine.calibrate"), load("engine.recording"), load("engine.presets"), load("engine.config")


def _floats(text: str, name: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--{name}: expected numbers separated by commas, got {text!r}") from None


def _layer_weights(text: str) -> dict:
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        data = None
    if not isinstance(data, dict) or not all(isinstance(k, int) and isinstance(v, (int, float)) and v >= 0
                                             for k, v in data.items()):
        raise ValueError(f"--layer-weights: expected a mapping of layer -> weight >= 0 such as '{{0: 1.5, 3: 0.7}}', "
                         f"got {text!r}")
    return {int(k): float(v) for k, v in data.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recording", help="the q/k/v recording (.safetensors)")
    ap.add_argument("--methods", default="block_topk",
                    help="comma list of methods to measure (default block_topk, the presets' method)")
    ap.add_argument("--density", default="0.08", help="the average density(ies) to allocate, comma list "
                    "(default 0.08, the presets' density)")
    ap.add_argument("--out", default=None, help="preset YAML to write ({method} and {density} are filled in)")
    ap.add_argument("--report", default=None, help="markdown report (default: beside --out, else the recording)")
    ap.add_argument("--base", default=None, help="a preset (file or bundled name) for the other settings")
    ap.add_argument("--grid", default=None, help="densities to measure, comma list (the --density values are added)")
    ap.add_argument("--anchors", default=None, help="recorded steps where selections are made, comma list")
    ap.add_argument("--objective", default=None, help="reuse | reuse_plain | fresh (default from the residual)")
    ap.add_argument("--layer-weights", default=None,
                    help="{layer: weight} (YAML) multiplying each layer's error, e.g. measured sensitivities of the "
                         "output to each layer's attention error (bench/quality_calibration.py measures them)")
    ap.add_argument("--scope", default="model", choices=("model", "layer"),
                    help="model: density moves between layers and heads; layer: each layer keeps the uniform "
                         "density's pairs and only its heads share them (docs/calibration.md)")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    args = ap.parse_args(argv)

    import torch

    cal, recording, presets, config = load_pack()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    targets = _floats(args.density, "density")
    try:
        rec = recording.load_recording(args.recording)
        if args.base is None:
            base = config.SparseConfig()
        elif args.base.endswith((".yaml", ".yml")):
            base = config.SparseConfig.from_yaml(args.base)
        else:
            base = presets.load_preset(args.base)
        for many, key in ((len(methods) > 1, "{method}"), (len(targets) > 1, "{density}")):
            if args.out and many and key not in args.out:
                raise ValueError(f"--out: with several {key[1:-1]}s, put {key} in the file name")
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        anchors = [int(x) for x in _floats(args.anchors, "anchors")] if args.anchors else None
        grid = _floats(args.grid, "grid") if args.grid else None
        layer_weights = _layer_weights(args.layer_weights) if args.layer_weights else None

        def progress(done, total):
            print(f"\r[calibrate] {done}/{total} (layer, method, density) measured", end="", flush=True)

        curves, allocs, pairs, seconds = cal.calibrate(rec, methods, targets, base=base, grid=grid, anchors=anchors,
                                                       objective=args.objective, layer_weights=layer_weights,
                                                       device=device, progress=progress, scope=args.scope)
        print()
    except ValueError as exc:
        print(f"calibrate: {exc}", file=sys.stderr)
        return 2
    command = "python tools/calibrate.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    written = []
    if args.out:
        for a in allocs:
            path = Path(args.out.replace("{method}", a.method).replace("{density}", format(a.target, "g")))
            cal.write_preset(path, cal.preset_text(a, rec, cal.plain_fields(base), command=command))
            written.append(path)
    report = Path(args.report) if args.report else (
        written[0].with_suffix(".md") if written else Path(rec.path).with_suffix(".calibration.md"))
    png = report.with_suffix(".png")
    drew = cal.plot(curves, allocs, png)
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(cal.report_markdown(rec, curves, allocs, pairs=pairs,
                                          weights=cal.pair_weights(pairs, anchors, rec.total_steps),
                                          plot_name=png.name if drew else None, command=command, seconds=seconds),
                      encoding="utf-8")
    for a in allocs:
        print(f"{a.method} at {a.target:g}: predicted squared error {a.cost_uniform:.5f} uniform -> "
              f"{a.cost_calibrated:.5f} calibrated; layer_densities: {cal.layer_densities_text(a.factors)}")
    for path in written:
        print(f"wrote {path}")
    print(f"wrote {report}" + (f" and {png}" if drew else " (no plot: matplotlib is not importable)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
