"""The residual epilogues' fp8 store (kernels/_triton_common.py, ``store_residual_out``) against torch's own cast.

Shared by the interpreter test (where the kernel rounds to the fp8 grid first) and the GPU test (where the hardware
cast rounds, and saturates an inf unless the kernel keeps it NaN): rows of random magnitudes, a row at scale 1 with
ties between fp8 values and subnormals, an all-zero row, and a row with +inf, -inf and NaN among finite values.
"""

import torch
import triton
import triton.language as tl

from comfyui_sparse_attention.kernels import _triton_common as C

ROWS, D = 16, 64


@triton.jit
def _store_kernel(X, RO, ROS, N_Q: tl.constexpr, HEAD_DIM: tl.constexpr):
    rows = tl.arange(0, N_Q)
    d = tl.arange(0, HEAD_DIM)
    r = tl.load(X + rows[:, None] * HEAD_DIM + d[None, :])
    C.store_residual_out(RO, ROS, 0, 0, tl.program_id(0), rows, rows < N_Q, 0, 0, HEAD_DIM, N_Q, r, d,
                         HEAD_DIM, HEAD_DIM, True)


def residual_tile() -> torch.Tensor:
    """fp32 (ROWS, D): the cases above."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(ROWS, D, generator=g) * torch.logspace(-6, 3, ROWS).view(-1, 1)
    x[1] = 0.0
    # row 2 at scale exactly 1 (its max is 448), with values halfway between neighbouring fp8 values, which round to
    # the even one: 1.0625 (-> 1), 1.1875 (-> 1.25), 3.125 (-> 3), 3.375 (-> 3.5), 0.5 + 2**-5 (-> 0.5), 248 (-> 256,
    # the next binade), 2**-6 * 1.0625 at the smallest normal (-> 2**-6), and among the subnormals (step 2**-9): 1.5,
    # 2.5, 3.5 and 4.5 steps (-> 2, 2, 4, 4) and half a step (-> 0)
    ties = torch.tensor([1.0625, 1.1875, 3.125, 3.375, 0.5 + 2 ** -5, 248.0, 2 ** -6 * 1.0625, 2 ** -9 * 1.5,
                         2 ** -9 * 2.5, 2 ** -9 * 3.5, 2 ** -9 * 4.5, 2 ** -10])
    x[2] = torch.linspace(-300.0, 300.0, D)
    x[2, :ties.numel()] = ties
    x[2, ties.numel():2 * ties.numel()] = -ties
    x[2, -1] = 448.0
    x[3, 3], x[3, 5], x[3, 7] = float("inf"), float("nan"), float("-inf")
    return x


def check(device: str) -> dict:
    """Run the store on ``device`` and compare with torch: {'scale_rel', 'codes_equal' (fraction of the finite
    elements whose fp8 byte equals torch's, either zero equal to the other), 'ties_equal' (row 2 as torch rounds
    it), 'ties_scale_exact' (row 2's scale came out exactly 1, so its values reached the cast unchanged), 'max_steps'
    (largest difference in fp8 steps), 'nan_where_nonfinite', 'finite_elsewhere'}."""
    x = residual_tile()
    ro = torch.empty(ROWS, D, dtype=torch.float8_e4m3fn, device=device)
    ros = torch.empty(ROWS, dtype=torch.float32, device=device)
    _store_kernel[(1,)](x.to(device), ro, ros, N_Q=ROWS, HEAD_DIM=D)
    finite = torch.isfinite(x)
    amax = torch.where(finite, x.abs(), 0.0).amax(1) / 448.0
    s = torch.where(amax > 0, amax, torch.ones_like(amax))
    want = torch.where(finite, x / s[:, None], 0.0).to(torch.float8_e4m3fn)
    got = ro.cpu()
    # codes with -0 read as +0: the interpreter's grid rounding loses a zero's sign, which no value depends on
    gb, wb = (t.view(torch.uint8).int().masked_fill(t.view(torch.uint8) == 0x80, 0) for t in (got, want))
    same = (gb == wb) & finite
    # fp8 e4m3 codes of one sign are ordered as their values: the code difference counts grid steps
    steps = (gb - wb).abs().masked_fill(~finite, 0)
    return dict(scale_rel=float(((ros.cpu() - s).abs() / s).max()),
                codes_equal=float(same.sum() / finite.sum()),
                ties_equal=bool(same[2].all()),
                ties_scale_exact=bool(ros[2].item() == 1.0),
                max_steps=int(steps.max()),
                nan_where_nonfinite=bool(torch.isnan(got.float())[~finite].all()),
                finite_elsewhere=bool(torch.isfinite(got.float())[finite].all()))
