"""Calibration nodes (V3 schema): Sparse Attention Record (save the q/k/v of a dense run) and Sparse Attention
Calibrate (per-layer / per-head densities from such a recording, as a preset and as the Sparse Attention node's
``layer_densities`` text). docs/calibration.md explains the workflow.

Node ids are permanent string literals (workflows and ComfyUI Manager refer to them).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch
from comfy_api.latest import io

from ..engine import AnchorSchedule, SparseConfig, parse_layers
from ..engine import calibrate as cal
from ..engine.layer_density import layer_densities_text
from ..engine.policy import method_names
from ..engine.presets import list_presets, load_preset
from ..engine.recording import load_recording
from .record import check_writable, model_signature, save_failure, unwritable
from .record import install as install_recorder

log = logging.getLogger(__name__)
CATEGORY = "model_patches/sparse_attention"
DEFAULT_STEPS = "10%, 25%, 50%, 75%"
NO_BASE = "none (engine defaults)"
DEFAULT_BASE = "balanced"  # the presets' schedule: a calibrated preset without one would anchor once per run
_reserved: set[str] = set()  # recording paths handed out in this process (files appear only after sampling)
_lock = threading.Lock()


def output_path(prefix: str, ext: str) -> Path:
    """A new file name in ComfyUI's output folder: ``<prefix>_<counter>_.<ext>`` (the counter as SaveImage's)."""
    import folder_paths

    out_dir = folder_paths.get_output_directory()
    folder, name, counter, _, _ = folder_paths.get_save_image_path(prefix, out_dir)
    with _lock:
        while True:
            path = Path(folder) / f"{name}_{counter:05}_.{ext}"
            if str(path) not in _reserved and not path.exists():
                _reserved.add(str(path))
                return path
            counter += 1


def _layers(text: str):
    text = (text or "").strip()
    if text in ("", "all"):
        return None
    try:
        return parse_layers(text)
    except ValueError:
        raise ValueError(f"Sparse Attention Record: layers: cannot read {text!r} (e.g. '0-7' or '0,5,10'; "
                         "'' = all)") from None


def _steps(text: str) -> AnchorSchedule:
    try:
        sched = AnchorSchedule.parse(text or "")
    except ValueError as exc:
        raise ValueError(f"Sparse Attention Record: steps: {str(exc).split(': ', 1)[-1]}") from None
    if sched == AnchorSchedule():
        raise ValueError("Sparse Attention Record: steps: name at least one step (e.g. '3, 10' or '25%, 50%')")
    return sched


class SparseAttentionRecord(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SparseAttn_Record",
            display_name="Sparse Attention Record",
            category=CATEGORY,
            description="Records the q/k/v that the model's self-attention receives at chosen layers and steps of "
                        "the next sampling run (one video, fp16) into a .safetensors file in the output folder, "
                        "for Sparse Attention Calibrate. Use it on a model without Sparse Attention.",
            inputs=[
                io.Model.Input("model", tooltip="The diffusion model (without Sparse Attention)."),
                io.String.Input("layers", default="", tooltip="Blocks to record in model order, e.g. '0-9' or "
                                "'0,5,10'; '' records every block."),
                io.String.Input("steps", default=DEFAULT_STEPS,
                                tooltip="Denoising steps to record: steps '3, 10, 20' or shares of the run "
                                        "'10%, 50%' or 'every 10'. Two or more let the calibration measure reuse "
                                        "steps (selection at one recorded step, used at the next)."),
                io.Float.Input("max_mb", default=4096.0, min=1.0, max=10_000_000.0, step=64.0,
                               tooltip="Size cap of the recording in MB (checked before recording anything: a plan "
                                       "that needs more stops sampling with the numbers). One layer at one step "
                                       "takes 3 x heads x tokens x head_dim x 2 bytes."),
                io.String.Input("filename_prefix", default="sparse_attention/qkv",
                                tooltip="File name in the output folder (a counter is added)."),
            ],
            outputs=[io.Model.Output(tooltip="The model with the recorder; connect it to the sampler."),
                     io.String.Output(display_name="recording",
                                      tooltip="Path of the file written when sampling ends (for Calibrate).")],
        )

    @classmethod
    def validate_inputs(cls, layers="", steps=DEFAULT_STEPS):  # ComfyUI checks the inputs not named here
        try:
            _layers(layers)
            _steps(steps)
        except ValueError as exc:
            return str(exc)
        return True

    @classmethod
    def execute(cls, model, layers, steps, max_mb, filename_prefix) -> io.NodeOutput:
        import folder_paths

        prefix = filename_prefix or "sparse_attention/qkv"
        try:
            path = output_path(prefix, "safetensors")
        except OSError as exc:  # the folder cannot be listed or created (ComfyUI's get_save_image_path)
            folder = Path(folder_paths.get_output_directory()) / os.path.dirname(os.path.normpath(prefix))
            raise unwritable(folder, exc) from None
        check_writable(path.parent)  # before any sampling is spent on a file that cannot be saved
        patched, _ = install_recorder(model, _layers(layers), _steps(steps), int(max_mb * 1e6), path)
        return io.NodeOutput(patched, str(path))


def _sparse_methods() -> list[str]:
    return [m for m in method_names() if m != "dense"]


class SparseAttentionCalibrate(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SparseAttn_Calibrate",
            display_name="Sparse Attention Calibrate",
            category=CATEGORY,
            description="Measures, on a q/k/v recording, each layer's and head's attention error against density "
                        "and gives each the density that minimises the total error at the average density you ask "
                        "for. Outputs the layer_densities text for the Sparse Attention node, a preset file, a "
                        "report and a plot.",
            inputs=[
                io.String.Input("recording", default="", tooltip="The recording file (the Record node's "
                                "'recording' output, or a path; relative paths are in the output folder)."),
                io.Combo.Input("method", options=_sparse_methods(), default="block_topk",
                               tooltip="The method the densities are for (use the same on the Sparse Attention "
                                       "node; block_topk is the presets' method)."),
                io.Float.Input("density", default=0.08, min=0.01, max=1.0, step=0.01,
                               tooltip="The average density to distribute over the layers and heads."),
                io.Combo.Input("block_size", options=["128", "64"], default="128",
                               tooltip="Block size (block methods) and query group size (mc_sparse), as on the "
                                       "Sparse Attention node."),
                io.Boolean.Input("residual_caching", default=True,
                                 tooltip="Minimise the error of reuse steps with the anchor's residual (on), or "
                                         "without it (off), as the Sparse Attention node will run."),
                io.String.Input("anchor_steps", default="",
                                tooltip="Recorded steps where selections are made; each later recorded step is "
                                        "measured with the anchor before it. '' = consecutive recorded steps."),
                io.String.Input("filename_prefix", default="sparse_attention/calibrated",
                                tooltip="Preset, report and plot names in the output folder."),
                io.Combo.Input("scope", options=list(cal.SCOPES), default="model",
                               tooltip="model: density moves between layers and between heads; layer: every layer "
                                       "keeps the pairs the uniform density gives it and only its heads trade "
                                       "density (docs/calibration.md)."),
                io.Latent.Input("samples", optional=True, tooltip="Connect the recording run's sampler output, so "
                                "calibration runs after the recording is written."),
                io.Model.Input("model", optional=True, tooltip="Optional: the model the densities are for; a "
                               "recording of another model is refused."),
                io.Combo.Input("base_preset", options=[NO_BASE] + list_presets(), default=DEFAULT_BASE,
                               optional=True,
                               tooltip="The preset whose other settings (warm-up, anchor steps, dense layers, "
                                       "residual weighting, ...) the written preset keeps and the measurement "
                                       "follows; its warm-up and dense layers are left out of the allocation. "
                                       f"'{NO_BASE}': the engine's defaults (one anchor for the whole run)."),
            ],
            outputs=[io.String.Output(display_name="layer_densities",
                                      tooltip="For the Sparse Attention node's layer_densities input."),
                     io.String.Output(display_name="preset", tooltip="Path of the preset YAML written."),
                     io.String.Output(display_name="report", tooltip="The calibration as text (markdown)."),
                     io.Image.Output(display_name="plot", tooltip="Error against density per layer (or the "
                                     "densities per layer and head when matplotlib is not installed).")],
            is_output_node=True,
        )

    @classmethod
    def validate_inputs(cls, anchor_steps=""):  # before the recording run, not after it; ComfyUI checks the rest
        try:
            _anchor_steps(anchor_steps)
        except ValueError as exc:
            return str(exc)
        return True

    @classmethod
    def fingerprint_inputs(cls, recording="", **kwargs):
        """The recording file's modification time and size, and its status-change time (a copy that keeps the old
        modification time), or None when missing or linked: a file replaced at the same path calibrates again
        instead of reusing the cached output. ComfyUI's cache key already holds the other inputs (and, for a linked
        recording, the Record node's and the sampler's)."""
        path = _recording_path(recording)
        if path is None:
            return None
        try:
            st = path.stat()
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ctime_ns)

    @classmethod
    def execute(cls, recording, method, density, block_size, residual_caching, anchor_steps, filename_prefix,
                samples=None, model=None, scope="model", base_preset=DEFAULT_BASE) -> io.NodeOutput:
        import comfy.model_management
        import comfy.utils

        path = _recording_path(recording)
        if path is None:
            raise ValueError("Sparse Attention Calibrate: recording: give the recording file (the Record node's "
                             "output)")
        rec = _load(path)
        if model is not None:
            _check_model(rec, model)
        size = int(block_size)
        base = _base_config(base_preset).replace(method=method, density=density, block_q=size, block_k=size,
                                                 group_size=size, residual=bool(residual_caching),
                                                 layer_densities=())
        anchors = _anchor_steps(anchor_steps)
        bar = comfy.utils.ProgressBar(1)
        device = comfy.model_management.get_torch_device()
        curves, allocs, pairs, seconds = cal.calibrate(
            rec, [method], [density], base=base, anchors=anchors, device=device, scope=scope,
            progress=lambda done, total: bar.update_absolute(done, total))
        alloc = allocs[0]
        preset = output_path(filename_prefix or "sparse_attention/calibrated", "yaml")
        command = (f"Sparse Attention Calibrate ({method}, density {density:g}, block size {size}, scope {scope}, "
                   f"base preset {base_preset})")
        cal.write_preset(preset, cal.preset_text(alloc, rec, cal.plain_fields(base), command=command))
        png = preset.with_suffix(".png")
        drew = cal.plot(curves, allocs, png)
        report = cal.report_markdown(rec, curves, allocs, pairs=pairs,
                                     weights=cal.pair_weights(pairs, anchors, rec.total_steps),
                                     plot_name=png.name if drew else None, command=command, seconds=seconds)
        preset.with_suffix(".md").write_text(report, encoding="utf-8")
        image = _image(png) if drew else _bars(alloc)
        log.info("sparse attention: calibrated %s at density %g on %s -> %s", method, density, rec.path.name, preset)
        return io.NodeOutput(layer_densities_text(alloc.factors), str(preset), report, image)


def _recording_path(text) -> Path | None:
    """The Calibrate node's recording input as a path (relative: in the output folder); None when empty."""
    if not isinstance(text, str) or not text.strip():
        return None
    path = Path(text.strip())
    if not path.is_absolute():
        import folder_paths
        path = Path(folder_paths.get_output_directory()) / path
    return path


def _load(path: Path):
    """load_recording, with the Record node's reason when its run wrote no file, and errors naming this node."""
    failed = save_failure(path)
    if failed is not None:
        raise ValueError(f"Sparse Attention Calibrate: recording {path} was not written: the Sparse Attention Record "
                         f"node's last run failed to save it ({failed}). Fix that and queue the recording run again.")
    if not path.exists() and os.path.abspath(path) in {os.path.abspath(p) for p in _reserved}:
        raise ValueError(f"Sparse Attention Calibrate: recording {path} does not exist (yet): the Record node writes "
                         "it when its sampling run ends; connect that sampler's output to this node's 'samples' "
                         "input so calibration runs after it")
    try:
        return load_recording(path)
    except ValueError as exc:
        raise ValueError(f"Sparse Attention Calibrate: recording: {exc}") from None


def _anchor_steps(text) -> list[int] | None:
    """The Calibrate node's anchor_steps: recorded step numbers ('3, 10'), or None for '' (consecutive steps)."""
    if not isinstance(text, str) or not text.strip():
        return None
    try:
        return [int(x) for x in text.replace(";", ",").split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"Sparse Attention Calibrate: anchor_steps: cannot read {text[:60]!r} (recorded step "
                         "numbers, e.g. '3, 10'; not shares of the run)") from None


def _base_config(name: str) -> SparseConfig:
    """The Calibrate node's base settings: preset ``name``'s, or the engine's defaults for NO_BASE."""
    if name == NO_BASE:
        return SparseConfig()
    try:
        return load_preset(name)
    except ValueError as exc:
        raise ValueError(f"Sparse Attention Calibrate: base_preset: {exc}") from None


def _check_model(rec, model) -> None:
    """Refuse a recording whose metadata names another model than the connected one."""
    dm = model.get_model_object("diffusion_model")
    want = rec.meta.get("model_signature")
    have = model_signature(dm)
    if want is not None and want != have:
        raise ValueError(f"{rec.path.name}: recorded from another model ({rec.meta.get('model', '?')}, signature "
                         f"{want}) than the connected one ({type(dm).__name__}, signature {have})")


def _image(png: Path) -> torch.Tensor:
    """A PNG as a ComfyUI IMAGE: float (1, H, W, 3) in [0, 1]."""
    import numpy as np
    from PIL import Image

    with Image.open(png) as im:
        arr = np.asarray(im.convert("RGB"), dtype=np.float32) / 255.0
    return torch.from_numpy(arr.copy()).unsqueeze(0)


def _bars(alloc, height: int = 256) -> torch.Tensor:
    """Allocated density per (layer, head) as bars (layers left to right, heads side by side), 1.0 = full height."""
    keys = sorted(alloc.densities)
    width = max(256, 4 * len(keys))
    img = torch.full((height, width, 3), 0.08)
    step = width / max(1, len(keys))
    top = max(alloc.densities.values())
    for j, key in enumerate(keys):
        h = int(round(alloc.densities[key] / top * (height - 8)))
        color = torch.tensor([0.3, 0.6, 1.0]) if key[0] % 2 == 0 else torch.tensor([1.0, 0.6, 0.3])
        x0 = int(j * step)
        img[height - h:, x0:max(x0 + 1, int((j + 1) * step) - 1)] = color
    return img.unsqueeze(0)


NODES = [SparseAttentionRecord, SparseAttentionCalibrate]
