"""Cached residuals R = O_dense - O_sparse, stored in the model's dtype or in fp8 (docs/method.md, "Anchors,
reuse and the residual").

The residual is the largest cached tensor (one (B, H, N, D) output per layer: 1.55 GB at Wan 14B 720p
with CFG), so by default it is stored as float8_e4m3fn with one fp32 scale per (batch, head, token)
row (amax / 448): half the bytes of bf16 plus 1/32 for the scales. The rounding error (3 mantissa bits,
≤ 2^-4 of each value) lands on R, itself a few per cent of the output, so the output moves by
≤ 2^-4 × |R| (docs/decisions.md has the measurement).

Where memory is short a residual can be **packed** to 4 bits a value (``residual_precision`` "int4", or "auto" for
the residuals that find no room at fp8): the fp8 row's scale stays, and each value keeps the nearest of the 15
levels k × 64 (k = -7..7), which float8_e4m3fn represents exactly, so unpacking gives the kernels an ordinary fp8
residual. Half of fp8's bytes; docs/decisions.md, "Residuals at 4 bits", has what it costs. A packed residual also
keeps its row scale in bf16 (fp32's range, at most 0.4 % rounding where the 4-bit levels round by up to 7 %) and its
mass in fp16, log Z_C less its head's median: at Wan 14B 720p they are 72 of a packed layer's 460 MB, and a mass
that only later anchors write made a host cache filled at the first anchor drop residuals at every later one
(docs/benchmarks.md, "4-bit residuals on a 16 GB card"). Unpacking restores fp32 for the kernels.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .. import kernels
from ..kernels._residual import FP8, encode_residual
from .config import RESIDUAL_PRECISIONS as PRECISIONS

log = logging.getLogger(__name__)

CHUNK_ELEMS = 1 << 26  # elements converted at a time (bounds the fp32 scratch to 256 MiB)
# packed bytes unpacked at a time: each takes a 4-byte index and a 2-byte result while it is looked up, so this bounds
# the scratch to ~96 MiB beside the fp8 result (at 1 << 26 a Wan 14B layer's unpacking peaked at 1.44x its fp8 size,
# docs/decisions.md, "Residuals at 4 bits"); a reuse step unpacks one layer while the GPU holds the model
UNPACK_CHUNK_ELEMS = 1 << 24
PACKABLE = ("int4", "auto")  # stored precisions that the kernels write as fp8 and that may be packed to 4 bits
PACK_STEP = 64.0  # one 4-bit level in fp8 units: 7 levels reach the fp8 row's 448 (kernels/_residual.py, FP8_MAX)
PACK_NAN = 0  # the 4-bit code of a non-finite value (the fp8 data holds NaN there); codes 1..15 are levels -7..7
_warned = False


def weighs_by_mass(cfg, step: int, q: torch.Tensor) -> bool:
    """Whether an anchor at ``step`` (0-based sampling step) of configuration ``cfg`` (SparseConfig) writes its
    residual's mass, so reuse calls weight the residual by it (SparseConfig.residual_weighting): not for anchors
    at the run's first step, where the input is pure noise — measured on the quality testbed, the weighting gains
    1.7-5.4 dB after anchors at later steps and loses up to 2.7 dB after step-0 anchors at density 0.1
    (docs/method.md, "The residual weighted by the mass"); under "auto" only where the block-sparse kernels run on
    Triton (the PyTorch twin pays a second score pass for the LSE). q: the call's (B, H, N, D) queries (their
    device and dtype decide the backend). Only block selections carry a mass; callers check the selection."""
    if not cfg.residual or cfg.residual_weighting == "fixed" or step == 0:
        return False
    return cfg.residual_weighting == "mass" or kernels.block_sparse_on_triton(q, cfg.backend)


def fp8_supported(device: torch.device) -> bool:
    """fp8 storage needs torch's float8_e4m3fn and a CUDA or CPU tensor (elementwise casts)."""
    return FP8 is not None and device.type in ("cuda", "cpu")


def residual_precision(precision: str, device: torch.device) -> str:
    """What the kernels write for a residual stored at ``precision`` (SparseConfig.residual_precision) on
    ``device``: "fp8" for "fp8", "int4" and "auto" (packed afterwards: ``Residual.stored_as``) where fp8 is supported,
    else "model" (logged once); "model" for "model"."""
    global _warned
    if precision in PACKABLE:
        precision = "fp8"
    if precision == "fp8" and not fp8_supported(device):
        if not _warned:
            _warned = True
            log.info("sparse attention: fp8 residuals are not available on %s; stored in the model's dtype",
                     device.type)
        return "model"
    return precision


def _head_chunks(x: torch.Tensor):
    """Slices over dim 1 (heads) of a (B, H, N, D) tensor, each at most ~CHUNK_ELEMS elements."""
    per_head = max(1, x.numel() // max(1, x.shape[1]))
    step = max(1, CHUNK_ELEMS // per_head)
    for h0 in range(0, x.shape[1], step):
        yield slice(h0, h0 + step)


def _row_chunks(x: torch.Tensor, limit: int | None = None):
    """Slices over dim 0 of ``x`` (rows, ...) of about ``limit`` elements (default CHUNK_ELEMS), one row at least."""
    per_row = max(1, x[:1].numel())
    step = max(1, (CHUNK_ELEMS if limit is None else limit) // per_row)
    for r0 in range(0, x.shape[0], step):
        yield slice(r0, r0 + step)


_TABLES: dict = {}


def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(pack, unpack) lookup tables on ``device``: pack uint8 (256,), the 4-bit code of each fp8 bit pattern (its
    nearest level, PACK_NAN for NaN); unpack int16 (256,), each packed byte's two fp8 bytes as they lie in memory."""
    key = str(device)
    if key not in _TABLES:
        v = torch.arange(256, dtype=torch.uint8).view(FP8).float()
        code = torch.round(v / PACK_STEP).clamp(-7, 7) + 8
        pack = torch.where(torch.isnan(v), torch.full_like(code, PACK_NAN), code).to(torch.uint8)
        level = (torch.arange(16, dtype=torch.float32) - 8) * PACK_STEP
        level[PACK_NAN] = float("nan")
        fp8 = level.to(FP8).view(torch.uint8)
        byte = torch.arange(256)
        unpack = torch.stack((fp8[byte & 15], fp8[byte >> 4]), -1).contiguous().view(torch.int16).reshape(256)
        _TABLES[key] = (pack.to(device), unpack.to(device))
    return _TABLES[key]


@dataclass
class Residual:
    """data: (B, H, N, D) in the model's dtype, or float8_e4m3fn; scale: fp32 (B, H, N, 1) per-row scale
    when data is fp8, else None; mass: fp32 (B, H, N, 2) per-row (log Z_C, log beta) of the anchor when reuse
    calls weight the residual by the selected keys' mass (kernels/_residual.py), else None."""

    data: torch.Tensor
    scale: torch.Tensor | None = None
    mass: torch.Tensor | None = None
    packed: bool = False  # data: uint8 (B, H, N, D / 2), two 4-bit codes a byte (even column low), on fp8's scale;
    # scale then bf16 (B, H, N, 1), mass fp16 (B, H, N, 2) holding (log Z_C - mass_base, log beta)
    mass_base: torch.Tensor | None = None  # fp32 (B, H, 1, 1) of a packed residual's mass, else None

    @staticmethod
    def encode(diff: torch.Tensor, precision: str = "fp8") -> "Residual":
        """Store ``diff`` (B, H, N, D), any float dtype. precision "fp8" (falls back to "model", logged
        once, where fp8 is unsupported), "int4" (fp8, then packed), "auto" (fp8: the cache packs it when it finds
        no room) or "model" (kept as is)."""
        global _warned
        if precision not in PRECISIONS:
            raise ValueError(f"residual precision must be one of {PRECISIONS}, got {precision!r}")
        if precision == "model" or not fp8_supported(diff.device):
            if precision != "model" and not _warned:
                _warned = True
                log.info("sparse attention: fp8 residuals are not available on %s; stored in %s",
                         diff.device.type, diff.dtype)
            return Residual(diff)
        # the kernels' encoder (the Triton epilogue decodes what it writes): a per-row scale from the row's finite
        # values, so an inf or NaN (non-finite model input) stays in its own element, as in the dense output
        data, scale = encode_residual(diff, "fp8", diff.dtype)
        return Residual(data, scale).stored_as(precision)

    @property
    def shape(self) -> tuple:
        """(B, H, N, D) of the residual it stands for (a packed one's data holds D / 2 bytes a row)."""
        b, h, n, d = self.data.shape
        return (b, h, n, 2 * d) if self.packed else (b, h, n, d)

    def can_pack(self) -> bool:
        """An fp8 residual with an even head dimension, not packed yet."""
        return not self.packed and FP8 is not None and self.data.dtype == FP8 and self.data.shape[-1] % 2 == 0

    @property
    def packing_frees(self) -> int:
        """Bytes that packing frees: half the fp8 data (two values a byte), half the row scale (bf16) and half the mass
        (fp16) less its base; 0 when it cannot be packed."""
        if not self.can_pack():
            return 0
        frees = self.data.numel() // 2
        if self.scale is not None:
            frees += self.scale.numel() * (self.scale.element_size() - 2)  # to bf16
        if self.mass is not None:  # to fp16, with a base of 4 bytes a (batch, head)
            frees += self.mass.numel() * (self.mass.element_size() - 2) - self.mass.shape[0] * self.mass.shape[1] * 4
        return frees

    def stored_as(self, precision: str) -> "Residual":
        """This residual as ``precision`` stores it: packed for "int4" (where it can be), else itself."""
        return self.pack() if precision == "int4" and self.can_pack() else self

    def pack(self, work: torch.device | None = None, empty=None) -> "Residual":
        """The 4-bit form of an fp8 residual (``can_pack``): each value's nearest level k x PACK_STEP (k = -7..7) on
        the same row scale, NaN kept (code PACK_NAN); the scale in bf16 and the mass in fp16 (the class's fields).
        ``work``: the device that computes it (a host residual packed on its GPU: its bytes there and back, a few
        (batch, head) rows at a time); ``empty(shape, dtype)``: allocates the results on the data's device (e.g.
        page-locked buffers), else new tensors."""
        if not self.can_pack():
            raise ValueError("only an unpacked fp8 residual with an even head dimension can be packed")
        b, h, n, d = self.data.shape
        dev = self.data.device
        if empty is None:
            def empty(shape, dtype):
                return torch.empty(shape, dtype=dtype, device=dev)
        out = empty((b, h, n, d // 2), torch.uint8)
        work = dev if work is None else torch.device(work)
        lut = _tables(work)[0]
        src, dst = self.data.view(torch.uint8).reshape(b * h, n, d), out.view(b * h, n, d // 2)
        for rows in _row_chunks(src):  # (batch, head) rows in memory order: contiguous slices both ways
            byte = src[rows].to(work, non_blocking=True)
            code = lut.index_select(0, byte.reshape(-1).int()).view(byte.shape)  # one lookup per fp8 bit pattern
            dst[rows].copy_(code[..., 0::2] | (code[..., 1::2] << 4))
        scale = None
        if self.scale is not None:
            scale = empty(tuple(self.scale.shape), torch.bfloat16)
            scale.copy_(self.scale.to(work, non_blocking=True).to(torch.bfloat16))  # to the host: waits, as the data
        mass = base = None
        if self.mass is not None:
            m = self.mass.to(work, non_blocking=True)
            log_c = m[..., 0]
            # each head's median of log Z_C (finite rows; 0 where none is): a head's rows lie within a few units of
            # it, where fp16 keeps them to 2^-7 within 16 of it (w within ~1 %) and 2^-5 within 64; a row beyond
            # fp16's range saturates to +-inf, the limit its weight tends to (0, or 1 / beta)
            med = torch.nanmedian(torch.where(torch.isfinite(log_c), log_c, float("nan")), dim=-1).values
            med = torch.nan_to_num(med, nan=0.0)
            base = empty((b, h, 1, 1), torch.float32)
            base.copy_(med.view(b, h, 1, 1))
            mass = empty(tuple(m.shape), torch.float16)
            mass.copy_(torch.stack((log_c - med[..., None], m[..., 1]), -1).to(torch.float16))
        return Residual(out, scale, mass, packed=True, mass_base=base)

    def unpacked(self) -> "Residual":
        """The fp8 residual a packed one stands for (new tensors: fp8 data, fp32 scale and mass); itself when not
        packed."""
        if not self.packed:
            return self
        b, h, n, half = self.data.shape
        out = torch.empty((b, h, n, 2 * half), dtype=torch.uint8, device=self.data.device)
        lut = _tables(self.data.device)[1]
        src, dst = self.data.reshape(b * h, n, half), out.view(b * h, n, 2 * half)
        # one lookup per packed byte gives both fp8 bytes (even column first in memory)
        for rows in _row_chunks(src, UNPACK_CHUNK_ELEMS):
            p = src[rows]
            dst[rows] = lut.index_select(0, p.reshape(-1).int()).view(*p.shape).view(torch.uint8)
        scale = None if self.scale is None else self.scale.float()
        mass = None
        if self.mass is not None:
            m = self.mass.float()
            base = 0.0 if self.mass_base is None else self.mass_base.view(b, h, 1)
            mass = torch.stack((m[..., 0] + base, m[..., 1]), -1)
        return Residual(out.view(FP8), scale, mass)

    def add_to(self, out: torch.Tensor) -> torch.Tensor:
        """out (B, H, N, D) += the residual, in place; returns out. fp8 rows are decoded in fp32 (an fp16 copy of
        a small row's scale would be subnormal or zero)."""
        if self.packed:
            return self.unpacked().add_to(out)
        if self.scale is None:
            return out.add_(self.data)
        for sl in _head_chunks(out):
            out[:, sl] = out[:, sl].float().addcmul_(self.data[:, sl].float(), self.scale[:, sl]).to(out.dtype)
        return out

    def norm(self) -> float:
        """L2 norm of the decoded residual, accumulated in fp32 one head chunk at a time (read on the host)."""
        return float(self.norm_on_device())

    def norm_on_device(self) -> torch.Tensor:
        """The L2 norm of ``norm`` as a 0-d fp32 tensor on the residual's device, without a host synchronisation
        (an anchor's store reads it later: docs/kernel_notes.md, "v26")."""
        if self.packed:
            return self.unpacked().norm_on_device()
        total = torch.zeros((), dtype=torch.float32, device=self.data.device)
        for sl in _head_chunks(self.data):
            x = self.data[:, sl].float()
            if self.scale is not None:
                x = x * self.scale[:, sl]
            total += torch.linalg.vector_norm(x).square()
        return total.sqrt()

    def decode(self, dtype: torch.dtype) -> torch.Tensor:
        """The residual as a (B, H, N, D) tensor of ``dtype``."""
        if self.packed:
            return self.unpacked().decode(dtype)
        if self.scale is None:
            return self.data.to(dtype)
        return (self.data.float() * self.scale).to(dtype)

    def tensors(self):
        return tuple(t for t in (self.data, self.scale, self.mass, self.mass_base) if t is not None)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def map(self, fn) -> "Residual":
        """A copy with ``fn`` applied to every tensor (device moves, pinned copies)."""
        return Residual(fn(self.data), None if self.scale is None else fn(self.scale),
                        None if self.mass is None else fn(self.mass), self.packed,
                        None if self.mass_base is None else fn(self.mass_base))

    def batch_slice(self, start: int, stop: int) -> "Residual":
        """Batch rows [start, stop) (views)."""
        return Residual(self.data[start:stop], None if self.scale is None else self.scale[start:stop],
                        None if self.mass is None else self.mass[start:stop], self.packed,
                        None if self.mass_base is None else self.mass_base[start:stop])
