"""ComfyUI's Sol-Attn (``comfy_kitchen.sol_attn``, top-k mode) as a plain attention function, for the benches
(bench/e2e.py through ComfyUI's attention override, bench/quality.py on the quality testbed)."""

from __future__ import annotations

import torch


def sol_unavailable() -> str | None:
    """None when comfy_kitchen imports, else the reason."""
    try:
        import comfy_kitchen  # noqa: F401
    except ImportError as exc:
        return f"comfy_kitchen is not importable ({exc})"
    return None


def sol_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, density: float, scale=None) -> torch.Tensor:
    """Sol-Attn keeping ``density`` of the key blocks per query block (``topk_ratio``).

    q, k, v: (B, H, N, 128) on CUDA (bf16 / fp16; other dtypes run in bf16); scale: None = 1/sqrt(D).
    Returns (B, H, N, 128) in q's dtype."""
    import comfy_kitchen as ck

    dt = q.dtype if q.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    qt, kt, vt = (t.transpose(1, 2).to(dt).contiguous() for t in (q, k, v))  # (B, N, H, D)
    extra = {"scale": scale} if scale is not None else {}
    return ck.sol_attn(qt, kt, vt, topk_ratio=density, **extra).to(q.dtype).transpose(1, 2)
