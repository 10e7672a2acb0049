"""The anchor's residual R = dense - sparse encoded in one pass (docs/kernel_notes.md, "v23").

The mc_sparse anchor formed R in the model's dtype, took two norms of it, and encoded it to fp8 a few heads at a time
in fp32 (kernels/_residual.py, ``encode_residual``): about ten passes over (B, H, N, D) tensors, most of them fp32,
15.07 ms at Wan 14B on an H100 (0.78 ms here; bench/residual_of.py). Here one program reads a tile of rows of both
outputs once, forms R in fp32, writes it encoded as the kernels' epilogues do (``store_residual_out``: fp8 with a
per-row scale amax / 448 of the row's finite values, or the model's dtype) and adds the squares of R and of the dense
output into one partial sum per program, so the norms come without another pass and without atomics (the partial
sums are added in a fixed order: deterministic). Twin of
``anchor_torch.residual_of`` (the sums with its ``return_sums``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._residual import FP8
from ._triton_common import fp8_typed, head_dim_pad, load_rows, store_residual_out

BLOCK_M = 32  # rows a program (8 warps): 103 registers on sm_90, no spill; 64 rows on 4 warps spilled (255 registers)
NUM_WARPS = 8


@triton.jit
def _residual_fwd(A, S, RO, ROS, SUMS, H, N, sab, sah, san, ssb, ssh, ssn, srb, srh, srn, NQB,
                  HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr, FP8_OUT: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    rows = pid_m * BLOCK + tl.arange(0, BLOCK)
    row_ok = rows < N
    d = tl.arange(0, D_PAD)
    a = load_rows(A + b * sab + h * sah, rows, san, row_ok, d, HEAD_DIM, D_PAD, True).to(tl.float32)
    s = load_rows(S + b * ssb + h * ssh, rows, ssn, row_ok, d, HEAD_DIM, D_PAD, True).to(tl.float32)
    r = a - s
    out = SUMS + (pid_bh.to(tl.int64) * NQB + pid_m) * 2
    tl.store(out, tl.sum(tl.sum(r * r, 1), 0))
    tl.store(out + 1, tl.sum(tl.sum(a * a, 1), 0))
    store_residual_out(RO, ROS, b, h, pid_bh, rows, row_ok, srb, srh, srn, N, r, d, HEAD_DIM, D_PAD, FP8_OUT)


def supported(dense: torch.Tensor, precision: str) -> bool:
    """Whether this kernel encodes ``dense``'s residual at ``precision``: fp8 needs a GPU where Triton types
    float8_e4m3fn (kernels/_triton_common.py, ``fp8_typed``)."""
    return precision == "model" or (FP8 is not None and fp8_typed(dense))


def residual_of(dense: torch.Tensor, sparse: torch.Tensor, precision: str, return_sums: bool = False):
    """Residual pair of dense - sparse ((B, H, N, D) each, the same float dtype, unit stride along D): precision
    "model" -> (R in dense's dtype, None); "fp8" -> (float8_e4m3fn R, fp32 (B, H, N, 1) scale). With
    ``return_sums``: (pair, fp32 (2,) [sum of R^2, sum of dense^2]), on the device. Semantics of
    ``anchor_torch.residual_of`` (R formed in fp32)."""
    b, h, n, d = dense.shape
    if sparse.shape != dense.shape or sparse.dtype != dense.dtype:
        raise ValueError(f"sparse must match dense {tuple(dense.shape)} {dense.dtype}, got {tuple(sparse.shape)} "
                         f"{sparse.dtype}")
    if dense.stride(-1) != 1 or sparse.stride(-1) != 1:
        raise ValueError("dense and sparse need unit stride along the head dimension")
    fp8 = precision == "fp8"
    data = torch.empty((b, h, n, d), dtype=FP8 if fp8 else dense.dtype, device=dense.device)
    scale = torch.empty((b, h, n, 1), dtype=torch.float32, device=dense.device) if fp8 else None
    nqb = triton.cdiv(n, BLOCK_M)
    sums = torch.empty((b * h, nqb, 2), dtype=torch.float32, device=dense.device)
    if n and b * h:
        _residual_fwd[(nqb, b * h)](
            dense, sparse, data, scale if fp8 else data, sums, h, n, *dense.stride()[:3], *sparse.stride()[:3],
            *data.stride()[:3], nqb, HEAD_DIM=d, D_PAD=head_dim_pad(d), BLOCK=BLOCK_M, FP8_OUT=fp8, num_warps=NUM_WARPS)
    pair = (data, scale)
    return (pair, sums.sum((0, 1))) if return_sums else pair
