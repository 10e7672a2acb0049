"""Float64 naive references and structured test inputs shared by the tests."""

from __future__ import annotations

import math

import torch


def structured_qkv(b, h, n, d, *, nk=None, dtype=torch.float32, seed=0, sinks=3):
    """Random Q/K/V with local structure (smooth positional features) and a few global sink keys.

    Returns q (B,H,N,D), k, v (B,H,Nk,D) in ``dtype``; never zeros.
    """
    nk = n if nk is None else nk
    g = torch.Generator().manual_seed(seed)

    def pos_feat(m):
        pos = torch.arange(m, dtype=torch.float64).view(m, 1)
        freq = torch.exp(-torch.arange(d // 2, dtype=torch.float64) * (math.log(200.0) / max(1, d // 2)))
        ang = pos * freq.view(1, -1) * 0.5
        return torch.cat([torch.sin(ang), torch.cos(ang)], dim=-1)[:, :d] * 1.5

    q = torch.randn(b, h, n, d, generator=g, dtype=torch.float64) * 0.7 + pos_feat(n)
    k = torch.randn(b, h, nk, d, generator=g, dtype=torch.float64) * 0.7 + pos_feat(nk)
    v = torch.randn(b, h, nk, d, generator=g, dtype=torch.float64)
    if sinks:
        idx = torch.randperm(nk, generator=g)[:sinks]
        k[:, :, idx] += q.mean(dim=2, keepdim=True) * 2.0
    return q.to(dtype), k.to(dtype), v.to(dtype)


def ref_attention(q, k, v, allow, scale=None):
    """float64 softmax attention with a boolean allow mask (B,H,Nq,Nk); empty rows -> 0, lse -inf."""
    q, k, v = q.double(), k.double(), v.double()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = s.masked_fill(~allow, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
    p = torch.where(allow, p, torch.zeros_like(p))
    return torch.matmul(p, v), lse


def block_allow(kv_indices, kv_counts, nq, nk, block_q, block_k):
    """Dense boolean mask (B,H,Nq,Nk) equivalent to CSR block lists."""
    b, h, nqb, max_k = kv_indices.shape
    nkb = math.ceil(nk / block_k)
    blk = torch.zeros(b, h, nqb, nkb + 1, dtype=torch.bool)
    valid = torch.arange(max_k).view(1, 1, 1, -1) < kv_counts.unsqueeze(-1).long()
    idx = torch.where(valid, kv_indices.long(), torch.full_like(kv_indices.long(), nkb))
    blk.scatter_(3, idx, True)
    blk = blk[..., :nkb]
    allow = blk.repeat_interleave(block_q, 2)[:, :, :nq].repeat_interleave(block_k, 3)[..., :nk]
    return allow


def token_allow(q_groups, kv_tokens, kv_counts, nq, nk):
    """Dense boolean mask (B,H,Nq,Nk) equivalent to grouped token lists."""
    b, h, g, c = q_groups.shape
    max_k = kv_tokens.shape[-1]
    allow = torch.zeros(b, h, nq + 1, nk + 1, dtype=torch.bool)
    valid = torch.arange(max_k).view(1, 1, 1, -1) < kv_counts.unsqueeze(-1).long()
    toks = torch.where(valid, kv_tokens.long(), torch.full_like(kv_tokens.long(), nk))
    for bi in range(b):
        for hi in range(h):
            for gi in range(g):
                rows = q_groups[bi, hi, gi].long()
                rows = torch.where(rows < 0, torch.full_like(rows, nq), rows)
                allow[bi, hi, rows.view(-1, 1), toks[bi, hi, gi].view(1, -1)] = True
    allow = allow[:, :, :nq, :nk]
    return allow


def rel_l2(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def random_block_lists(b, h, nqb, nkb, max_k, *, seed=0, empty_rows=(), full_rows=()):
    """Random sorted distinct block lists with varying counts; some rows empty or full."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.full((b, h, nqb, max_k), -1, dtype=torch.int32)
    cnt = torch.zeros((b, h, nqb), dtype=torch.int32)
    for bi in range(b):
        for hi in range(h):
            for r in range(nqb):
                if r in empty_rows:
                    c = 0
                elif r in full_rows:
                    c = min(max_k, nkb)
                else:
                    c = int(torch.randint(1, min(max_k, nkb) + 1, (1,), generator=g))
                sel = torch.sort(torch.randperm(nkb, generator=g)[:c]).values
                idx[bi, hi, r, :c] = sel.int()
                cnt[bi, hi, r] = c
    return idx, cnt
