"""Recording q/k/v: an attention override that saves what self-attention calls receive (after norm and RoPE) for
chosen layers and steps of one sampling run, then runs the dense attention it would have run anyway.

Layers and steps are counted exactly as the sparse patch counts them (nodes/forward.py: layers in model order,
steps in the whole run), so a calibration from the recording addresses the layers the engine sees. Only the first
conditional batch row is kept, in fp16; the size cap is checked before anything is copied (and, after the first
forward, against the whole plan); the requested layers are checked against the model's after the first forward
too. The file is written after sampling (engine/recording.py); a failure to write it is logged as an error and
kept (``save_failure``) for the Calibrate node to report, and the sampler's result is returned all the same: a
finished run is never lost to the recording.

The recording is meant for a dense run: recording under a Sparse Attention patch would record q/k/v that sparse
attention already changed, and the two overrides cannot both come first, so that combination is refused.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

from ..engine import AnchorSchedule
from ..engine.recording import RecordingBuffer, RecordingTooLarge
from .call import carries_mask, translate
from .families import family_of
from .forward import Forward, StepCounter
from .patch import OVERRIDE, SparseAttentionPatch, find_patch, route_module_attention
from .run_clock import clock_for

log = logging.getLogger(__name__)

KEY = "sparse_attention_record"
INFO_KEY = "sparse_attention_record_forward"
REFUSE_WITH_SPARSE = ("Sparse Attention Record: this model also has a Sparse Attention patch; record a dense run "
                      "(connect the Record node to a model without Sparse Attention, then calibrate)")
_failures: dict[str, str] = {}  # recording path -> why its last run wrote nothing (this process)


def _key(path) -> str:
    return os.path.abspath(os.fspath(path))


def save_failure(path) -> str | None:
    """Why the last sampling run of the Record node with this recording path wrote no file (None: it wrote it,
    or no run failed to)."""
    return _failures.get(_key(path))


def check_writable(folder: Path) -> None:
    """Create ``folder`` if needed and create and delete a probe file in it; ValueError naming the folder
    otherwise (before any sampling is spent on a recording that cannot be saved)."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".sparse_attention_probe_", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise unwritable(folder, exc) from None


def unwritable(folder, exc: OSError) -> ValueError:
    """The Record node's error for an output folder it cannot write into."""
    reason = exc.strerror or str(exc)
    return ValueError(f"Sparse Attention Record: cannot write the recording into the folder {folder} ({reason}): "
                      "make it writable or choose another filename_prefix (a folder in the output folder)")


def _ranges(numbers) -> str:
    """'0-3, 7' for [0, 1, 2, 3, 7]."""
    out, nums = [], sorted(numbers)
    i = 0
    while i < len(nums):
        j = i
        while j + 1 < len(nums) and nums[j + 1] == nums[j] + 1:
            j += 1
        out.append(str(nums[i]) if i == j else f"{nums[i]}-{nums[j]}")
        i = j + 1
    return ", ".join(out)


def model_signature(diffusion_model) -> str:
    """A short hash of the diffusion model's class and parameter names and shapes (tells models apart without
    reading weights)."""
    h = hashlib.sha256(type(diffusion_model).__name__.encode())
    for name, p in diffusion_model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)};".encode())
    return h.hexdigest()[:16]


def cond_row(transformer_options: dict, batch: int) -> int | None:
    """The first batch row of the conditional chunk (ComfyUI's ``cond_or_uncond``: 0 = cond), or None when this
    forward holds no conditional rows. Without the list: row 0."""
    order = list(transformer_options.get("cond_or_uncond") or ())
    if not order:
        return 0
    if 0 not in order:
        return None
    per = batch // len(order)
    return order.index(0) * per if per else None


class RecordPatch:
    """The override state of one Record node: what to record, the buffer of the current run, the written file.

    layers: layer numbers to record (None: all); steps: run steps as an AnchorSchedule (steps, shares of the run,
    'every N'); path: the file written after each sampling run."""

    def __init__(self, layers, steps: AnchorSchedule, max_bytes: int, path: Path, family, layer_offsets: dict,
                 previous=None, model_info: dict | None = None):
        self.layers = None if layers is None else frozenset(layers)
        self.steps = steps
        self.max_bytes = int(max_bytes)
        self.path = Path(path)
        self.family = family
        self.layer_offsets = dict(layer_offsets or {})
        self.previous = previous
        self.model_info = dict(model_info or {})
        self.buffer: RecordingBuffer | None = None
        self.clock = None
        self.planned: list[int] | None = None
        self.per_step: int | None = None
        self.written: Path | None = None
        self.pbar = None
        self._counter = StepCounter()
        self._layers_checked = False

    def __deepcopy__(self, memo):
        return self

    # the override ---------------------------------------------------------------------------------------------
    def __call__(self, func, *args, **kwargs):
        to = kwargs.get("transformer_options") or {}
        forward = to.get(INFO_KEY)
        layer = forward.next_layer(to, args, kwargs) if forward is not None and self.buffer is not None else None
        if layer is not None:  # a self-attention call (cross-attention calls get no layer number)
            forward.state.setdefault("record_seen", set()).add(layer)  # per forward: MultiGPU runs two at once
            if self._wanted(layer, forward.step):
                call = translate(args, kwargs, ignore_mask=carries_mask(args, kwargs) and forward.mask_is_noop())
                if not isinstance(call, str):
                    row = cond_row(to, call.q.shape[0])
                    if row is not None and not self.buffer.has(layer, forward.step):
                        lay = forward.layout(call.q.shape[2], to)
                        k, v = call.kv(row)  # grouped-query k/v with the query's heads, as sparse calls see them
                        self.buffer.add(layer, forward.step, call.q[row], k, v, lay)
                        self._progress()
        if self.previous is not None:
            return self.previous(func, *args, **kwargs)
        return func(*args, **kwargs)

    def _wanted(self, layer: int, step: int) -> bool:
        if self.layers is not None and layer not in self.layers:
            return False
        if self.planned is not None:
            return step in self.planned
        return self.steps.is_anchor(step, 0, None)

    def _progress(self):
        if self.pbar is None:
            return
        total = max(1, len(self.planned or ()) * (self.per_step or len(self.layers or ()) or 1))
        self.pbar.update_absolute(min(total, len(self.buffer.tensors) // 3), total)

    # lifecycle ------------------------------------------------------------------------------------------------
    def outer_sample(self, executor, *args, **kwargs):
        """OUTER_SAMPLE wrapper: plan the steps of this run, record during it, write the file after it (a failure to
        write is logged and kept for Calibrate; the sampler's result is returned either way)."""
        sigmas = args[3] if len(args) > 3 else kwargs.get("sigmas")
        try:
            ms = executor.class_obj.model_patcher.get_model_object("model_sampling")
        except Exception:  # noqa: BLE001 - a guider without a model patcher: the sampler's own steps
            ms = None
        self.clock = clock_for(sigmas, ms)
        total = self.clock.total
        self.planned = None if total is None else [s for s in range(total) if self.steps.is_anchor(s, 0, total)]
        if self.planned is not None and not self.planned:
            raise ValueError(f"Sparse Attention Record: steps {self.steps.describe()!r} name no step of this "
                             f"{total}-step run")
        self._counter = StepCounter()
        self.per_step = None
        self._layers_checked = False
        self.written = None
        self.buffer = RecordingBuffer(self.max_bytes)
        try:
            import comfy.utils
            self.pbar = comfy.utils.ProgressBar(max(1, len(self.planned or ()) * len(self.layers or (1,))))
        except Exception:  # noqa: BLE001 - no progress hook outside a ComfyUI server: record without a bar
            self.pbar = None
        try:
            result = executor(*args, **kwargs)
            self._save()
            return result
        finally:
            self.buffer = None  # the tensors are on disk (or the run failed): free the host memory
            self.pbar = None

    def _save(self) -> None:
        """Write the buffer to ``path``. Any error is logged (naming the node and the file) and kept for the
        Calibrate node, and nothing half-written stays: the sampling result must not be lost to the recording."""
        try:
            self.written = self.buffer.save(self.path, self._metadata())
        except Exception as exc:  # noqa: BLE001 - the run is done: report, never fail the sampler
            reason = str(exc) or type(exc).__name__
            _failures[_key(self.path)] = reason
            partial = self.path.with_name(self.path.name + ".partial")
            try:
                partial.unlink(missing_ok=True)
            except OSError:
                pass
            log.error("Sparse Attention Record: the recording %s was NOT written: %s. The sampler's result is kept; "
                      "Sparse Attention Calibrate will report this file as missing.", self.path, reason)
            return
        _failures.pop(_key(self.path), None)
        log.info("sparse attention: recorded q/k/v of layers %s at steps %s to %s (%.0f MB)",
                 sorted({int(k[5:k.index(".")]) for k in self.buffer.tensors}), self.planned, self.written,
                 self.buffer.nbytes / 1e6)

    def _metadata(self) -> dict:
        meta = {"family": self.family.name, "total_steps": self.clock.total if self.clock else None,
                "run_clock": self.clock.source if self.clock else None, "batch_row": "first conditional row",
                "note": "q, k after the model's norm and RoPE (what the attention override receives), v as passed; "
                        "(H, N, D) fp16; softmax scale not applied"}
        meta.update(self.model_info)
        return meta

    def apply_model(self, executor, x, t, *args, **kwargs):
        """APPLY_MODEL wrapper: this forward's facts (layer counter, step, layout), as the sparse patch computes
        them; after the first forward the requested layers are checked against the model's, and after the first
        forward that recorded anything the whole plan is checked against the cap."""
        to = args[3] if len(args) > 3 else kwargs.get("transformer_options")
        if not isinstance(to, dict):
            return executor(x, t, *args, **kwargs)
        if isinstance(to.get(OVERRIDE), SparseAttentionPatch):
            raise ValueError(REFUSE_WITH_SPARSE)
        forward = Forward(self.family, x.shape, to, self.layer_offsets, self.clock, self._counter, conds=kwargs)
        to[INFO_KEY] = forward
        before = self.buffer.nbytes if self.buffer is not None else 0
        if self.family.bypass_module is not None:
            with route_module_attention(self.family.bypass_module, to):
                out = executor(x, t, *args, **kwargs)
        else:
            out = executor(x, t, *args, **kwargs)
        seen = forward.state.get("record_seen")
        if self.buffer is not None and not self._layers_checked and seen:
            self._check_layers(to, seen)
        if self.buffer is not None and self.per_step is None and self.buffer.nbytes > before:
            self._check_plan(forward, self.buffer.nbytes - before)
        return out

    def _check_layers(self, transformer_options: dict, seen: set) -> None:
        """After the first forward with self-attention calls (``seen``: their layer numbers): every requested layer
        must be one of the model's (ValueError naming the missing ones, instead of sampling the whole run to record
        nothing of them)."""
        self._layers_checked = True
        if self.layers is None:
            return
        skipped = {int(b) for b in transformer_options.get("stg_self_attn_blocks", ()) or ()}  # skipped this forward
        missing = sorted(self.layers - seen - skipped)
        if missing:
            raise ValueError(f"Sparse Attention Record: layers: {_ranges(missing)} not in this model (its "
                             f"self-attention layers are {_ranges(seen | skipped)}); record existing layers "
                             "or leave layers empty for all")

    def _check_plan(self, forward: Forward, recorded: int) -> None:
        """After the first forward that recorded: the bytes the whole plan needs against the cap."""
        layers_here = len({k for k in self.buffer.tensors}) // 3
        self.per_step = len(self.layers) if self.layers is not None else forward.calls
        if self.planned is None:
            return
        per_entry = recorded // max(1, layers_here)
        need = per_entry * self.per_step * len(self.planned)
        if need > self.max_bytes:
            raise RecordingTooLarge(
                f"Sparse Attention Record: {self.per_step} layer(s) x {len(self.planned)} step(s) "
                f"{self.planned} need {need / 1e6:.4g} MB ({per_entry / 1e6:.4g} MB per layer and step), past "
                f"max_mb = {self.max_bytes / 1e6:.4g}: record fewer layers or steps, or raise max_mb")
        self._progress()


def install(model, layers, steps, max_bytes: int, path: Path):
    """Clone a ComfyUI ModelPatcher and install the recording override on the clone (ValueError when the model
    already carries a Sparse Attention patch)."""
    import comfy.patcher_extension as pe

    if find_patch(model) is not None:
        raise ValueError(REFUSE_WITH_SPARSE)
    m = model.clone()
    opts = m.model_options.setdefault("transformer_options", {})
    previous = opts.get(OVERRIDE)
    if isinstance(previous, RecordPatch):
        previous = previous.previous  # a second Record node replaces the first
    dm = m.get_model_object("diffusion_model")
    family = family_of(dm)
    info = {"model": type(dm).__name__, "model_signature": model_signature(dm)}
    patch = RecordPatch(layers, steps, max_bytes, path, family, family.layer_offsets(dm), previous, info)
    opts[OVERRIDE] = patch
    m.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, KEY, patch.outer_sample)
    m.add_wrapper_with_key(pe.WrappersMP.APPLY_MODEL, KEY, patch.apply_model)
    return m, patch
