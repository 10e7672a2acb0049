"""Anchor attention for block selections in one Triton pass (Hopper TMA kernel of ``attention_hopper``).

Each query block walks its selected KV blocks first: that online-softmax state is the sparse output
(exact). The same state then continues over the complement blocks, giving the dense output and row LSE.
The residual R = dense - sparse is formed from both outputs rounded to the model's dtype (the sparse one waits in
the output tensor during the second walk), as the twin forms it, and stored in the model's dtype or as fp8 with a
per-row scale. So an anchor costs one dense pass instead of dense + sparse + a residual pass.
Twin of ``anchor_torch.block_anchor_attention``.

At low densities one cuDNN dense call plus the block-sparse kernel is cheaper than this pass, which runs at the
sparse kernel's rate over every block: ``block_residual`` is that path's second half, the residual formed in
the sparse kernel's epilogue from the dense output (twin ``anchor_torch.block_residual``; kernels/api.py
chooses; docs/kernel_notes.md, "Anchor: fused pass or dense call plus residual epilogue").
"""

from __future__ import annotations

import torch

from . import _hopper
from ._checks import check_qkv, check_scale
from ._residual import FP8, RESIDUAL_PRECISIONS
from ._triton_common import last_dim_contiguous
from .block_sparse_torch import check_block_lists

PATHS = ("auto", "tma", "persistent", "warp_spec", "gluon")


def supported(k: torch.Tensor, v: torch.Tensor) -> bool:
    """The fused kernel can run here (Hopper, TMA-aligned K/V, compiled before or not yet tried)."""
    return _hopper.use_tma("anchor", k, v)


def block_anchor_attention(q, k, v, kv_indices, kv_counts, *, block_q, block_k, scale=None,
                           residual_precision="model", return_lse=False, validate=True, path="auto",
                           return_mass=False):
    """Fused anchor attention; arguments and results as in the PyTorch twin (``return_mass``: the residual is a
    (r_data, r_scale, mass) triple, mass fp32 (B,H,Nq,2) written by the same pass).

    q: (B,H,Nq,D); k, v: (B,H,Nk,D) with 16-byte aligned bases and strides; kv_indices int32
    (B,H,ceil(Nq/block_q),max_k) sorted; kv_counts int32 (B,H,ceil(Nq/block_q)).
    Returns (out_dense, (r_data, r_scale)) or, with return_lse, (out_dense, lse, (r_data, r_scale)).
    path: "auto"/"tma" (one program per query block), "persistent", "warp_spec" (the TMA kernel's pass); "gluon"
    (kernels/anchor_gluon.py: block_q 128, block_k 64 or 128, D 64 or 128, fp16/bf16; ValueError naming what it cannot
    take). Compile failures raise (the caller, kernels/api.py, falls back to the composed path).
    """
    from . import attention_hopper
    b, h, nq, nk, d = check_qkv(q, k, v)
    scale = check_scale(scale, d)
    _, n_kblk, _ = check_block_lists(q, k, kv_indices, kv_counts, block_q, block_k, validate)
    if residual_precision not in RESIDUAL_PRECISIONS:
        raise ValueError(f"residual_precision must be one of {RESIDUAL_PRECISIONS}, got {residual_precision!r}")
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    fp8 = residual_precision == "fp8"
    if fp8 and FP8 is None:
        raise ValueError("residual_precision='fp8' needs torch.float8_e4m3fn")
    gluon = path == "gluon" and _hopper.use_gluon("gluon_anchor", q, k, v, block_q, block_k, path="gluon")
    why = None if gluon or _hopper.interpreting() else _hopper.tma_problem((k, v), _hopper.device_capability(k))
    if why is not None:
        raise ValueError(f"block_anchor_attention: the fused kernel cannot run: {why}")
    idx = kv_indices.to(torch.int32).contiguous()
    cnt = kv_counts.to(torch.int32).contiguous()
    cmp_idx, cmp_cnt = attention_hopper.complement_lists(idx, cnt, n_kblk)
    # rows in natural order: every row does the same dense work, and neighbours share K/V in L2
    out = torch.empty((b, h, nq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, nq), dtype=torch.float32, device=q.device) if return_lse else None
    r_data = torch.empty((b, h, nq, d), dtype=FP8 if fp8 else q.dtype, device=q.device)
    r_scale = torch.empty((b, h, nq, 1), dtype=torch.float32, device=q.device) if fp8 else None
    mass = torch.empty((b, h, nq, 2), dtype=torch.float32, device=q.device) if return_mass else None
    if gluon:
        from . import anchor_gluon
        anchor_gluon.anchor(q, k, v, idx, cnt, cmp_idx, cmp_cnt, out, r_data, scale=scale, block_k=block_k, lse=lse,
                            r_scale=r_scale, mass=mass)
    else:
        kind = "anchor" if path in ("auto", "tma") else path
        attention_hopper.launch(kind, q, k, v, out, scale=scale, block_q=block_q, block_k=block_k,
                                mode=attention_hopper.MODE_ANCHOR, lse=lse, res_out=(r_data, r_scale), res_fp8=fp8,
                                idx=idx, cnt=cnt, cmp_idx=cmp_idx, cmp_cnt=cmp_cnt, mass=mass)
    res = (r_data, r_scale) if mass is None else (r_data, r_scale, mass)
    return (out, lse, res) if return_lse else (out, res)


def block_residual(q, k, v, kv_indices, kv_counts, dense, lse, *, block_q, block_k, scale=None,
                   residual_precision="model", validate=True, return_mass=False):
    """R = dense - block-sparse formed in the TMA block-sparse kernel's epilogue; arguments and results as in the
    PyTorch twin (``anchor_torch.block_residual``).

    q: (B,H,Nq,D); k, v: (B,H,Nk,D) with 16-byte aligned bases and strides; kv_indices int32
    (B,H,ceil(Nq/block_q),max_k) sorted; kv_counts int32 (B,H,ceil(Nq/block_q)); dense (B,H,Nq,D) in q's dtype,
    any strides; lse fp32 (B,H,Nq) natural log (read only with return_mass). Returns (r_data, r_scale) or with
    return_mass (r_data, r_scale, mass fp32 (B,H,Nq,2)). Compile failures raise (kernels/api.py falls back to the
    PyTorch residual pass).
    """
    from . import attention_hopper
    from .block_sparse_triton import heavy_first_order
    b, h, nq, nk, d = check_qkv(q, k, v)
    scale = check_scale(scale, d)
    check_block_lists(q, k, kv_indices, kv_counts, block_q, block_k, validate)
    if tuple(dense.shape) != (b, h, nq, d) or dense.dtype != q.dtype or dense.device != q.device:
        raise ValueError(f"dense must be {(b, h, nq, d)} {q.dtype} on {q.device}, got {tuple(dense.shape)} "
                         f"{dense.dtype} on {dense.device}")
    if return_mass and (lse is None or tuple(lse.shape) != (b, h, nq)):
        raise ValueError(f"return_mass needs the dense LSE of shape {(b, h, nq)}, got "
                         f"{None if lse is None else tuple(lse.shape)}")
    if residual_precision not in RESIDUAL_PRECISIONS:
        raise ValueError(f"residual_precision must be one of {RESIDUAL_PRECISIONS}, got {residual_precision!r}")
    why = _hopper.tma_problem((k, v), _hopper.device_capability(k)) if not _hopper.interpreting() else None
    if why is not None:
        raise ValueError(f"block_residual: the TMA kernel cannot run: {why}")
    fp8 = residual_precision == "fp8"
    if fp8 and FP8 is None:
        raise ValueError("residual_precision='fp8' needs torch.float8_e4m3fn")
    (dense,) = last_dim_contiguous(dense)
    idx = kv_indices.to(torch.int32).contiguous()
    cnt = kv_counts.to(torch.int32).contiguous()
    r_data = torch.empty((b, h, nq, d), dtype=FP8 if fp8 else q.dtype, device=q.device)
    r_scale = torch.empty((b, h, nq, 1), dtype=torch.float32, device=q.device) if fp8 else None
    mass = torch.empty((b, h, nq, 2), dtype=torch.float32, device=q.device) if return_mass else None
    lse_in = lse.to(torch.float32).contiguous() if return_mass else None
    attention_hopper.launch("sparse", q, k, v, r_data, scale=scale, block_q=block_q, block_k=block_k,
                            mode=attention_hopper.MODE_RESIDUAL, lse=lse_in, res=(dense, None),
                            res_out=(r_data, r_scale), res_fp8=fp8, idx=idx, cnt=cnt, order=heavy_first_order(cnt),
                            mass=mass)
    return (r_data, r_scale) if mass is None else (r_data, r_scale, mass)
