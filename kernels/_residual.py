"""Residuals fused into the sparse kernels' epilogue: argument checks and the PyTorch-side arithmetic.

A residual is a (data, scale) pair (or any non-tensor object with ``data`` and ``scale`` attributes):
data (B, H, Nq, D) in the model's dtype with scale None, or float8_e4m3fn data with an fp32
(B, H, Nq, 1) per-row scale. The sparse primitives return ``out + data * scale`` computed in fp32 and
cast once, so a reuse step makes no separate pass over (B, H, N, D); rows with nothing to attend get
exactly the residual.

Block-sparse attention also takes a **mass-weighted** residual: a third item (a (data, scale, mass) triple, or a
``mass`` attribute), fp32 (B, H, Nq, 2) per row: log Z_C, the log softmax mass of the keys the anchor left out, and
log beta, their share of the row's mass at the anchor (natural logs). The output is then
``out + w * data * scale`` with w = beta_now / beta, beta_now = Z_C / (Z_S(now) + Z_C) from the sparse part's mass
Z_S measured by this very call (its LSE): the complement's share re-weighted by how much the selected keys weigh
now (docs/method.md, "The residual weighted by the mass"). w = 1 where beta < MASS_EPS (nothing was left out).
"""

from __future__ import annotations

import math

import torch

FP8 = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0
RESIDUAL_PRECISIONS = ("model", "fp8")
CHUNK_ELEMS = 1 << 26  # fp32 elements decoded at a time by the PyTorch helpers (256 MiB of scratch)


# Below this share of the row's mass left out at the anchor, the residual is not re-weighted: beta comes from
# 1 - exp(LSE_S - LSE_dense), and fp32 LSEs of 8-20 resolve about 1e-6, so a row that selected everything can show a
# beta of ~1e-5 when the two LSEs come from different kernels (the composed anchor); R of such rows is <= beta of the
# output, so leaving them unweighted changes nothing measurable.
MASS_EPS = 1e-4
LOG_MASS_EPS = math.log(MASS_EPS)


def check_residual(residual, q: torch.Tensor):
    """Validate ``residual`` against q (B, H, Nq, D). Returns None or (data, scale-or-None); a mass (third item or
    attribute) is checked by ``residual_mass``."""
    if residual is None:
        return None
    if isinstance(residual, torch.Tensor):
        raise ValueError("residual must be a (data, scale) pair, not a bare tensor")
    if isinstance(residual, (tuple, list)):
        if len(residual) not in (2, 3):
            raise ValueError(f"residual must be a (data, scale) pair or (data, scale, mass), got {len(residual)} "
                             "items")
        data, scale = residual[:2]
    elif hasattr(residual, "data") and hasattr(residual, "scale"):
        data, scale = residual.data, residual.scale
    else:
        raise ValueError(f"residual must be a (data, scale) pair, got {type(residual).__name__}")
    if not isinstance(data, torch.Tensor) or tuple(data.shape) != tuple(q.shape):
        raise ValueError(f"residual data must be a tensor of shape {tuple(q.shape)}, "
                         f"got {tuple(getattr(data, 'shape', ()))}")
    if data.device != q.device:
        raise ValueError(f"residual data must be on {q.device}, got {data.device}")
    if FP8 is not None and data.dtype == FP8:
        want = (*q.shape[:3], 1)
        if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or tuple(scale.shape) != want:
            raise ValueError(f"residual scale must be an fp32 tensor of shape {want} for float8 data")
        if scale.device != q.device:
            raise ValueError(f"residual scale must be on {q.device}, got {scale.device}")
        return data, scale
    if data.dtype != q.dtype:
        raise ValueError(f"residual data must be float8_e4m3fn or q's dtype {q.dtype}, got {data.dtype}")
    if scale is not None:
        raise ValueError("residual scale must be None unless the data is float8_e4m3fn")
    return data, None


def residual_mass(residual, q: torch.Tensor) -> torch.Tensor | None:
    """The per-row mass of a mass-weighted residual (fp32 (B, H, Nq, 2), contiguous), or None."""
    if isinstance(residual, (tuple, list)):
        mass = residual[2] if len(residual) == 3 else None
    else:
        mass = getattr(residual, "mass", None)
    if mass is None:
        return None
    want = (*q.shape[:3], 2)
    if not isinstance(mass, torch.Tensor) or mass.dtype != torch.float32 or tuple(mass.shape) != want:
        raise ValueError(f"residual mass must be an fp32 tensor of shape {want}")
    if mass.device != q.device:
        raise ValueError(f"residual mass must be on {q.device}, got {mass.device}")
    return mass.contiguous()


def refuse_mass(residual, q: torch.Tensor) -> None:
    """ValueError when ``residual`` carries a mass: only block-sparse attention weights a residual by it (token
    selections keep theirs fixed, docs/method.md)."""
    if residual is not None and check_residual(residual, q) is not None and residual_mass(residual, q) is not None:
        raise ValueError("residual: a mass-weighted residual is for block-sparse attention only")


def mass_of(lse_dense: torch.Tensor, lse_sparse: torch.Tensor) -> torch.Tensor:
    """Per-row mass of an anchor (fp32 (..., 2): log Z_C, log beta) from the dense and the sparse row LSE (fp32
    (...), natural log; -inf for rows that keep nothing)."""
    beta = (1.0 - torch.exp(lse_sparse - lse_dense)).clamp(0.0, 1.0)
    log_beta = torch.log(beta)
    return torch.stack([lse_dense + log_beta, log_beta], -1)


def mass_weight(lse_sparse: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """w (fp32 (...)) of a reuse call: the complement's share now over its share at the anchor, from this call's
    sparse row LSE (fp32 (...)) and the anchor's mass (fp32 (..., 2)); 1 where the anchor left out < MASS_EPS."""
    log_c, log_beta = mass[..., 0], mass[..., 1]
    share = torch.nn.functional.logsigmoid(log_c - lse_sparse)  # log(Z_C / (Z_S + Z_C)); 0 where nothing is kept
    return torch.where(log_beta > LOG_MASS_EPS, torch.exp(share - log_beta), torch.ones_like(share))


def contiguous_residual(res):
    """A checked pair whose data has a unit last stride (the kernels address rows by stride)."""
    if res is None or res[0].stride(-1) == 1:
        return res
    return res[0].contiguous(), res[1]


def _head_slices(x: torch.Tensor):
    step = max(1, CHUNK_ELEMS // max(1, x[:, :1].numel()))
    for h0 in range(0, x.shape[1], step):
        yield slice(h0, h0 + step)


def add_residual_(out: torch.Tensor, res, weight: torch.Tensor | None = None) -> torch.Tensor:
    """out (B, H, Nq, D) fp32 += weight * data * scale (checked pair from ``check_residual``; weight fp32
    (B, H, Nq) from ``mass_weight`` or None for 1), in place."""
    if res is None:
        return out
    data, scale = res
    for sl in _head_slices(out):
        r = data[:, sl].float()
        r = r if scale is None else r * scale[:, sl]
        out[:, sl] += r if weight is None else r * weight[:, sl].unsqueeze(-1)
    return out


def decode_into(out: torch.Tensor, res) -> torch.Tensor:
    """out (B, H, Nq, D), any float dtype, = data * scale cast to out's dtype (rows no kernel writes)."""
    data, scale = res
    if scale is None:
        return out.copy_(data)
    for sl in _head_slices(out):
        out[:, sl] = (data[:, sl].float() * scale[:, sl]).to(out.dtype)
    return out


def encode_residual(diff: torch.Tensor, precision: str, dtype: torch.dtype, minus: torch.Tensor | None = None,
                    sums: torch.Tensor | None = None):
    """Residual pair of ``diff`` (B, H, N, D), any float dtype, or of ``diff - minus`` (same shape) formed in fp32 a few
    heads at a time: precision "model" -> (R as ``dtype``, None); "fp8" -> (float8_e4m3fn data, fp32 (B, H, N, 1) scale
    = amax / 448 of the row's finite values, 1 for all-zero rows; a non-finite element stays NaN in its own element).
    ``minus`` spares the caller full fp32 copies of both operands (at Wan 14B 720p with a CFG batch each is 3 GB).
    ``sums``: an fp32 (2,) tensor on diff's device to which the sums of R^2 and of diff^2 (fp32) are added, in the
    same pass (needs ``minus``)."""
    if precision not in RESIDUAL_PRECISIONS:
        raise ValueError(f"residual_precision must be one of {RESIDUAL_PRECISIONS}, got {precision!r}")
    if minus is not None and minus.shape != diff.shape:
        raise ValueError(f"minus must have diff's shape {tuple(diff.shape)}, got {tuple(minus.shape)}")
    if sums is not None and minus is None:
        raise ValueError("sums needs minus (the sums of R^2 and of diff^2)")
    if precision == "model" and minus is None:
        return diff.to(dtype), None
    if precision == "fp8" and FP8 is None:
        raise ValueError("residual_precision='fp8' needs torch.float8_e4m3fn")
    b, h, n, d = diff.shape
    data = torch.empty((b, h, n, d), dtype=FP8 if precision == "fp8" else dtype, device=diff.device)
    scale = torch.empty((b, h, n, 1), dtype=torch.float32, device=diff.device) if precision == "fp8" else None
    for sl in _head_slices(diff):
        a = diff[:, sl].float()
        x = a if minus is None else a - minus[:, sl].float()
        if sums is not None:
            sums += torch.stack([x.square().sum(), a.square().sum()])
        if scale is None:
            data[:, sl] = x.to(dtype)
            continue
        finite = torch.isfinite(x)
        s = torch.where(finite, x.abs(), torch.zeros_like(x)).amax(-1, keepdim=True) / FP8_MAX
        s = torch.where(s > 0, s, torch.ones_like(s))
        scale[:, sl] = s
        data[:, sl] = torch.where(finite, x / s, torch.full_like(x, float("nan"))).to(FP8)
    return data, scale
