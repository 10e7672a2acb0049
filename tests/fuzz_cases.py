"""Fuzzed cases of the attention primitives and their float64 references (tests/test_fuzz_primitives.py, and the
Triton interpreter run in tests/test_fuzz_triton.py). Every case is built from one integer seed, so a failure
names the seed that reproduces it: ``make_case(kind, seed)``.

Shapes are small (N up to ~200) so thousands of cases run in seconds; the references are vectorised float64
masked softmax over dense allow masks built from the index lists.
"""

from __future__ import annotations

import math
import random

import torch

DTYPES = (torch.float32, torch.float32, torch.bfloat16, torch.float16)
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}
FP8 = getattr(torch, "float8_e4m3fn", None)


# references -------------------------------------------------------------------------------------------------
def ref_masked(q, k, v, allow, scale):
    """float64 softmax attention over ``allow`` (B, H, Nq, Nk); rows with no key: out 0, lse -inf."""
    s = torch.matmul(q.double(), k.double().transpose(-1, -2)) * scale
    if allow is not None:
        s = s.masked_fill(~allow, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
    if allow is not None:
        p = torch.where(allow, p, torch.zeros_like(p))
    return torch.matmul(p, v.double()), lse


def block_allow(idx, cnt, nq, nk, bq, bk):
    """(B, H, Nq, Nk) mask of CSR block lists; entries past each count are ignored whatever they hold."""
    b, h, nqb, mk = idx.shape
    nkb = -(-nk // bk)
    valid = torch.arange(mk) < cnt.unsqueeze(-1).long()
    col = torch.where(valid, idx.long(), torch.full_like(idx.long(), nkb))
    blk = torch.zeros(b, h, nqb, nkb + 1, dtype=torch.bool).scatter_(3, col, True)[..., :nkb]
    return blk.repeat_interleave(bq, 2)[:, :, :nq].repeat_interleave(bk, 3)[..., :nk]


def token_allow(groups, toks, cnt, nq, nk):
    """(B, H, Nq, Nk) mask of grouped token lists; queries in no group attend nothing."""
    b, h, g, c = groups.shape
    mk = toks.shape[-1]
    valid = torch.arange(mk) < cnt.unsqueeze(-1).long()
    col = torch.where(valid, toks.long(), torch.full_like(toks.long(), nk))
    per_group = torch.zeros(b, h, g + 1, nk + 1, dtype=torch.bool)
    per_group[:, :, :g].scatter_(3, col, True)
    rows = torch.where(groups < 0, torch.full_like(groups.long(), nq), groups.long()).reshape(b, h, g * c)
    group_of = torch.full((b, h, nq + 1), g, dtype=torch.long)
    group_of.scatter_(2, rows, torch.arange(g).repeat_interleave(c).expand(b, h, -1).contiguous())
    return per_group[..., :nk].gather(2, group_of[:, :, :nq, None].expand(-1, -1, -1, nk))


def ref_mass(q, k, lse, groups, scale):
    """float64 mass[b, h, g, j] = sum over the real queries i of group g of exp(s_ij - lse_i)."""
    s = torch.matmul(q.double(), k.double().transpose(-1, -2)) * scale
    lse = lse.double()
    p = torch.exp(s - torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse).unsqueeze(-1))
    b, h, g, c = groups.shape
    nq = q.shape[2]
    onehot = torch.zeros(b, h, g, nq + 1, dtype=torch.float64)
    rows = torch.where(groups < 0, torch.full_like(groups.long(), nq), groups.long())
    onehot.scatter_(3, rows, 1.0)
    return torch.matmul(onehot[..., :nq], p)


def ref_pooled(q, k, bq, bk, scale):
    def means(x, blk):
        n = x.shape[2]
        nb = -(-n // blk)
        pad = torch.zeros(*x.shape[:2], nb * blk, x.shape[3], dtype=torch.float64)
        pad[:, :, :n] = x.double()
        sizes = torch.full((nb,), float(blk), dtype=torch.float64)
        sizes[-1] = n - (nb - 1) * blk
        return pad.view(*x.shape[:2], nb, blk, x.shape[3]).sum(3) / sizes.view(1, 1, nb, 1)
    return torch.softmax(torch.matmul(means(q, bq), means(k, bk).transpose(-1, -2)) * scale, dim=-1)


def residual_value(res, shape):
    """The float64 value a (data, scale) residual adds, or zeros."""
    if res is None:
        return torch.zeros(shape, dtype=torch.float64)
    data, sc = res
    return data.double() if sc is None else data.double() * sc.double()


# case generation --------------------------------------------------------------------------------------------
class Case:
    """Random draws of one fuzz case (Python's RNG for structure, a torch Generator for values)."""

    def __init__(self, seed: int):
        self.seed = seed
        self.r = random.Random(seed)
        self.g = torch.Generator().manual_seed(seed)

    def randn(self, *shape, dtype=torch.float32, std=1.0):
        return (torch.randn(*shape, generator=self.g, dtype=torch.float64) * std).to(dtype)

    def qkv(self, b, h, nq, nk, d, dtype):
        spread = self.r.choice((0.3, 1.0, 3.0))  # flat to peaked softmax rows
        q = self.randn(b, h, nq, d, dtype=dtype, std=spread)
        k = self.randn(b, h, nk, d, dtype=dtype, std=spread)
        v = self.randn(b, h, nk, d, dtype=dtype)
        if self.r.random() < 0.2 and nk > 1:  # duplicated keys (ties)
            j = self.r.randrange(nk)
            k[:, :, :] = torch.where(torch.rand(nk, generator=self.g).view(1, 1, -1, 1) < 0.3, k[:, :, j:j + 1], k)
        return q, k, v

    def scale(self, d):
        return None if self.r.random() < 0.5 else self.r.uniform(0.02, 1.5) / math.sqrt(d) * math.sqrt(16)

    def sorted_lists(self, rows_shape, universe, max_k, empty=0.15, full=0.1, garbage=True):
        """Sorted distinct lists (rows_shape..., max_k) int32 of values < universe and their counts; entries past
        a count hold -1 or garbage (any value: the primitives must ignore them)."""
        n_rows = math.prod(rows_shape)
        idx = torch.full((n_rows, max_k), -1, dtype=torch.int32)
        cnt = torch.zeros(n_rows, dtype=torch.int32)
        most = min(max_k, universe)
        for row in range(n_rows):
            u = self.r.random()
            c = 0 if u < empty or most == 0 else most if u < empty + full else self.r.randint(1, most)
            if c:
                idx[row, :c] = torch.tensor(sorted(self.r.sample(range(universe), c)), dtype=torch.int32)
            if garbage and c < max_k and self.r.random() < 0.3:
                idx[row, c:] = torch.randint(-5, universe + 5, (max_k - c,), generator=self.g, dtype=torch.int32)
            cnt[row] = c
        return idx.view(*rows_shape, max_k), cnt.view(*rows_shape)

    def groups(self, b, h, nq, c, leave_out=True):
        """(B, H, G, C) int32 query groups: a random partition of the queries (some left out), -1 pads."""
        g = max(1, -(-nq // c) + (1 if self.r.random() < 0.2 else 0))
        out = torch.full((b * h, g * c), -1, dtype=torch.int32)
        for row in range(b * h):
            members = list(range(nq))
            if leave_out and self.r.random() < 0.3:
                members = [m for m in members if self.r.random() < 0.8]
            self.r.shuffle(members)
            slots = self.r.sample(range(g * c), len(members))
            out[row, torch.tensor(slots, dtype=torch.long)] = torch.tensor(members, dtype=torch.int32)
        return out.view(b, h, g, c)

    def residual(self, q):
        """None, a model-dtype residual, or an fp8 residual with a per-row scale (kernels/_residual.py)."""
        u = self.r.random()
        if u < 0.5:
            return None
        data = self.randn(*q.shape, std=0.3)
        if u < 0.75 or FP8 is None:
            return data.to(q.dtype), None
        scale = data.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
        return (data / scale).to(FP8), scale.float()


def tokens(c: Case, triton: bool) -> int:
    """A sequence length: mostly short (the cost is quadratic), sometimes past one or two 128-token blocks."""
    u = c.r.random()
    if u < 0.7:
        return c.r.randint(1, 48)
    if u < 0.95:
        return c.r.randint(49, 140)
    return c.r.randint(141, 160 if triton else 260)


def shape_draw(c: Case, triton: bool):
    """(B, H, Nq, Nk, D, dtype) of a case; B * H <= 4."""
    b = c.r.choice((1, 1, 2))
    h = c.r.choice((1, 2)) if b == 2 else c.r.choice((1, 2, 3, 4))
    d = c.r.choice((64, 80, 96, 128) if triton else (8, 16, 32, 32, 64, 80))
    nq = tokens(c, triton)
    nk = nq if c.r.random() < 0.6 else tokens(c, triton)
    dtype = c.r.choice((torch.float32, torch.float16)) if triton else c.r.choice(DTYPES)
    return b, h, nq, nk, d, dtype
