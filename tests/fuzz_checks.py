"""One fuzz check per primitive: build the case of a seed, run the primitive on a backend, compare with the float64
reference (fuzz_cases.py). Each check raises AssertionError naming the kind and seed, or returns normally.
Invalid inputs (``check_invalid``) must raise ValueError — never another exception, never a wrong answer."""

from __future__ import annotations

import torch
from fuzz_cases import (FP8, TOL, Case, block_allow, ref_masked, ref_mass, ref_pooled, residual_value, shape_draw,
                        token_allow)

from comfyui_sparse_attention import kernels as K


def _close(name, seed, out, ref, dtype, extra=0.0):
    assert out.shape == ref.shape, f"{name} seed {seed}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{name} seed {seed}: non-finite output for finite input"
    bound = TOL[dtype] * max(1.0, float(ref.abs().max()) if ref.numel() else 1.0) + extra
    err = float((out.double() - ref).abs().max()) if ref.numel() else 0.0
    assert err <= bound, f"{name} seed {seed}: max error {err:.3g} > {bound:.3g} ({dtype})"


def _res_tol(res, dtype):
    """Extra absolute error a residual may add: its cast to the output dtype."""
    if res is None:
        return 0.0
    return TOL[dtype] * float(residual_value(res, res[0].shape).abs().max())


def check_dense(seed, backend="torch"):
    c = Case(seed)
    b, h, nq, nk, d, dtype = shape_draw(c, backend == "triton")
    q, k, v = c.qkv(b, h, nq, nk, d, dtype)
    scale = c.scale(d)
    sc = d ** -0.5 if scale is None else scale
    ref, lse_ref = ref_masked(q, k, v, None, sc)
    if c.r.random() < 0.5:
        out, lse = K.attention_dense(q, k, v, scale=scale, return_lse=True, backend=backend)
        assert lse.dtype == torch.float32 and lse.shape == (b, h, nq), f"dense seed {seed}: lse {lse.shape}"
        slack = TOL[dtype] * 10 * max(1.0, float(lse_ref.abs().max()))
        _close("dense lse", seed, lse, lse_ref, torch.float32, extra=slack)
    else:
        out = K.attention_dense(q, k, v, scale=scale, backend=backend)
    assert out.dtype == dtype, f"dense seed {seed}: dtype {out.dtype}"
    _close("dense", seed, out, ref, dtype)


def check_block(seed, backend="torch"):
    c = Case(seed)
    b, h, nq, nk, d, dtype = shape_draw(c, backend == "triton")
    q, k, v = c.qkv(b, h, nq, nk, d, dtype)
    bq, bk = c.r.choice((64, 128)), c.r.choice((64, 128))
    nqb, nkb = -(-nq // bq), -(-nk // bk)
    max_k = c.r.randint(0, nkb + 2)
    idx, cnt = c.sorted_lists((b, h, nqb), nkb, max_k)
    scale = c.scale(d)
    res = c.residual(q)
    out = K.block_sparse_attention(q, k, v, idx, cnt, block_q=bq, block_k=bk, scale=scale, backend=backend,
                                   residual=res)
    ref, _ = ref_masked(q, k, v, block_allow(idx, cnt, nq, nk, bq, bk), d ** -0.5 if scale is None else scale)
    _close("block_sparse", seed, out, ref + residual_value(res, q.shape), dtype, _res_tol(res, dtype))


def check_token(seed, backend="torch"):
    c = Case(seed)
    b, h, nq, nk, d, dtype = shape_draw(c, backend == "triton")
    q, k, v = c.qkv(b, h, nq, nk, d, dtype)
    size = c.r.choice((16, 32, 64, 128) if backend == "triton" else (1, 3, 16, 64))
    groups = c.groups(b, h, nq, size)
    max_k = c.r.randint(0, nk + 2)
    toks, cnt = c.sorted_lists(tuple(groups.shape[:3]), nk, max_k)
    scale = c.scale(d)
    res = c.residual(q)
    out = K.token_sparse_attention(q, k, v, groups, toks, cnt, scale=scale, backend=backend, residual=res)
    ref, _ = ref_masked(q, k, v, token_allow(groups, toks, cnt, nq, nk), d ** -0.5 if scale is None else scale)
    _close("token_sparse", seed, out, ref + residual_value(res, q.shape), dtype, _res_tol(res, dtype))


def check_mass(seed, backend="torch"):
    c = Case(seed)
    b, h, nq, nk, d, dtype = shape_draw(c, backend == "triton")
    q, k, v = c.qkv(b, h, nq, nk, d, dtype)
    scale = c.scale(d)
    sc = d ** -0.5 if scale is None else scale
    _, lse = ref_masked(q, k, v, None, sc)
    lse = lse.float()
    if c.r.random() < 0.2:
        lse[..., : c.r.randint(0, nq)] = float("-inf")  # rows that attended nothing contribute nothing
    groups = c.groups(b, h, nq, c.r.choice((16, 32, 64, 128) if backend == "triton" else (1, 5, 64)))
    out = K.group_kv_mass(q, k, lse, groups, scale=scale, backend=backend)
    ref = ref_mass(q, k, lse, groups, sc)
    _close("group_kv_mass", seed, out, ref, dtype if dtype != torch.float32 else torch.float32,
           extra=1e-4 * float(groups.shape[-1]))


def check_grouping(seed, backend="torch"):
    c = Case(seed)
    b, h, nq, _, d, dtype = shape_draw(c, False)
    q = c.randn(b, h, nq, d, dtype=dtype)
    size = c.r.choice((3, 16, 64, 128)) if nq < 64 else c.r.choice((16, 64, 128))
    groups = K.group_queries(q, size, backend=backend)
    g = -(-nq // size)
    assert groups.shape == (b, h, g, size) and groups.dtype == torch.int32, f"grouping seed {seed}: {groups.shape}"
    flat = groups.reshape(b * h, -1)
    for row in flat:
        real = row[row >= 0]
        assert torch.equal(torch.sort(real).values, torch.arange(nq, dtype=torch.int32)), f"grouping seed {seed}"
    full = (groups >= 0).sum(-1)
    assert bool((full[..., :-1] == size).all()), f"grouping seed {seed}: a group before the last is not full"
    assert torch.equal(groups, K.group_queries(q, size, backend=backend)), f"grouping seed {seed}: not deterministic"


def check_pooled(seed, backend="torch"):
    c = Case(seed)
    b, h, nq, nk, d, dtype = shape_draw(c, False)
    q, k, _ = c.qkv(b, h, nq, nk, d, dtype)
    bq, bk = c.r.choice((64, 128)), c.r.choice((64, 128))
    scale = c.scale(d)
    out = K.pooled_block_scores(q, k, block_q=bq, block_k=bk, scale=scale, backend=backend)
    ref = ref_pooled(q, k, bq, bk, d ** -0.5 if scale is None else scale)
    _close("pooled_block_scores", seed, out, ref, torch.float32, extra=TOL[dtype])


def check_anchor(seed, backend="torch"):
    c = Case(seed)
    b, h, nq, nk, d, dtype = shape_draw(c, backend == "triton")
    q, k, v = c.qkv(b, h, nq, nk, d, dtype)
    bq, bk = c.r.choice((64, 128)), c.r.choice((64, 128))
    nqb, nkb = -(-nq // bq), -(-nk // bk)
    idx, cnt = c.sorted_lists((b, h, nqb), nkb, nkb, garbage=False)
    precision = c.r.choice(("model", "fp8")) if FP8 is not None else "model"
    out, (data, sc) = K.block_anchor_attention(q, k, v, idx, cnt, block_q=bq, block_k=bk,
                                                residual_precision=precision, backend=backend)
    scale = d ** -0.5
    dense, _ = ref_masked(q, k, v, None, scale)
    sparse, _ = ref_masked(q, k, v, block_allow(idx, cnt, nq, nk, bq, bk), scale)
    _close("anchor dense", seed, out, dense, dtype)
    r = residual_value((data, sc), q.shape)
    want = dense - sparse
    rounding = 2 ** -4 * want.abs().amax(-1, keepdim=True) if precision == "fp8" else 0.0
    err = (r - want).abs() - rounding
    bound = 4 * TOL[dtype] * max(1.0, float(want.abs().max()))
    assert float(err.max()) <= bound, f"anchor residual seed {seed}: {float(err.max()):.3g} > {bound:.3g}"


# inputs that must be refused --------------------------------------------------------------------------------
def _invalid_block(c, q, k, v):
    bq, bk = 64, 64
    nqb, nkb = -(-q.shape[2] // bq), -(-k.shape[2] // bk)
    idx, cnt = c.sorted_lists((q.shape[0], q.shape[1], nqb), nkb, nkb + 1, empty=0.0, full=0.0, garbage=False)
    kw = dict(block_q=bq, block_k=bk)
    which = c.r.randrange(11)
    if which == 0:  # an index beyond the last block, within the count
        idx[..., 0, 0] = nkb
    elif which == 1:  # a negative index within the count
        idx[..., 0, 0] = -1
    elif which == 2:  # a repeated index
        idx[..., 0, :2] = idx[..., 0, :1]
        cnt[..., 0] = cnt[..., 0].clamp(min=2)
    elif which == 3:  # a count beyond max_k
        cnt[..., 0] = idx.shape[-1] + 1
    elif which == 4:
        cnt[..., 0] = -1
    elif which == 5:
        idx = idx.float()
    elif which == 6:
        idx = idx[:, :, :-1] if nqb > 1 else idx.repeat(1, 1, 2, 1)
    elif which == 7:
        kw["block_k"] = c.r.choice((32, 128.0, True, 256))
    elif which == 8:
        kw["scale"] = c.r.choice((float("nan"), float("inf"), 0.0, -1.0))
    elif which == 9:
        kw["residual"] = c.r.choice((torch.zeros_like(q), (torch.zeros(1), None), (torch.zeros_like(q), torch.ones(1)),
                                     ((torch.zeros_like(q).to(FP8) if FP8 is not None else q[..., :1]), None)))
    else:
        idx[..., 0, :] = torch.flip(idx[..., 0, :], (-1,))
        cnt[..., 0] = cnt[..., 0].clamp(min=2)
    return lambda backend: K.block_sparse_attention(q, k, v, idx, cnt, backend=backend, **kw)


def _invalid_token(c, q, k, v):
    b, h, nq, _ = q.shape
    nk = k.shape[2]
    groups = c.groups(b, h, nq, 16, leave_out=False)
    toks, cnt = c.sorted_lists(tuple(groups.shape[:3]), nk, nk + 1, empty=0.0, full=0.0, garbage=False)
    which = c.r.randrange(8)
    if which == 0:
        groups[0, 0, 0, 0] = nq + c.r.randrange(3)
    elif which == 1:
        groups[0, 0, 0, 0] = -2
    elif which == 2:  # a query in two groups of one head
        real = groups[0, 0][groups[0, 0] >= 0]
        flat = groups[0, 0].reshape(-1)
        slot = int(torch.nonzero(flat != real[0]).view(-1)[0])
        flat[slot] = real[0]
    elif which == 3:
        toks[..., 0, 0] = nk
    elif which == 4:
        toks[..., 0, :2] = toks[..., 0, :1]
        cnt[..., 0] = cnt[..., 0].clamp(min=2)
    elif which == 5:
        cnt[..., 0] = toks.shape[-1] + 1
    elif which == 6:
        groups = groups.to(torch.int16)
    else:
        toks = toks[..., :0, :]
    return lambda backend: K.token_sparse_attention(q, k, v, groups, toks, cnt, backend=backend)


def _invalid_qkv(c, q, k, v):
    which = c.r.randrange(6)
    if which == 0:
        q = q.double()
    elif which == 1:
        k = k.to(torch.float16 if k.dtype != torch.float16 else torch.float32)
    elif which == 2:
        v = v[..., :-1]
    elif which == 3:
        q = q[:, :, :0]
    elif which == 4:
        k = k[0]
    else:
        v = v[:, :1] if v.shape[1] > 1 else v.repeat(1, 2, 1, 1)
    if which in (2, 5) or c.r.random() < 0.5:  # v is checked by the attention primitives only
        return lambda backend: K.attention_dense(q, k, v, backend=backend)
    return lambda backend: K.pooled_block_scores(q, k, block_q=64, block_k=64, backend=backend)


def _invalid_mass(c, q, k, v):
    b, h, nq, _ = q.shape
    groups = c.groups(b, h, nq, 16, leave_out=False)
    lse = torch.zeros(b, h, nq)
    which = c.r.randrange(3)
    if which == 0:
        lse = lse[..., :-1] if nq > 1 else lse.repeat(1, 1, 2)
    elif which == 1:
        groups[0, 0, 0, 0] = nq
    else:
        groups = groups.float()
    return lambda backend: K.group_kv_mass(q, k, lse, groups, backend=backend)


def check_invalid(seed, backend="torch"):
    """A corrupted call must raise ValueError (the message names the argument), nothing else."""
    c = Case(seed)
    b, h, nq, nk, d, dtype = shape_draw(c, backend == "triton")
    nq, nk = max(nq, 2), max(nk, 2)
    q, k, v = c.qkv(b, h, nq, nk, d, dtype)
    make = c.r.choice((_invalid_block, _invalid_token, _invalid_qkv, _invalid_mass))
    call = make(c, q, k, v)
    try:
        call(backend)
    except ValueError:
        return
    except Exception as exc:  # noqa: BLE001 - the finding: a corrupted call raised something else
        raise AssertionError(f"invalid seed {seed} ({make.__name__}): raised {type(exc).__name__}: {exc}") from exc
    raise AssertionError(f"invalid seed {seed} ({make.__name__}): a corrupted call did not raise")


CHECKS = dict(dense=check_dense, block=check_block, token=check_token, mass=check_mass, grouping=check_grouping,
              pooled=check_pooled, anchor=check_anchor, invalid=check_invalid)
