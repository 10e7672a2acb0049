"""Q/K/V recordings: what self-attention calls receive (after norm and RoPE), saved for calibration.

File: safetensors, one fp16 tensor (H, N, D) per key ``layer{LL}.step{SS}.{q|k|v}`` (layer in model order, run
step; the quality testbed's ``evaluate.py --dump`` writes the same keys), one batch row. Metadata (strings,
JSON-encoded): ``format``, ``layers``, ``steps``, ``total_steps``, ``layouts`` ({layer: TokenLayout fields}),
``tokens``, ``heads``, ``head_dim``, ``dtype``, ``family``, ``model``, ``model_signature``, ``batch_row``.
A testbed dump carries ``grid`` instead of ``layouts``.

Writing never fills the disk: the size is checked against the cap while recording (before anything is copied)
and against the free space before writing, and the file appears under its name only once complete. Reading
validates the whole file up front; every error is a ValueError naming the file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .cache import host_memory
from .context import TokenLayout

FORMAT = "comfyui-sparse-attention/qkv-recording/1"
KEY = re.compile(r"layer(\d+)\.step(\d+)\.(q|k|v)")
DISK_RESERVE = 1 << 30  # bytes a recording always leaves free on its disk
HOST_RESERVE = 2 << 30  # bytes of host memory a recording leaves available while it holds its tensors
HEADER_BYTES = 1 << 16  # allowance for the safetensors header in size estimates
FLOAT_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}


class RecordingTooLarge(ValueError):
    """The recording would exceed its size cap."""


def tensor_key(layer: int, step: int, name: str) -> str:
    return f"layer{layer:02d}.step{step:02d}.{name}"


@dataclass
class RecordingBuffer:
    """Q/K/V of one batch row at chosen (layer, step) pairs, held in CPU memory as fp16 until ``save``.

    max_bytes: the cap on the tensors' bytes; ``add`` refuses (RecordingTooLarge) before copying anything that
    would pass it, or that would leave the host less than HOST_RESERVE of available memory."""

    max_bytes: int
    tensors: dict = field(default_factory=dict)
    layouts: dict = field(default_factory=dict)
    nbytes: int = 0

    def has(self, layer: int, step: int) -> bool:
        return tensor_key(layer, step, "q") in self.tensors

    def entry_bytes(self, q: torch.Tensor) -> int:
        """Bytes one (layer, step) entry of q/k/v shaped like ``q`` (H, N, D) takes in fp16."""
        return 3 * q.numel() * 2

    def add(self, layer: int, step: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            layout: TokenLayout) -> None:
        """Record q, k, v: (H, N, D) of one batch row, any float dtype and device. Raises RecordingTooLarge when
        the entry would pass ``max_bytes`` and ValueError when a value does not fit fp16."""
        if not (q.shape == k.shape == v.shape) or q.dim() != 3:
            raise ValueError(f"recording: q, k, v must share one (H, N, D) shape, got {tuple(q.shape)}, "
                             f"{tuple(k.shape)}, {tuple(v.shape)}")
        need = self.entry_bytes(q)
        if self.nbytes + need > self.max_bytes:
            raise RecordingTooLarge(
                f"recording layer {layer} at step {step} needs {need / 1e6:.4g} MB more, past the cap of "
                f"{self.max_bytes / 1e6:.4g} MB ({self.nbytes / 1e6:.4g} MB recorded): record fewer layers or steps, "
                "or raise max_mb")
        mem = host_memory()
        if mem is not None and mem[0] - need < HOST_RESERVE:
            raise RecordingTooLarge(
                f"recording layer {layer} at step {step} needs {need / 1e6:.4g} MB more but the host has "
                f"{mem[0] / 1e6:.0f} MB available (a recording leaves {HOST_RESERVE / 1e6:.0f} MB): record fewer "
                "layers or steps")
        parts = {}
        for name, t in (("q", q), ("k", k), ("v", v)):
            h = t.detach().to(torch.float16)
            if not bool(torch.isfinite(h).all()):
                raise ValueError(f"recording: layer {layer} step {step} {name} has values outside the fp16 range")
            parts[tensor_key(layer, step, name)] = h.to("cpu").contiguous()
        self.tensors.update(parts)
        self.layouts[layer] = layout
        self.nbytes += need

    def save(self, path: str | Path, metadata: dict) -> Path:
        """Write the recording to ``path`` (metadata: extra fields, JSON-encoded here); returns the path."""
        if not self.tensors:
            raise ValueError(f"{Path(path).name}: nothing was recorded (no self-attention call matched the layers "
                             "and steps asked for)")
        layers = sorted({int(KEY.fullmatch(k).group(1)) for k in self.tensors})
        steps = sorted({int(KEY.fullmatch(k).group(2)) for k in self.tensors})
        first = next(iter(self.tensors.values()))
        meta = {"format": FORMAT, "layers": layers, "steps": steps, "heads": first.shape[0],
                "head_dim": first.shape[2], "dtype": "float16",
                "tokens": {str(layer): self.tensors[tensor_key(layer, steps[0], "q")].shape[1]
                           for layer in layers if tensor_key(layer, steps[0], "q") in self.tensors},
                "layouts": {str(layer): _layout_dict(self.layouts[layer]) for layer in layers}}
        meta.update(metadata)
        return save_recording(path, self.tensors, meta, self.max_bytes)


def _layout_dict(layout: TokenLayout) -> dict:
    d = asdict(layout)
    d["grid"] = list(layout.grid) if layout.grid is not None else None
    return d


def save_recording(path: str | Path, tensors: dict, metadata: dict, max_bytes: int,
                   reserve: int = DISK_RESERVE) -> Path:
    """Write ``tensors`` (name -> CPU tensor) with ``metadata`` (values JSON-encoded unless strings) as safetensors.

    Refuses (ValueError naming the file) before writing when the tensors pass ``max_bytes`` or the disk would keep
    less than ``reserve`` bytes free; writes to a temporary name and renames, so an interrupted write never
    leaves a truncated file under ``path``."""
    from safetensors.torch import save_file

    path = Path(path)
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    if size > max_bytes:
        raise RecordingTooLarge(f"{path.name}: {size / 1e6:.1f} MB of tensors, past the cap of "
                                f"{max_bytes / 1e6:.0f} MB; nothing written")
    path.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(path.parent).free
    if size + HEADER_BYTES + reserve > free:
        raise ValueError(f"{path.name}: needs {size / 1e6:.0f} MB but the disk of {path.parent} has "
                         f"{free / 1e6:.0f} MB free (a recording leaves {reserve / 1e6:.0f} MB); nothing written")
    meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()}
    tmp = path.with_name(path.name + ".partial")
    try:
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


@dataclass
class Recording:
    """A validated recording file. layers / steps: sorted; tokens: {layer: N}; layouts: {layer: TokenLayout}."""

    path: Path
    layers: tuple[int, ...]
    steps: tuple[int, ...]
    heads: int
    head_dim: int
    tokens: dict
    layouts: dict
    meta: dict
    dtypes: dict

    @property
    def family(self) -> str:
        return str(self.meta.get("family", "testbed" if "grid" in self.meta else "unknown"))

    @property
    def total_steps(self) -> int | None:
        v = _json(self.meta.get("total_steps", self.meta.get("sampler_steps")), self.path, "total_steps")
        return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    def qkv(self, layer: int, step: int, device="cpu", dtype=None) -> tuple[torch.Tensor, ...]:
        """q, k, v of ``layer`` at ``step`` as (1, H, N, D) on ``device`` (in ``dtype``, default the file's)."""
        from safetensors import safe_open

        if layer not in self.layers or step not in self.steps:
            raise ValueError(f"{self.path.name}: no layer {layer} at step {step} (layers {list(self.layers)}, "
                             f"steps {list(self.steps)})")
        out = []
        try:
            with safe_open(str(self.path), framework="pt") as f:
                for name in ("q", "k", "v"):
                    t = f.get_tensor(tensor_key(layer, step, name))
                    out.append(t.to(device=device, dtype=dtype or t.dtype).unsqueeze(0))
        except Exception as exc:  # noqa: BLE001 - changed or unreadable since it was validated
            raise ValueError(f"{self.path.name}: cannot read layer {layer} step {step} ({exc})") from None
        return tuple(out)


def load_recording(path: str | Path) -> Recording:
    """Open and validate a recording: every (layer, step) has q, k, v of one (H, N, D) shape, the same H and D in
    every layer, the layout matches the token count, metadata agrees with the tensors. ValueError naming the file
    and the problem otherwise (not a file, not safetensors, truncated, not a recording, inconsistent)."""
    from safetensors import safe_open

    path = Path(path)
    name = path.name
    if not path.is_file():
        raise ValueError(f"{path}: no such recording file")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            keys = list(f.keys())
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in keys}
            dtypes = {k: f.get_slice(k).get_dtype() for k in keys}
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types (truncated, garbage, ...)
        raise ValueError(f"{name}: not a readable safetensors file ({str(exc).splitlines()[0]})") from None
    if meta.get("format", FORMAT) != FORMAT:
        raise ValueError(f"{name}: unknown recording format {meta['format']!r} (this version reads {FORMAT})")
    entries: dict[tuple[int, int], set] = {}
    stray = []
    for k in keys:
        m = KEY.fullmatch(k)
        if m is None:
            stray.append(k)
            continue
        entries.setdefault((int(m.group(1)), int(m.group(2))), set()).add(m.group(3))
    if not entries:
        example = f" (it holds e.g. {keys[0]!r})" if keys else " (it holds no tensors)"
        raise ValueError(f"{name}: not a q/k/v recording: no 'layerLL.stepSS.q' tensors{example}")
    if stray:
        raise ValueError(f"{name}: unexpected tensors {stray[:3]} in a q/k/v recording")
    layers = tuple(sorted({lay for lay, _ in entries}))
    steps = tuple(sorted({s for _, s in entries}))
    for layer in layers:
        for step in steps:
            have = entries.get((layer, step), set())
            if have != {"q", "k", "v"}:
                missing = sorted({"q", "k", "v"} - have)
                raise ValueError(f"{name}: layer {layer} step {step} lacks {', '.join(missing)} (every recorded "
                                 "layer needs q, k and v at every recorded step)")
    hd = None
    tokens: dict[int, int] = {}
    for layer in layers:
        for step in steps:
            shp = {shapes[tensor_key(layer, step, c)] for c in "qkv"}
            if len(shp) != 1 or len(next(iter(shp))) != 3:
                raise ValueError(f"{name}: layer {layer} step {step}: q, k, v shapes {sorted(shp)} are not one "
                                 "(H, N, D) shape")
            h, n, d = next(iter(shp))
            if hd is None:
                hd = (h, d)
            if (h, d) != hd:
                raise ValueError(f"{name}: layer {layer} has {h} heads of {d}, layer {layers[0]} {hd[0]} of {hd[1]}")
            if tokens.setdefault(layer, n) != n:
                raise ValueError(f"{name}: layer {layer} has {tokens[layer]} tokens at step {steps[0]} but {n} at "
                                 f"step {step}")
            for c in "qkv":
                if dtypes[tensor_key(layer, step, c)] not in FLOAT_DTYPES:
                    raise ValueError(f"{name}: {tensor_key(layer, step, c)} is {dtypes[tensor_key(layer, step, c)]}, "
                                     "not a float tensor")
    for field_name, found in (("layers", layers), ("steps", steps)):
        listed = _json(meta.get(field_name), path, field_name)
        if listed is not None and sorted(int(x) for x in listed) != list(found):
            raise ValueError(f"{name}: metadata lists {field_name} {sorted(listed)} but the file holds {list(found)}")
    layouts = _layouts(meta, layers, tokens, path)
    return Recording(path, layers, steps, hd[0], hd[1], tokens, layouts, meta,
                     {k: FLOAT_DTYPES[v] for k, v in dtypes.items()})


def _json(value, path: Path, field_name: str):
    if value is None:
        return None
    try:
        return json.loads(value)
    except (TypeError, ValueError):
        raise ValueError(f"{path.name}: metadata {field_name} is not valid JSON: {str(value)[:80]!r}") from None


def _layouts(meta: dict, layers, tokens: dict, path: Path) -> dict:
    """{layer: TokenLayout} from ``layouts`` (a pack recording) or ``grid`` (a testbed dump); checked against the
    token counts."""
    name = path.name
    raw = _json(meta.get("layouts"), path, "layouts")
    grid = _json(meta.get("grid"), path, "grid")
    out = {}
    for layer in layers:
        n = tokens[layer]
        if raw is not None:
            d = raw.get(str(layer)) if isinstance(raw, dict) else None
            if not isinstance(d, dict):
                raise ValueError(f"{name}: metadata layouts has no entry for layer {layer}")
            try:
                lay = TokenLayout(text_len=int(d.get("text_len", 0)), text_first=bool(d.get("text_first", True)),
                                  grid=tuple(int(x) for x in d["grid"]) if d.get("grid") else None,
                                  extra_len=int(d.get("extra_len", 0)))
            except (TypeError, ValueError, KeyError):
                raise ValueError(f"{name}: metadata layouts entry of layer {layer} cannot be read: {d!r}") from None
        elif grid is not None:
            lay = TokenLayout(grid=tuple(int(x) for x in grid))
        else:
            lay = TokenLayout()
        misfit = lay.misfit(n)
        if misfit is not None:
            raise ValueError(f"{name}: layer {layer} has {n} tokens but its layout (text {lay.text_len}, grid "
                             f"{lay.grid}, extra {lay.extra_len}) does not fit ({misfit}): the tensors come from "
                             "another shape than the metadata says")
        out[layer] = lay
    return out
