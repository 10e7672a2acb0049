"""kernels.residual_of on Triton (kernels/residual_encode_triton.py) against its twin ``anchor_torch.residual_of``.

Shared by the interpreter test (fp16 / fp32 on the CPU) and the GPU test (bf16 too, and a non-finite dense output:
the interpreter's own fp8 cast turns NaN into 384, tests/fp8_store_check.py): ragged lengths, head dims 64, 80
(padded lanes) and 128, batch 2, outputs laid out (B, N, H, D) as attention kernels write them (strided views),
both precisions and the sums of squares.
"""

import torch

from comfyui_sparse_attention import kernels as K


def _pair(shape, dtype, device, seed, strided):
    g = torch.Generator(device=device).manual_seed(seed)
    b, h, n, d = shape
    dense = torch.randn((b, h, n, d), generator=g, device=device)
    spread = torch.logspace(-3, 1, n, device=device).view(-1, 1)  # rows of R from 1e-3 to 10: the row scales vary
    sparse = dense + 0.05 * torch.randn(dense.shape, generator=g, device=device) * spread
    dense, sparse = dense.to(dtype), sparse.to(dtype)
    if strided:  # the same values in (B, N, H, D) memory, viewed as (B, H, N, D)
        dense, sparse = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (dense, sparse))
    return dense, sparse


def _codes(t: torch.Tensor) -> torch.Tensor:
    """fp8 bytes with -0 read as +0 (the interpreter's grid rounding loses a zero's sign, which no value depends on)."""
    u = t.contiguous().view(torch.uint8).int()
    return u.masked_fill(u == 0x80, 0)


def check(device: str, dtypes, shapes=((1, 2, 200, 64), (2, 3, 77, 80), (1, 2, 130, 128))) -> dict:
    """{case: {'model_equal', 'scale_rel', 'codes_equal' (fraction of equal fp8 bytes), 'max_steps', 'sums_rel',
    'triton' (whether the Triton kernel ran)}} for every dtype, shape, layout; plus on CUDA 'nonfinite': a dense
    output with inf and NaN elements keeps NaN in those elements of R alone, finite row scales, and NaN sums."""
    from comfyui_sparse_attention.kernels import residual_encode_triton as T
    out = {}
    for dtype in dtypes:
        for shape in shapes:
            for strided in (False, True):
                dense, sparse = _pair(shape, dtype, device, seed=sum(shape), strided=strided)
                case = f"{dtype}-{'x'.join(map(str, shape))}-{'bnhd' if strided else 'bhnd'}"
                ran = {}
                real = T.residual_of

                def spy(*a, **kw):
                    ran["triton"] = True
                    return real(*a, **kw)
                T.residual_of = spy
                try:
                    (m_t, _), sums_t = K.residual_of(dense, sparse, precision="model", return_sums=True,
                                                     backend="triton")
                    (f_t, s_t), _ = K.residual_of(dense, sparse, precision="fp8", return_sums=True, backend="triton")
                finally:
                    T.residual_of = real
                (m_r, _), sums_r = K.residual_of(dense, sparse, precision="model", return_sums=True, backend="torch")
                f_r, s_r = K.residual_of(dense, sparse, precision="fp8", backend="torch")
                steps = (_codes(f_t) - _codes(f_r)).abs()
                out[case] = dict(model_equal=bool(torch.equal(m_t, m_r)),
                                 scale_rel=float(((s_t - s_r).abs() / s_r).max()),
                                 codes_equal=float((steps == 0).float().mean()), max_steps=int(steps.max()),
                                 sums_rel=float(((sums_t - sums_r).abs() / sums_r).max()),
                                 triton=bool(ran.get("triton")), shape_ok=f_t.shape == dense.shape
                                 and s_t.shape == (*dense.shape[:3], 1) and m_t.dtype == dense.dtype)
    if device == "cuda":
        dense, sparse = _pair((1, 2, 300, 128), torch.bfloat16, device, seed=7, strided=False)
        dense[0, 1, 5, 3], dense[0, 0, 9, 0] = float("inf"), float("nan")
        (f, s), sums = K.residual_of(dense, sparse, precision="fp8", return_sums=True, backend="triton")
        bad = ~torch.isfinite(dense)
        out["nonfinite"] = dict(nan_there=bool(torch.isnan(f.float())[bad].all()),
                                finite_elsewhere=bool(torch.isfinite(f.float())[~bad].all()),
                                scales_finite=bool(torch.isfinite(s).all()), sums_nan=bool(torch.isnan(sums).all()))
    return out
