"""Triton kernels under the CPU interpreter (TRITON_INTERPRET=1), compared with their PyTorch twins.

fp16 and fp32 only: the interpreter's bf16 ``tl.dot`` is wrong (triton issue #11584). Each case runs in
a child process because TRITON_INTERPRET is read when the kernels are defined; the children run two at a time
(the ``children`` fixture).
"""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.skipif(__import__("importlib").util.find_spec("triton") is None,
                                reason="Triton not installed")

# Each child process imports the repository as the package (as ComfyUI does) and the tests' references.
PREAMBLE = r"""
import importlib.util, json, sys, torch
spec = importlib.util.spec_from_file_location("comfyui_sparse_attention", sys.argv[1] + "/__init__.py",
                                              submodule_search_locations=[sys.argv[1]])
pack = importlib.util.module_from_spec(spec); sys.modules["comfyui_sparse_attention"] = pack
spec.loader.exec_module(pack)
sys.path.insert(0, sys.argv[1] + "/tests")
"""


def run_child(code: str, timeout: int, **env) -> object:
    """Run ``code`` (PREAMBLE + a body printing ``RESULT:<json>``) in a child under the Triton interpreter, with
    ``env`` added to the environment (it may override TRITON_INTERPRET too); returns the parsed result (the child's
    stderr on failure)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", **env}
    proc = subprocess.run([sys.executable, "-c", code, str(ROOT)], env=env, capture_output=True, text=True,
                          timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT:")]
    assert proc.returncode == 0 and lines, proc.stderr[-6000:]
    return json.loads(lines[-1][7:])


@pytest.fixture(scope="module")
def children(request):
    """The child processes of this module's selected tests (CHILDREN), started together when the first of those
    tests runs and run two at a time, longest first (each is one single-threaded interpreter process):
    {test name: future of ``run_child``'s result}."""
    from concurrent.futures import ThreadPoolExecutor
    selected = {item.originalname for item in request.session.items if item.module is request.module}
    pool = ThreadPoolExecutor(max_workers=2)
    futures = {name: pool.submit(run_child, code, timeout, **env)
               for name, (code, timeout, env) in CHILDREN.items() if name in selected}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture
def child(children, request):
    """This test's child result (a failed child fails the test with its stderr)."""
    return children[request.node.originalname].result()


CHILD = PREAMBLE + r"""
from sparse_ref import structured_qkv, random_block_lists, rel_l2
from comfyui_sparse_attention import kernels as K
results = {}

def cmp(name, a, b):
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    errs = []
    for x, y in zip(a, b):
        fin = torch.isfinite(y)
        same_inf = bool(torch.equal(torch.isneginf(x), torch.isneginf(y)))
        errs.append(dict(rel=rel_l2(torch.where(fin, x.double(), 0), torch.where(fin, y.double(), 0)),
                         nan=bool(torch.isnan(x).any()), same_inf=same_inf))
    results[name] = errs

for dtype in (torch.float16, torch.float32):
    for (n, nk, d) in ((200, 200, 64), (130, 77, 80), (193, 193, 128), (128, 256, 64)):
        q, k, v = structured_qkv(1, 2, n, d, nk=nk, dtype=dtype, seed=n + d)
        tag = f"{dtype}-{n}-{nk}-{d}"
        cmp("dense-" + tag, K.attention_dense(q, k, v, return_lse=True, backend="triton"),
            K.attention_dense(q, k, v, return_lse=True, backend="torch"))
        for bq, bk in ((64, 64), (64, 128), (128, 64)):
            nqb, nkb = -(-n // bq), -(-nk // bk)
            idx, cnt = random_block_lists(1, 2, nqb, nkb, nkb, seed=bq + bk, empty_rows=(1,), full_rows=(0,))
            args = (q, k, v, idx, cnt)
            kw = dict(block_q=bq, block_k=bk)
            cmp(f"bsa-{bq}-{bk}-" + tag, K.block_sparse_attention(*args, backend="triton", **kw),
                K.block_sparse_attention(*args, backend="torch", **kw))
        groups = K.group_queries(q, 64)
        g = groups.shape[2]
        gen = torch.Generator().manual_seed(1)
        toks = torch.full((1, 2, g, 90), -1, dtype=torch.int32); cnt = torch.zeros(1, 2, g, dtype=torch.int32)
        for h in range(2):
            for gi in range(g):
                c = 0 if gi == 1 else int(torch.randint(1, min(90, nk) + 1, (1,), generator=gen))
                toks[0, h, gi, :c] = torch.sort(torch.randperm(nk, generator=gen)[:c]).values.int(); cnt[0, h, gi] = c
        cmp("token-" + tag, K.token_sparse_attention(q, k, v, groups, toks, cnt, backend="triton"),
            K.token_sparse_attention(q, k, v, groups, toks, cnt, backend="torch"))
        _, lse = K.attention_dense(q, k, v, return_lse=True, backend="torch")
        lse[0, 0, :5] = float("-inf")
        cmp("mass-" + tag, K.group_kv_mass(q, k, lse, groups, backend="triton"),
            K.group_kv_mass(q, k, lse, groups, backend="torch"))
        sub = groups[..., ::4].contiguous()  # groups of 16 (mass_queries): 4 or 8 a program, padded to 8
        cmp("mass16-" + tag, K.group_kv_mass(q, k, lse, sub, backend="triton"),
            K.group_kv_mass(q, k, lse, sub, backend="torch"))
print("RESULT:" + json.dumps(results))
"""


def test_triton_kernels_match_twins_in_interpreter(child):
    results = child
    assert len(results) == 2 * 4 * 7
    bad = {}
    for name, errs in results.items():
        tol = 2e-3 if "float16" in name else 1e-5
        for e in errs:
            if e["nan"] or not e["same_inf"] or e["rel"] > tol:
                bad[name] = errs
    assert not bad, bad


INFERENCE_CHILD = PREAMBLE + r"""
from sparse_ref import structured_qkv, random_block_lists, rel_l2
from comfyui_sparse_attention import kernels as K
from comfyui_sparse_attention.kernels import block_sparse_triton as T
with torch.inference_mode():  # as ComfyUI samples: the cached lists are inference tensors (no version counter)
    q, k, v = structured_qkv(1, 2, 256, 64, seed=4)
    idx, cnt = random_block_lists(1, 2, 4, 4, 4, seed=2, empty_rows=(1,), full_rows=(0,))
    idx, cnt = idx.to(torch.int32).contiguous(), cnt.to(torch.int32).contiguous()
    first = K.block_sparse_attention(q, k, v, idx, cnt, block_q=64, block_k=64, backend="triton", validate=False)
    memo = getattr(cnt, T._ORDER_ATTR)[1]
    second = K.block_sparse_attention(q, k, v, idx, cnt, block_q=64, block_k=64, backend="triton", validate=False)
    twin = K.block_sparse_attention(q, k, v, idx, cnt, block_q=64, block_k=64, backend="torch")
    out = dict(inference=cnt.is_inference(), same_memo=getattr(cnt, T._ORDER_ATTR)[1] is memo,
               equal=bool(torch.equal(first, second)), rel=rel_l2(second.double(), twin.double()),
               order=memo.tolist(), counts=cnt.reshape(-1).tolist())
print("RESULT:" + json.dumps(out))
"""


def test_block_sparse_triton_path_under_inference_mode_in_interpreter(child):
    """The Triton wrapper's remembered row order works on inference tensors (ComfyUI samples under
    torch.inference_mode; they have no version counter) and is reused on the next call."""
    r = child
    assert r["inference"] and r["same_memo"] and r["equal"] and r["rel"] <= 1e-5
    counts = r["counts"]
    assert sorted(r["order"]) == list(range(len(counts)))  # a permutation of the rows, heaviest first
    assert [counts[i] for i in r["order"]] == sorted(counts, reverse=True)


HOPPER_CHILD = PREAMBLE + r"""
import math
from sparse_ref import structured_qkv, random_block_lists, rel_l2
from comfyui_sparse_attention import kernels as K
from comfyui_sparse_attention.kernels import (_hopper, anchor_torch, anchor_triton, attention_hopper,
                                              block_sparse_torch, block_sparse_triton, dense_torch, dense_triton,
                                              mass_triton, selection_torch, token_sparse_torch, token_sparse_triton)
from comfyui_sparse_attention.kernels._residual import encode_residual
results, flags = {}, {}

def rel(name, a, b):
    results[name] = dict(rel=rel_l2(a.double(), b.double()), nan=bool(torch.isnan(a.float()).any()))

def decode(r):
    return r[0].float() if r[1] is None else r[0].float() * r[1]

def make_residual(kind, q, seed):
    if kind == "none":
        return None
    g = torch.Generator().manual_seed(seed)
    diff = torch.randn(q.shape, generator=g) * 0.3
    return encode_residual(diff, "fp8" if kind == "fp8" else "model", q.dtype)

for dtype in (torch.float16, torch.float32):
    for ci, (n, nk, d) in enumerate(((200, 200, 64), (130, 77, 80), (193, 193, 128))):
        q, k, v = structured_qkv(1, 2, n, d, nk=nk, dtype=dtype, seed=n + d)
        tag = f"{dtype}-{n}-{nk}-{d}"
        for bi, (bq, bk) in enumerate(((64, 64), (64, 128), (128, 64))):
            nqb, nkb = -(-n // bq), -(-nk // bk)
            # skewed rows: one full row, one empty row, random counts elsewhere
            idx, cnt = random_block_lists(1, 2, nqb, nkb, nkb, seed=bq + bk, empty_rows=(1,), full_rows=(0,))
            kw = dict(block_q=bq, block_k=bk)
            res = make_residual(("none", "model", "fp8")[(ci + bi) % 3], q, seed=bi)
            ref = block_sparse_torch.block_sparse_attention(q, k, v, idx, cnt, residual=res, **kw)
            for path in ("pointer", "tma", "persistent", "warp_spec"):
                out = block_sparse_triton.block_sparse_attention(q, k, v, idx, cnt, residual=res, path=path, **kw)
                rel(f"bsa-{path}-{bq}-{bk}-{'res' if res else 'nores'}-" + tag, out, ref)
                empty = out[0, 0, bq:2 * bq]  # query block 1 of head 0 has an empty list
                want = torch.zeros_like(empty) if res is None else decode(res)[0, 0, bq:2 * bq].to(dtype)
                flags[f"empty-exact-{path}-{bq}-{bk}-" + tag] = bool(torch.equal(empty, want))
            for prec in ("model", "fp8"):
                for path in ("tma", "persistent"):
                    o, lse, r = anchor_triton.block_anchor_attention(q, k, v, idx, cnt, residual_precision=prec,
                                                                     return_lse=True, path=path, **kw)
                    ro, rlse, rr = anchor_torch.block_anchor_attention(q, k, v, idx, cnt, residual_precision=prec,
                                                                       return_lse=True, **kw)
                    rel(f"anchor-out-{path}-{prec}-{bq}-{bk}-" + tag, o, ro)
                    rel(f"anchor-lse-{path}-{prec}-{bq}-{bk}-" + tag, lse, rlse)
                    rel(f"anchor-res-{path}-{prec}-{bq}-{bk}-" + tag, decode(r), decode(rr))
                # the composed anchor's second half: R = a given dense output - sparse, in the TMA kernel's epilogue
                dense, dlse = dense_torch.attention_dense(q, k, v, return_lse=True)
                # the kernel reads the dense output by its own strides: here (B, N, H, D) in memory, as cuDNN gives
                # it for ComfyUI's transposed q, not the residual's (B, H, N, D)
                dense_bnhd = dense.transpose(1, 2).contiguous().transpose(1, 2)
                got = anchor_triton.block_residual(q, k, v, idx, cnt, dense_bnhd, dlse, residual_precision=prec,
                                                   return_mass=True, **kw)
                want = anchor_torch.block_residual(q, k, v, idx, cnt, dense, dlse, residual_precision=prec,
                                                   return_mass=True, **kw)
                rel(f"anchor-res-epilogue-{prec}-{bq}-{bk}-" + tag, decode(got[:2]), decode(want[:2]))
                # rows that left out at least 0.1 % of the mass (below it the weight scales a residual that small)
                live = (want[2][..., 1] > math.log(1e-3)) & (got[2][..., 1] > math.log(1e-3))
                flags[f"epilogue-mass-{prec}-{bq}-{bk}-" + tag] = dict(
                    live=float(live.float().mean()), nan=bool(torch.isnan(got[2]).any()),
                    err=float((got[2] - want[2])[live].abs().max()) if live.any() else 0.0)
        out, lse = dense_triton.attention_dense(q, k, v, return_lse=True, path="tma")
        ro, rlse = dense_torch.attention_dense(q, k, v, return_lse=True)
        rel("dense-tma-out-" + tag, out, ro)
        rel("dense-tma-lse-" + tag, lse, rlse)
        groups = K.group_queries(q, 64)
        g = groups.shape[2]
        gen = torch.Generator().manual_seed(1)
        toks = torch.full((1, 2, g, 90), -1, dtype=torch.int32); tcnt = torch.zeros(1, 2, g, dtype=torch.int32)
        for h in range(2):
            for gi in range(g):
                c = 0 if gi == 1 else int(torch.randint(1, min(90, nk) + 1, (1,), generator=gen))
                toks[0, h, gi, :c] = torch.sort(torch.randperm(nk, generator=gen)[:c]).values.int(); tcnt[0, h, gi] = c
        lost = groups.clone()
        lost[0, 1, 0] = -1  # head 1's first group is gone: its queries are in no group
        for kind in ("model", "fp8"):
            res = make_residual(kind, q, seed=7)
            out = token_sparse_triton.token_sparse_attention(q, k, v, lost, toks, tcnt, residual=res)
            ref = token_sparse_torch.token_sparse_attention(q, k, v, lost, toks, tcnt, residual=res)
            rel(f"token-res-{kind}-" + tag, out, ref)
            rows = groups[0, 1, 0].long(); rows = rows[rows >= 0]
            want = decode(res)[0, 1, rows].to(dtype)
            flags[f"token-nogroup-exact-{kind}-" + tag] = bool(torch.equal(out[0, 1, rows], want))
        _, lse = dense_torch.attention_dense(q, k, v, return_lse=True)
        lse[0, 0, :5] = float("-inf")
        ref = selection_torch.group_kv_mass(q, k, lse, groups)
        for path in ("pointer", "tma"):
            rel(f"mass-{path}-" + tag, mass_triton.group_kv_mass(q, k, lse, groups, path=path), ref)
            sub = groups[..., ::4].contiguous()
            rel(f"mass16-{path}-" + tag, mass_triton.group_kv_mass(q, k, lse, sub, path=path),
                selection_torch.group_kv_mass(q, k, lse, sub))

# dispatch: the TMA kernel runs only where kernels/_hopper.py allows it; failures fall back in auto only
q, k, v = structured_qkv(1, 2, 130, 64, dtype=torch.float16, seed=5)
idx, cnt = random_block_lists(1, 2, 3, 3, 3, seed=2)
calls = []
real_launch = attention_hopper.launch
def spy(*a, **kw):
    calls.append(a[0])
    return real_launch(*a, **kw)
attention_hopper.launch = spy
_hopper.interpreting = lambda: False
for cap, name in (((9, 0), "hopper"), ((8, 9), "ada"), ((10, 0), "blackwell")):
    _hopper.device_capability = lambda t, cap=cap: cap
    calls.clear()
    block_sparse_triton.block_sparse_attention(q, k, v, idx, cnt, block_q=64, block_k=64)
    flags[f"dispatch-{name}"] = list(calls)
_hopper.device_capability = lambda t: (9, 0)
wide = torch.zeros(1, 2, 130, 68, dtype=torch.float16)  # row stride 136 bytes
wide[..., :64] = k
calls.clear()
block_sparse_triton.block_sparse_attention(q, wide[..., :64], v, idx, cnt, block_q=64, block_k=64)
flags["dispatch-misaligned-stride"] = list(calls)
def broken(*a, **kw):
    raise RuntimeError("PassManager::run failed")
attention_hopper.launch = broken
out = block_sparse_triton.block_sparse_attention(q, k, v, idx, cnt, block_q=64, block_k=64)
ref = block_sparse_torch.block_sparse_attention(q, k, v, idx, cnt, block_q=64, block_k=64)
flags["fallback-after-failure"] = dict(rel=rel_l2(out.double(), ref.double()), broken=sorted(_hopper.broken()))
try:
    block_sparse_triton.block_sparse_attention(q, k, v, idx, cnt, block_q=64, block_k=64, path="tma")
    flags["explicit-failure-raises"] = False
except RuntimeError:
    flags["explicit-failure-raises"] = True
print("RESULT:" + json.dumps(dict(results=results, flags=flags)))
"""


def test_hopper_kernels_residual_anchor_and_mass_in_interpreter(child):
    """TMA kernels (block-sparse: tma, persistent, warp_spec; dense+LSE; anchor), the pointer kernel and
    token kernel with fused residuals, and both mass paths, against their twins; dispatch and fallback."""
    got = child
    results, flags = got["results"], got["flags"]
    # 2 dtypes x 3 shapes x (3 block configs x (4 paths + 2 precisions x (2 paths x 3 + epilogue residual)) + 2 dense
    # + 2 token + 2 mass + 2 mass of packed groups of 16)
    assert len(results) == 2 * 3 * (3 * (4 + 14) + 8)
    bad = {}
    for name, e in results.items():
        tol = 2e-3 if "float16" in name else 1e-5
        if name.startswith("anchor-res-"):
            # the twin forms R from outputs rounded to the dtype, the kernel in fp32; fp8 rounding then
            # turns such differences into whole fp8 steps (2**-4 of a value) for a few elements
            tol = 4e-2 if "-fp8-" in name else (2e-3 if "float16" in name else 1e-5)
        if e["nan"] or e["rel"] > tol:
            bad[name] = e
    assert not bad, bad
    mass = {k: v for k, v in flags.items() if k.startswith("epilogue-mass-")}
    assert len(mass) == 2 * 3 * 3 * 2
    bad = {k: e for k, e in mass.items() if e["nan"] or e["err"] > 1e-2}
    assert not bad, bad
    # most cases have live rows (130 tokens in 128-row blocks: one full and one empty row, none live)
    assert sum(e["live"] > 0.3 for e in mass.values()) >= len(mass) * 2 // 3, mass
    exact = {k: v for k, v in flags.items() if k.startswith(("empty-exact", "token-nogroup"))}
    assert len(exact) == 2 * 3 * (3 * 4 + 2) and all(exact.values()), {k: v for k, v in exact.items() if not v}
    assert flags["dispatch-hopper"] == ["sparse"]
    assert flags["dispatch-ada"] == [] and flags["dispatch-blackwell"] == []
    assert flags["dispatch-misaligned-stride"] == []
    assert flags["fallback-after-failure"]["rel"] < 2e-3 and flags["fallback-after-failure"]["broken"] == ["sparse"]
    assert flags["explicit-failure-raises"]


LAZY_CHILD = PREAMBLE + r"""
import os
from sparse_ref import structured_qkv, random_block_lists, rel_l2
from comfyui_sparse_attention import kernels as K
from comfyui_sparse_attention.kernels import (anchor_torch, anchor_triton, block_sparse_torch, block_sparse_triton,
                                              dense_torch, dense_triton, token_sparse_torch, token_sparse_triton)
from comfyui_sparse_attention.kernels._triton_common import lazy_rescale
assert os.environ["SPARSE_ATTN_RESCALE"] == "lazy" and lazy_rescale()
results = {}

def rel(name, a, b):
    fin = torch.isfinite(b.double())
    results[name] = dict(rel=rel_l2(torch.where(fin, a.double(), 0), torch.where(fin, b.double(), 0)),
                         nan=bool(torch.isnan(a.float()).any()),
                         same_inf=bool(torch.equal(torch.isneginf(a), torch.isneginf(b))))

for dtype in (torch.float16, torch.float32):
    for (n, d) in ((200, 64), (193, 128)):
        q0, k0, v = structured_qkv(1, 2, n, d, dtype=torch.float32, seed=n + d)
        # "tiny": every score within a unit of 0 (after the first tile the rescale branch is never taken);
        # "flat": the structured scores;
        # "ramp": key norms grow along the sequence, so later tiles raise every row's max by far more than the
        # slack (the rescale branch is taken tile after tile); "ramp_down": the first tile holds the max
        ramp = torch.linspace(0.2, 6.0, n).view(1, 1, n, 1)
        for kind, k in (("tiny", k0 * 0.02), ("flat", k0), ("ramp", k0 * ramp), ("ramp_down", k0 * ramp.flip(2))):
            q, k, vv = q0.to(dtype), k.to(dtype), v.to(dtype)
            tag = f"{kind}-{dtype}-{n}-{d}"
            for path in ("pointer", "tma"):
                out, lse = dense_triton.attention_dense(q, k, vv, return_lse=True, path=path)
                ro, rlse = dense_torch.attention_dense(q, k, vv, return_lse=True)
                rel(f"dense-{path}-out-" + tag, out, ro)
                rel(f"dense-{path}-lse-" + tag, lse, rlse)
            nb = -(-n // 64)
            idx, cnt = random_block_lists(1, 2, nb, nb, nb, seed=n, empty_rows=(1,), full_rows=(0,))
            ref = block_sparse_torch.block_sparse_attention(q, k, vv, idx, cnt, block_q=64, block_k=64)
            for path in ("pointer", "tma", "persistent"):
                rel(f"bsa-{path}-" + tag, block_sparse_triton.block_sparse_attention(
                    q, k, vv, idx, cnt, block_q=64, block_k=64, path=path), ref)
            o, lse, r = anchor_triton.block_anchor_attention(q, k, vv, idx, cnt, block_q=64, block_k=64,
                                                             residual_precision="model", return_lse=True)
            ro, rlse, rr = anchor_torch.block_anchor_attention(q, k, vv, idx, cnt, block_q=64, block_k=64,
                                                               residual_precision="model", return_lse=True)
            rel("anchor-out-" + tag, o, ro)
            rel("anchor-lse-" + tag, lse, rlse)
            groups = K.group_queries(q, 64)
            g = groups.shape[2]
            toks = torch.arange(n, dtype=torch.int32).view(1, 1, 1, n).expand(1, 2, g, n).contiguous()
            tcnt = torch.full((1, 2, g), n, dtype=torch.int32)
            tcnt[0, 1, 0] = 70  # a partial list: a masked tail
            rel("token-" + tag, token_sparse_triton.token_sparse_attention(q, k, vv, groups, toks, tcnt),
                token_sparse_torch.token_sparse_attention(q, k, vv, groups, toks, tcnt))

# Every kernel takes the mode from lazy_rescale(): with an unbounded slack the lazy kernels never raise the max after
# the first tile, so steeply climbing scores overflow exp2 (non-finite output) while the eager kernels stay finite.
# A call site that ignored the switch would stay finite in both modes.
import triton.language as tl
from comfyui_sparse_attention.kernels import _triton_common
_triton_common.RESCALE_SLACK = tl.constexpr(1e9)
n, d = 193, 64
q, k0, v = structured_qkv(1, 2, n, d, dtype=torch.float32, seed=3)
k = k0 * torch.linspace(0.1, 40.0, n).view(1, 1, n, 1)
nb = -(-n // 64)
idx, cnt = random_block_lists(1, 2, nb, nb, nb, seed=5, full_rows=(0,))
groups = K.group_queries(q, 64)
g = groups.shape[2]
toks = torch.arange(n, dtype=torch.int32).view(1, 1, 1, n).expand(1, 2, g, n).contiguous()
tcnt = torch.full((1, 2, g), n, dtype=torch.int32)
calls = {
    "dense-pointer": lambda: dense_triton.attention_dense(q, k, v, path="pointer"),
    "dense-tma": lambda: dense_triton.attention_dense(q, k, v, path="tma"),
    "bsa-pointer": lambda: block_sparse_triton.block_sparse_attention(q, k, v, idx, cnt, block_q=64, block_k=64,
                                                                       path="pointer"),
    "bsa-tma": lambda: block_sparse_triton.block_sparse_attention(q, k, v, idx, cnt, block_q=64, block_k=64,
                                                                   path="tma"),
    "bsa-persistent": lambda: block_sparse_triton.block_sparse_attention(q, k, v, idx, cnt, block_q=64,
                                                                          block_k=64, path="persistent"),
    "bsa-warp_spec": lambda: block_sparse_triton.block_sparse_attention(q, k, v, idx, cnt, block_q=64, block_k=64,
                                                                         path="warp_spec"),
    "anchor": lambda: anchor_triton.block_anchor_attention(q, k, v, idx, cnt, block_q=64, block_k=64,
                                                           residual_precision="model")[0],
    "token": lambda: token_sparse_triton.token_sparse_attention(q, k, v, groups, toks, tcnt),
}
reach = {}
for mode in ("lazy", "eager"):
    os.environ["SPARSE_ATTN_RESCALE"] = mode
    for name, fn in calls.items():
        reach[f"{name}-{mode}"] = bool(torch.isfinite(fn()).all())
print("RESULT:" + json.dumps(dict(results=results, reach=reach)))
"""


def test_lazy_rescale_matches_twins_in_interpreter(child):
    """SPARSE_ATTN_RESCALE=lazy: every kernel (dense pointer / TMA, block-sparse pointer / TMA / persistent, fused
    anchor, token-sparse) equals its twin on scores whose row max never moves by the slack, climbs tile after
    tile, or sits in the first tile (kernels/_triton_common.py, online_softmax_step)."""
    got = child
    results, reach = got["results"], got["reach"]
    # the switch reaches every kernel: lazy with an unbounded slack overflows, eager does not
    assert len(reach) == 16 and all(v is (k.endswith("-eager")) for k, v in reach.items()), reach
    assert len(results) == 2 * 2 * 4 * (4 + 3 + 2 + 1)
    bad = {name: e for name, e in results.items()
           if e["nan"] or not e["same_inf"] or e["rel"] > (2e-3 if "float16" in name else 1e-5)}
    assert not bad, bad


@pytest.mark.parametrize("env,getter,default,on,off", [
    ("SPARSE_ATTN_RESCALE", "lazy_rescale", "DEFAULT_RESCALE", "lazy", "eager"),
    ("SPARSE_ATTN_LOOP", "loop_ahead", "DEFAULT_LOOP", "ahead", "plain"),
])
def test_kernel_modes_are_read_at_each_launch(monkeypatch, env, getter, default, on, off):
    """The kernels' mode switches (kernels/_triton_common.py) are read at every launch; a bad value names the
    variable."""
    from comfyui_sparse_attention.kernels import _triton_common
    read = getattr(_triton_common, getter)
    monkeypatch.setenv(env, on)
    assert read() is True
    monkeypatch.setenv(env, off)
    assert read() is False
    monkeypatch.delenv(env)
    assert read() is (getattr(_triton_common, default) == on)
    monkeypatch.setenv(env, "sometimes")
    with pytest.raises(ValueError, match=env):
        read()


AHEAD_CHILD = PREAMBLE + r"""
import os
from sparse_ref import structured_qkv, random_block_lists, rel_l2
from test_token_and_selection import _compact_case
from comfyui_sparse_attention import kernels as K
from comfyui_sparse_attention.kernels import (anchor_torch, anchor_triton, attention_hopper, block_sparse_torch,
                                              block_sparse_triton, dense_torch, dense_triton, token_sparse_torch,
                                              token_sparse_triton)
from comfyui_sparse_attention.kernels.compact_torch import decode_lists
results, tiles = {}, {}
# the one-tile helpers of the plain loops: under the interpreter a kernel looks them up when it calls them, so these
# counters see every plain-loop tile; the ahead loops call them for masked tails only
count = {"tma": 0, "token": 0}
plain_tma, plain_token = attention_hopper._kv_tile, token_sparse_triton.kv_tile
def tma_tile(*a, **kw):
    count["tma"] += 1
    return plain_tma(*a, **kw)
def token_tile(*a, **kw):
    count["token"] += 1
    return plain_token(*a, **kw)
attention_hopper._kv_tile, token_sparse_triton.kv_tile = tma_tile, token_tile

def rel(name, a, b):
    fin = torch.isfinite(b.double())
    results[name] = dict(rel=rel_l2(torch.where(fin, a.double(), 0), torch.where(fin, b.double(), 0)),
                         nan=bool(torch.isnan(a.float()).any()),
                         same_inf=bool(torch.equal(torch.isneginf(a), torch.isneginf(b))))

for mode in ("plain", "ahead"):
    os.environ["SPARSE_ATTN_LOOP"] = mode
    count["tma"] = count["token"] = 0
    for dtype in (torch.float16, torch.float32):
        # 200 and 192: whole 32-row tiles (192: whole 64-row blocks too); 193: a ragged last tile; 40: one whole
        # tile (the ahead loop body never runs) and a tail; 20: the tail only
        for (n, d) in ((200, 64), (192, 64), (193, 128), (40, 64), (20, 64)):
            q, k, v = structured_qkv(1, 2, n, d, dtype=dtype, seed=n + d)
            tag = f"{mode}-{dtype}-{n}-{d}"
            out, lse = dense_triton.attention_dense(q, k, v, return_lse=True, path="tma")
            ro, rlse = dense_torch.attention_dense(q, k, v, return_lse=True)
            rel("dense-out-" + tag, out, ro)
            rel("dense-lse-" + tag, lse, rlse)
            nb = -(-n // 64)
            idx, cnt = random_block_lists(1, 2, nb, nb, nb, seed=n, empty_rows=(1,) if nb > 1 else (),
                                          full_rows=(0,))
            ref = block_sparse_torch.block_sparse_attention(q, k, v, idx, cnt, block_q=64, block_k=64)
            for path in ("tma", "persistent"):
                rel(f"bsa-{path}-" + tag, block_sparse_triton.block_sparse_attention(
                    q, k, v, idx, cnt, block_q=64, block_k=64, path=path), ref)
            got = anchor_triton.block_anchor_attention(q, k, v, idx, cnt, block_q=64, block_k=64,
                                                       residual_precision="model", return_lse=True)
            want = anchor_torch.block_anchor_attention(q, k, v, idx, cnt, block_q=64, block_k=64,
                                                       residual_precision="model", return_lse=True)
            for part, a, b in zip(("out", "lse", "res"), got, want):
                rel(f"anchor-{part}-" + tag, a if part != "res" else a[0], b if part != "res" else b[0])
            groups = K.group_queries(q, 64)
            g = groups.shape[2]
            toks = torch.arange(n, dtype=torch.int32).view(1, 1, 1, n).expand(1, 2, g, n).contiguous()
            tcnt = torch.full((1, 2, g), n, dtype=torch.int32)
            tcnt[0, 1, 0] = min(n, 70)  # whole tiles and a masked tail
            if g > 1:
                tcnt[0, 1, 1] = 32      # exactly one whole tile
                tcnt[0, 0, 1] = 0       # nothing
            rel("token-" + tag, token_sparse_triton.token_sparse_attention(q, k, v, groups, toks, tcnt),
                token_sparse_torch.token_sparse_attention(q, k, v, groups, toks, tcnt))
        q, k, v, groups, low, ends, cnt = _compact_case(3000, 64, seed=7, dtype=dtype)
        rel(f"token-compact-{mode}-{dtype}", token_sparse_triton.token_sparse_attention_compact(
            q, k, v, groups, low, ends, cnt), token_sparse_torch.token_sparse_attention(
            q, k, v, groups, decode_lists(low, ends), cnt))
    tiles[mode] = dict(count)
print("RESULT:" + json.dumps(dict(results=results, tiles=tiles)))
"""


def test_scores_ahead_matches_twins_in_interpreter(child):
    """SPARSE_ATTN_LOOP=ahead (kernels/_triton_common.py, loop_ahead): the TMA kernel (dense + LSE, block-sparse plain
    and persistent, fused anchor) and the token kernel (int32 and compact lists) equal their twins as the plain loops
    do, on lists of no, one and many whole tiles with and without a masked tail; and the switch reaches the loops
    (the ahead loops leave the one-tile helpers of the plain loops to masked tails)."""
    got = child
    results, tiles = got["results"], got["tiles"]
    assert len(results) == 2 * 2 * (5 * (2 + 2 + 3 + 1) + 1)
    bad = {name: e for name, e in results.items()
           if e["nan"] or not e["same_inf"] or e["rel"] > (2e-3 if "float16" in name else 1e-5)}
    assert not bad, bad
    for kind in ("tma", "token"):
        assert tiles["plain"][kind] > 4 * tiles["ahead"][kind] > 0, tiles


MASS_CHILD = PREAMBLE + r"""
from sparse_ref import structured_qkv, random_block_lists, rel_l2
from comfyui_sparse_attention import kernels as K
from comfyui_sparse_attention.kernels import (_hopper, anchor_torch, anchor_triton, block_sparse_torch,
                                              block_sparse_triton)
results = {}
use_tma = _hopper.use_tma
for dtype, n, d in ((torch.float16, 200, 64), (torch.float32, 193, 128)):  # whole and ragged tiles, D 64 and 128
    if True:
        q, k, v = structured_qkv(2, 2, n, d, dtype=dtype, seed=n + 1)  # batch 2: a CFG pair in one call
        nb = -(-n // 64)
        idx, cnt = random_block_lists(2, 2, nb, nb, nb, seed=n, empty_rows=(1,), full_rows=(0,))
        for prec in ("model", "fp8"):
            tag = f"{dtype}-{n}-{d}-{prec}"
            kern = anchor_triton.block_anchor_attention(q, k, v, idx, cnt, block_q=64, block_k=64,
                                                        residual_precision=prec, return_mass=True)
            twin = anchor_torch.block_anchor_attention(q, k, v, idx, cnt, block_q=64, block_k=64,
                                                       residual_precision=prec, return_mass=True)
            q2 = q * 1.15  # a later step: the selected keys weigh more
            want = block_sparse_torch.block_sparse_attention(q2, k, v, idx, cnt, block_q=64, block_k=64,
                                                             residual=twin[1])
            fixed = block_sparse_torch.block_sparse_attention(q2, k, v, idx, cnt, block_q=64, block_k=64,
                                                              residual=twin[1][:2])
            for path in ("pointer", "tma", "persistent"):
                got = block_sparse_triton.block_sparse_attention(q2, k, v, idx, cnt, block_q=64, block_k=64,
                                                                 residual=kern[1], path=path)
                results[f"reuse-{path}-" + tag] = [rel_l2(got.double(), want.double()),
                                                   rel_l2(want.double(), fixed.double())]
            o, lse = block_sparse_triton.block_sparse_attention(q2, k, v, idx, cnt, block_q=64, block_k=64,
                                                                path="pointer", return_lse=True)
            o_t, lse_t = block_sparse_triton.block_sparse_attention(q2, k, v, idx, cnt, block_q=64, block_k=64,
                                                                    path="tma", return_lse=True)
            ro, rlse = block_sparse_torch.block_sparse_attention(q2, k, v, idx, cnt, block_q=64, block_k=64,
                                                                 return_lse=True)
            fin = torch.isfinite(rlse)
            same = torch.equal(fin, torch.isfinite(lse)) and torch.equal(fin, torch.isfinite(lse_t))
            results["lse-" + tag] = [float((lse - rlse)[fin].abs().max()), float((lse_t - rlse)[fin].abs().max()),
                                     bool(same)]
            # through the API as the engine calls it: the fused anchor, then the composed one (dense + LSE, block-sparse
            # with its LSE) that runs where the fused kernel cannot; each one's residual on the Triton reuse path
            for how in ("fused", "composed", "epilogue"):
                anchor_triton.supported = (lambda k_, v_: True) if how == "fused" else (lambda k_, v_: False)
                _hopper.use_tma = (lambda kind, *t: kind == "residual") if how == "epilogue" else use_tma
                api = K.block_anchor_attention(q, k, v, idx, cnt, block_q=64, block_k=64, residual_precision=prec,
                                               return_mass=True, backend="triton")
                got = K.block_sparse_attention(q2, k, v, idx, cnt, block_q=64, block_k=64, residual=api[1],
                                               backend="triton")
                results[f"api-{how}-" + tag] = [rel_l2(got.double(), want.double()),
                                                rel_l2(want.double(), fixed.double())]
# which anchor path kernels.api takes: the density the caller states, else the widest list's share of the KV blocks
calls = []
real = {name: getattr(anchor_triton, name) for name in ("block_anchor_attention", "block_residual")}
for name, fn in real.items():
    setattr(anchor_triton, name, lambda *a, name=name, fn=fn, **kw: calls.append(name) or fn(*a, **kw))
anchor_triton.supported = lambda k_, v_: True
_hopper.use_tma = lambda kind, *t: kind == "residual"
q, k, v = structured_qkv(1, 2, 640, 64, dtype=torch.float32, seed=3)
wide, wcnt = random_block_lists(1, 2, 10, 10, 10, seed=4, full_rows=(0,))  # one dense row: width 10 of 10 blocks
narrow = wide[..., :1].contiguous()  # one block per row: width 1 of 10
dispatch = {}
for label, (idx, cnt, density) in {"wide": (wide, wcnt, None), "wide-stated-0.05": (wide, wcnt, 0.05),
                                   "narrow": (narrow, wcnt.clamp(max=1), None),
                                   "narrow-stated-0.5": (narrow, wcnt.clamp(max=1), 0.5),
                                   "narrow-stated-0.15": (narrow, wcnt.clamp(max=1), 0.15)}.items():
    calls.clear()
    out, res = K.block_anchor_attention(q, k, v, idx, cnt, block_q=64, block_k=64, backend="triton", density=density)
    dispatch[label] = [list(calls), rel_l2(out.double(), K.attention_dense(q, k, v, backend="torch").double())]
results["dispatch"] = dispatch
print("RESULT:" + json.dumps(results))
"""


def test_mass_weighted_residual_matches_twins_in_interpreter(child):
    """The fused anchor writes the rows' mass and the block-sparse kernels (pointer, TMA, persistent) weight the
    residual by it as the twin does (kernels/_residual.py), batch 2; the block-sparse kernels' row LSE equals the
    twin's; through kernels.api, the fused and the composed anchor's mass (R formed in PyTorch, or in the TMA kernel's
    epilogue) reach the Triton reuse path; kernels.api picks the path by the stated density, else by the list width."""
    got = child
    dispatch = got.pop("dispatch")
    assert {label: calls for label, (calls, _) in dispatch.items()} == {
        "wide": ["block_anchor_attention"], "wide-stated-0.05": ["block_residual"], "narrow": ["block_residual"],
        "narrow-stated-0.5": ["block_anchor_attention"],
        "narrow-stated-0.15": ["block_anchor_attention"]}  # the quality presets' density: fused since v16
    assert all(err <= 1e-5 for _, err in dispatch.values()), dispatch  # either way the output is the dense one
    assert len(got) == 2 * 2 * 7
    for name, vals in got.items():
        # each side reuses its own anchor's residual: fp16 inputs round differently in the two, and an fp8 residual
        # element whose value sits at a rounding boundary lands one fp8 step apart
        tol = 5e-3 if "fp8" in name else (2e-3 if "float16" in name else 1e-5)
        if name.startswith(("reuse", "api")):
            assert vals[0] <= tol and vals[1] > 3 * tol, (name, vals)  # matches, and the weighting did something
        else:
            assert vals[0] <= 1e-2 and vals[1] <= 1e-2 and vals[2], (name, vals)


COMPACT_CHILD = PREAMBLE + r"""
from comfyui_sparse_attention import kernels as K
from comfyui_sparse_attention.engine import SparseConfig
from comfyui_sparse_attention.engine.context import TokenLayout
from comfyui_sparse_attention.engine.policy_mc_sparse import build_mc_sparse
from sparse_ref import structured_qkv
g = torch.Generator().manual_seed(0)
same = {}
for (lead, length, segment, p) in [((7,), 300, 64, 0.3), ((2, 3), 1000, 256, 0.05), ((4,), 128, 128, 1.0),
                                    ((3,), 200, 16, 0.0), ((2, 1, 3), 777, 1 << 16, 0.5)]:
    keep = torch.rand(*lead, length, generator=g) < p
    keep.view(-1, length)[0] = False
    keep.view(-1, length)[-1] = True
    a = K.compact_keep(keep, segment=segment, backend="torch")
    b = K.compact_keep(keep, segment=segment, backend="triton")
    same[f"{lead}-{length}-{segment}"] = all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))
# a whole mc_sparse selection, the kernel against the twin
q, k, v = structured_qkv(1, 2, 700, 64, dtype=torch.float32, seed=5)
lse = K.attention_dense(q, k, v, return_lse=True, backend="torch")[1]
cfg = SparseConfig(method="mc_sparse", density=0.2, group_size=64)
sel = {be: build_mc_sparse(q, k, lse, TokenLayout(), cfg, backend=be) for be in ("torch", "triton")}
same["selection"] = all(torch.equal(getattr(sel["torch"], f), getattr(sel["triton"], f))
                        for f in ("q_groups", "kv_low", "seg_ends", "kv_counts"))
# a width the caller knows: above every count (nothing read back), and below some (a broken bound cuts the rows)
from comfyui_sparse_attention.kernels.compact_torch import decode_lists
keep = torch.rand(5, 900, generator=g) < 0.2
keep[1] = True  # 900 kept: beyond both widths below
for w in (950, 60):
    a = K.compact_keep(keep, segment=256, width=w, backend="torch")
    b = K.compact_keep(keep, segment=256, width=w, backend="triton")
    width = a[0].shape[-1]
    same[f"width-{w}-twin"] = all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))
    same[f"width-{w}-W"] = width == -(-min(w, 900) // 16) * 16
    cols = decode_lists(a[0], a[1], 256)
    first = [torch.nonzero(row).view(-1)[:width] for row in keep]  # the first W kept columns of each row
    same[f"width-{w}-lists"] = all(int(a[2][r]) == f.numel() and torch.equal(cols[r, :f.numel()].long(), f)
                                   and int(a[1][r].max()) <= width for r, f in enumerate(first))
print("RESULT:" + json.dumps(same))
"""


def test_compact_keep_kernel_matches_twin_in_interpreter(child):
    """kernels/compact_triton.py writes the same lists as its twin, alone and inside a whole mc_sparse selection;
    with a width the caller knows both write lists of that width (rounded up to 16) holding every row's kept
    columns, and cut a row that keeps more to its first W columns, counted as W."""
    same = child
    assert len(same) == 6 + 6 and all(same.values()), same


COMPACT_TOKEN_CHILD = PREAMBLE + r"""
from test_token_and_selection import _compact_case
from sparse_ref import rel_l2
from comfyui_sparse_attention import kernels as K
from comfyui_sparse_attention.kernels import token_sparse_torch
from comfyui_sparse_attention.kernels.compact_torch import decode_lists

def no_twin(*_, **__):  # the compact calls below must run the kernel, not the twin that decodes first
    raise AssertionError("the compact twin ran instead of the Triton kernel")
token_sparse_torch.token_sparse_attention_compact = no_twin
errs = {}
for dtype in (torch.float16, torch.float32):
    for n in (3000, 70000, 140000) if dtype == torch.float32 else (3000, 70000):
        q, k, v, groups, low, ends, cnt = _compact_case(n, 64, seed=n, dtype=dtype)
        toks = decode_lists(low, ends)
        twin = K.token_sparse_attention(q, k, v, groups, toks, cnt, backend="torch")
        out = K.token_sparse_attention_compact(q, k, v, groups, low, ends, cnt, backend="triton")
        res = (torch.randn(q.shape).to(dtype), None)
        twin_r = K.token_sparse_attention(q, k, v, groups, toks, cnt, backend="torch", residual=res)
        out_r = K.token_sparse_attention_compact(q, k, v, groups, low, ends, cnt, backend="triton", residual=res)
        errs[f"{dtype}-{n}"] = [rel_l2(out.double(), twin.double()), rel_l2(out_r.double(), twin_r.double()),
                                bool(torch.isfinite(out).all())]
# fill_ungrouped=False (the engine's selections that cover every row): no decode pass, the grouped rows the same
from comfyui_sparse_attention.kernels import token_sparse_triton
decodes = []
real_decode = token_sparse_triton.decode_into
token_sparse_triton.decode_into = lambda out, res: decodes.append(1) or real_decode(out, res)
q, k, v, groups, low, ends, cnt = _compact_case(3000, 64, seed=3)
res = (torch.randn(q.shape), None)
filled = K.token_sparse_attention_compact(q, k, v, groups, low, ends, cnt, backend="triton", residual=res)
n_filled = len(decodes)
left = K.token_sparse_attention_compact(q, k, v, groups, low, ends, cnt, backend="triton", residual=res,
                                        fill_ungrouped=False)
same = all(torch.equal(left[0, h, groups[0, h][groups[0, h] >= 0].long()],
                       filled[0, h, groups[0, h][groups[0, h] >= 0].long()]) for h in range(2))
errs["unfilled"] = [n_filled, len(decodes) - n_filled, same]
print("RESULT:" + json.dumps(errs))
"""


def test_compact_token_kernel_decodes_lists_in_the_interpreter(child):
    """The token kernel over compact int16 lists (decoded in registers: one, two and three segments at 3 000, 70 000
    and 140 000 tokens) equals the twin over the decoded int32 lists, with and without a residual; with
    fill_ungrouped=False it runs no decode pass and writes the grouped rows the same."""
    errs = child
    assert errs.pop("unfilled") == [1, 0, True]  # fill_ungrouped=False: no decode pass, grouped rows unchanged
    assert len(errs) == 5
    for name, (plain, with_res, finite) in errs.items():
        tol = 1e-5 if "float32" in name else 2e-3
        assert finite and plain <= tol and with_res <= tol, (name, plain, with_res)

FP8_BYTES_CHILD = PREAMBLE + r"""
import triton, triton.language as tl
from sparse_ref import structured_qkv, random_block_lists
from comfyui_sparse_attention.kernels import (_triton_common as C, anchor_torch, block_sparse_torch,
                                              block_sparse_triton, dense_torch, token_sparse_torch,
                                              token_sparse_triton)
from comfyui_sparse_attention.kernels._residual import encode_residual
out = {}

@triton.jit
def decode_kernel(X, Y, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(Y + i, C.e4m3_from_bytes(tl.load(X + i)))

codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
got = torch.empty(256, dtype=torch.float32)
decode_kernel[(1,)](codes, got, N=256)
want = codes.view(torch.float8_e4m3fn).float()
nan = torch.isnan(want)
out["decode"] = dict(same_nan=bool(torch.equal(nan, torch.isnan(got))),
                     exact=bool(torch.equal(got[~nan], want[~nan])),
                     same_sign=bool(torch.equal(torch.signbit(got[~nan]), torch.signbit(want[~nan]))))

def both(fn):
    # the same call with fp8 typed (as on Ada / Hopper) and read as bytes (as on Ampere): equal bit for bit
    modes = {}
    for typed in (True, False):
        C.fp8_typed = lambda t, typed=typed: typed
        modes[typed] = fn()
    return modes[True], modes[False]

def compare(typed, raw, ref):
    # where the twin is finite: the NaN code decodes to NaN only in the bytes path here (the interpreter's own fp8
    # load does not give NaN for it; the hardware's does), so the NaN row is compared with the twin alone
    fin = torch.isfinite(ref)
    return dict(equal=bool(torch.equal(typed[fin], raw[fin])),
                same_nan=bool(torch.equal(torch.isnan(raw), torch.isnan(ref))),
                err=float((raw.double() - ref.double())[fin].abs().max()))

for dtype in (torch.float16, torch.float32):
    q, k, v = structured_qkv(1, 2, 130, 64, dtype=dtype, seed=3)
    idx, cnt = random_block_lists(1, 2, 3, 3, 3, seed=2, empty_rows=(1,), full_rows=(0,))
    g = torch.Generator().manual_seed(5)
    res = encode_residual(torch.randn(q.shape, generator=g) * 0.3, "fp8", q.dtype)
    # a NaN (an inf in the model's v at the anchor), two subnormals and a zero in one row
    res[0].view(torch.uint8)[0, 0, 0, :4] = torch.tensor([0x7F, 0x01, 0x81, 0x00], dtype=torch.uint8)
    kw = dict(block_q=64, block_k=64)
    typed, raw = both(lambda: block_sparse_triton.block_sparse_attention(q, k, v, idx, cnt, residual=res,
                                                                         path="pointer", **kw))
    ref = block_sparse_torch.block_sparse_attention(q, k, v, idx, cnt, residual=res, **kw)
    out[f"bsa-{dtype}"] = compare(typed, raw, ref)
    dense, dlse = dense_torch.attention_dense(q, k, v, return_lse=True)
    mres = anchor_torch.block_residual(q, k, v, idx, cnt, dense, dlse, residual_precision="fp8", return_mass=True,
                                       **kw)
    typed, raw = both(lambda: block_sparse_triton.block_sparse_attention(q, k, v, idx, cnt, residual=mres,
                                                                         path="pointer", **kw))
    ref = block_sparse_torch.block_sparse_attention(q, k, v, idx, cnt, residual=mres, **kw)
    out[f"bsa-mass-{dtype}"] = compare(typed, raw, ref)
    groups = torch.arange(128, dtype=torch.int32).reshape(1, 1, 2, 64).expand(1, 2, 2, 64).contiguous()
    toks = torch.arange(40, dtype=torch.int32).expand(1, 2, 2, 40).contiguous()
    tcnt = torch.tensor([[[40, 0], [17, 40]]], dtype=torch.int32)
    typed, raw = both(lambda: token_sparse_triton.token_sparse_attention(q, k, v, groups, toks, tcnt, residual=res))
    ref = token_sparse_torch.token_sparse_attention(q, k, v, groups, toks, tcnt, residual=res)
    out[f"token-{dtype}"] = compare(typed, raw, ref)
C.fp8_typed = lambda t: False
out["mode"] = C.residual_mode(res)
print("RESULT:" + json.dumps(out))
"""


def test_fp8_residual_read_as_bytes_where_triton_has_no_fp8_type(child):
    """On Ampere and Turing, Triton compiles no kernel that takes float8_e4m3fn data (docs/kernel_notes.md, "v14"):
    the kernels read the residual's bytes and decode them in software. Every one of the 256 codes decodes as torch
    decodes it (NaN, subnormals, signed zero), and the block-sparse (plain and mass-weighted) and token kernels
    give the same output bit for bit as with the typed fp8 load, and their twins' within rounding."""
    r = child
    assert r["decode"] == dict(same_nan=True, exact=True, same_sign=True)
    assert r["mode"] == 3
    for name in ("bsa", "bsa-mass", "token"):
        for dtype in ("torch.float16", "torch.float32"):
            e = r[f"{name}-{dtype}"]
            assert e["equal"] and e["same_nan"], (name, dtype, e)
            assert e["err"] <= (5e-3 if dtype == "torch.float16" else 1e-5), (name, dtype, e)



FP8_STORE_CHILD = PREAMBLE + r"""
import fp8_store_check
print("RESULT:" + json.dumps(fp8_store_check.check("cpu")))
"""


def test_fp8_residual_store_rounds_as_torch(child):
    """The residual epilogues' fp8 store rounds to nearest even exactly as torch's cast (ties, subnormals), with the
    row scale amax / 448 over the finite values (tests/fp8_store_check.py). The interpreter's own cast turns NaN into
    384, so the NaN kept where the residual was not finite is checked on the GPU, with the GPU's cast, which rounds
    without the software grid (tests/test_gpu_kernels.py)."""
    r = child
    assert r["scale_rel"] <= 1e-6 and r["codes_equal"] == 1.0 and r["ties_equal"] and r["max_steps"] == 0, r
    assert r["finite_elsewhere"], r


THRESHOLD_CHILD = PREAMBLE + r"""
from comfyui_sparse_attention import kernels as K
from comfyui_sparse_attention.engine.block_geometry import keep_top

def reference(scores, thresh, k):  # the definition: above, then ties in index order up to k
    above, tied = scores > thresh, scores == thresh
    room = (k - above.sum(-1, keepdim=True)).clamp(min=0)
    return above | (tied & (torch.cumsum(tied, -1) <= room))

g = torch.Generator().manual_seed(0)
same = {}
base = torch.randint(0, 6, (2, 4, 6, 500), generator=g).float()  # few distinct values: many ties
base[0, 1, 2, :40] = float("inf")  # forced entries
base[1, 2, 3, 7] = float("nan")
views = {"contiguous": base[0, 0], "4-d slice": base[:, 1:3, 2:4, 10:410], "one row": base[1, 0, 0],
         "fp16": base[:, :2, :2].half(), "strided last": base[0].transpose(-1, -2)[:2, :, :300],
         "rows sliced": base[:, :, 2:4, 10:410], "heads sliced": base[:, 1:3, :, 10:410],  # two strides, no copy
         "bf16": base[:, :2, :2].bfloat16()}
cases = [(name, k, "value") for name in views for k in (0, 3, 250, 1000)]
cases += [(name, k, pick) for name in ("4-d slice", "fp16") for k in (3, 250) for pick in ("inf", "between")]
for name, k, pick in cases:
    scores = views[name]
    if pick == "value":
        thresh = scores[..., 5:6].clone()
    else:
        thresh = torch.full_like(scores[..., :1], float("inf") if pick == "inf" else 2.5)
    ref = reference(scores, thresh, k)
    a = K.keep_at_threshold(scores, thresh, k, backend="torch")
    b = K.keep_at_threshold(scores, thresh, k, backend="triton")
    same[f"{name}-{k}-{pick}"] = bool(torch.equal(a, ref) and torch.equal(b, ref) and b.dtype == torch.bool)
from comfyui_sparse_attention.kernels.threshold_triton import _rows_view
for name in ("rows sliced", "heads sliced"):  # the policy's mass[:, :, rows, cols] with B > 1: read in place
    same[f"{name} in place"] = _rows_view(views[name])[0].data_ptr() == views[name].data_ptr()
# keep_top's long rows (L > 4 * SAMPLE), sampled threshold, through both backends
long = torch.rand(2, 17000, generator=g)
long[0, :9000] = 0.0  # ties at a zero threshold that overflow the room
for k in (100, 12000):
    same[f"keep_top-{k}"] = bool(torch.equal(keep_top(long, k, backend="torch"), keep_top(long, k, backend="triton")))

# a cap: rows with more than cap entries above their threshold raise it to the (cap + 1)-th largest value, or to the
# largest finite one (never below the threshold) where +inf entries alone exceed the cap; then as above
def reference_capped(scores, thresh, k, cap):
    rows, t = scores.reshape(-1, scores.shape[-1]).float(), thresh.reshape(-1, 1).float().clone()
    for r in range(rows.shape[0]):
        x = rows[r]
        if int((x > t[r]).sum()) > cap:
            v = torch.sort(x[~torch.isnan(x)], descending=True).values[cap]
            if torch.isinf(v):
                v = max(float(x[torch.isfinite(x)].max()), float(t[r]))
            t[r] = v
    return reference(scores.float(), t.view(thresh.shape), k)

for name, k, cap in [("contiguous", 3, 3), ("contiguous", 50, 120), ("4-d slice", 20, 40), ("fp16", 10, 100),
                     ("bf16", 0, 7), ("strided last", 100, 150), ("4-d slice", 250, 1000)]:
    scores = views[name]
    thresh = torch.zeros_like(scores[..., :1])  # far below: nearly every row over its cap
    ref = reference_capped(scores, thresh, k, cap)
    a = K.keep_at_threshold(scores, thresh, k, cap=cap, backend="torch")
    b = K.keep_at_threshold(scores, thresh, k, cap=cap, backend="triton")
    same[f"cap-{name}-{k}-{cap}"] = bool(torch.equal(a, ref) and torch.equal(b, ref))
# +inf entries: 50 fit the cap beside the 10 largest finite ones; 70 alone exceed it and are all that is kept
forced = torch.rand(3, 300, generator=g)
forced[0, :50] = float("inf")
forced[1, :70] = float("inf")
thresh = torch.full((3, 1), 0.1)
a = K.keep_at_threshold(forced, thresh, 60, cap=60, backend="torch")
b = K.keep_at_threshold(forced, thresh, 60, cap=60, backend="triton")
same["cap-inf"] = bool(torch.equal(a, b) and torch.equal(a, reference_capped(forced, thresh, 60, 60))
                       and a.sum(-1).tolist() == [60, 70, 60] and bool(a[0, :50].all()) and bool(a[1, :70].all()))
# keep_top's long rows whose sampled columns are all zero: a threshold of 0 would keep every other entry; the cap
# keeps each row's keep_bound largest instead, exactly
from comfyui_sparse_attention.engine.block_geometry import SAMPLE, keep_bound
skewed = torch.rand(2, 17000, generator=g) + 0.5
step = 17000 / SAMPLE
skewed[:, (torch.arange(SAMPLE, dtype=torch.float64) * step + step / 2).long()] = 0.0
bound = keep_bound(100, 17000)
a, b = keep_top(skewed, 100, backend="torch"), keep_top(skewed, 100, backend="triton")
top = torch.zeros_like(a).scatter_(1, torch.topk(skewed, bound, dim=-1).indices, True)
same["keep_top-capped"] = bool(torch.equal(a, b) and torch.equal(a, top) and 100 < bound < 200)
print("RESULT:" + json.dumps(same))
"""


def test_keep_at_threshold_kernel_matches_twin_in_interpreter(child):
    """kernels/threshold_triton.py keeps what its twin and the definition keep (entries above each row's threshold,
    ties in index order up to k): ties, forced +inf entries, NaN, an infinite threshold, k of 0 and beyond the row,
    fp16, bf16, 4-d slices read in place through two strides and one that needs a copy, a strided last dimension;
    and keep_top's long rows (the sampled threshold) give the same mask through both backends. With a cap, a row
    over it keeps what the definition keeps at its (cap + 1)-th largest value (+inf entries always), in both; and
    keep_top's long rows never keep more than keep_bound, the largest entries where its sample misleads it."""
    same = child
    assert len(same) == 8 * 4 + 8 + 2 + 2 + 7 + 2 and all(same.values()), {k: v for k, v in same.items() if not v}


GATHER_CHILD = PREAMBLE + r"""
from comfyui_sparse_attention import kernels as K
from comfyui_sparse_attention.kernels.gather_triton import gather_rows
g = torch.Generator().manual_seed(0)
same = {}
for d in (16, 64, 128):
    rows = torch.randn(300, d, generator=g)
    idx = torch.randint(0, 300, (450,), generator=g)  # repeats, and a count that no block divides
    same[f"rows-{d}"] = bool(torch.equal(gather_rows(rows, idx), rows.index_select(0, idx)))
same["empty"] = gather_rows(torch.randn(5, 16), torch.zeros(0, dtype=torch.int64)).shape == (0, 16)
for d, dims in ((64, 16), (64, 0), (96, 0)):  # D 96 has no Triton gather: the same PyTorch path
    q = torch.randn(1, 2, 1000, d, generator=g)
    same[f"groups-{d}-{dims}"] = bool(torch.equal(K.group_queries(q, 64, dims=dims, backend="triton"),
                                                  K.group_queries(q, 64, dims=dims, backend="torch")))
print("RESULT:" + json.dumps(same))
"""


def test_row_gather_kernel_matches_index_select_in_interpreter(child):
    """kernels/gather_triton.py gives index_select's rows (widths 16, 64, 128, repeated indices, a ragged last
    block, no rows); the grouping with it gives the twin's groups, and a width it does not take falls back."""
    same = child
    assert len(same) == 7 and all(same.values()), same


PACKED_MASS_CHILD = PREAMBLE + r"""
from comfyui_sparse_attention.kernels import mass_triton as MT, selection_torch as ST
g = torch.Generator().manual_seed(3)
errs = {}
for n, d, n_groups in ((220, 64, 13), (90, 80, 5)):  # 13 groups: the last program holds padding groups
    q, k = (torch.randn(2, 3, n, d, generator=g, dtype=torch.float16) for _ in range(2))
    lse = torch.logsumexp(q.float() @ k.float().transpose(-1, -2) / d ** 0.5, -1)
    lse[0, 0, 3] = float("-inf")  # an empty row: no mass
    groups = torch.stack([torch.randperm(n, generator=g)[:n_groups * 16] for _ in range(6)])
    groups = groups.view(2, 3, n_groups, 16).int()
    groups[0, 1, -1, 5:] = -1  # a short group
    ref = ST.group_kv_mass(q, k, lse, groups)
    configs = [MT._packed_cfg(32, 4, 4, 1), MT._packed_cfg(32, 4, 8, 0), MT._packed_cfg(16, 4, 8, 1),
               MT._packed_cfg(64, 4, 4, 0)]
    for cfg in configs:
        MT._mass_packed_fwd.configs = [cfg]
        MT._mass_packed_fwd.cache.clear()
        for path in ("pointer", "tma"):
            out = MT.group_kv_mass(q, k, lse, groups, path=path)
            key = f"dot-{n}-{cfg.kwargs['BLOCK_N']}-{cfg.kwargs['PG']}-{cfg.kwargs['POLY']}-{path}"
            errs[key] = float((out - ref).abs().max() / ref.abs().max()) if out.shape == ref.shape else 1.0
print("RESULT:" + json.dumps(errs))
"""


def test_packed_mass_kernel_configs_match_twin_in_interpreter(child):
    """Pass 2 on groups of 16 (kernels/mass_triton.py ``_mass_packed_fwd``): each program's one dot over 4 or 8
    groups, with and without the polynomial half, tiles of 16 to 64 keys, both load paths, give the twin's masses
    (a padded last program, a short group, an empty row)."""
    errs = child
    assert len(errs) == 2 * 4 * 2 and max(errs.values()) <= 1e-4, errs


RESIDUAL_OF_CHILD = PREAMBLE + r"""
import residual_of_check
print("RESULT:" + json.dumps(residual_of_check.check("cpu", (torch.float16, torch.float32))))
"""


def test_residual_of_kernel_matches_twin_in_interpreter(child):
    """kernels/residual_encode_triton.py, the anchor's residual in one pass: R in the model's dtype equal to the twin's,
    the same fp8 bytes and row scales, the sums of squares within rounding, for ragged lengths, head dims 64, 80 and
    128, batch 2 and outputs laid out (B, N, H, D) (tests/residual_of_check.py)."""
    r = child
    assert len(r) == 2 * 3 * 2
    for case, e in r.items():
        assert e["triton"] and e["shape_ok"] and e["model_equal"], (case, e)
        assert e["scale_rel"] <= 1e-6 and e["codes_equal"] == 1.0 and e["max_steps"] == 0, (case, e)
        assert e["sums_rel"] <= 1e-5, (case, e)


# test name -> (child code, timeout s, environment): run by the ``children`` fixture, longest first
CHILDREN = {
    "test_hopper_kernels_residual_anchor_and_mass_in_interpreter":
        (HOPPER_CHILD, 1500, {}),
    "test_lazy_rescale_matches_twins_in_interpreter":
        (LAZY_CHILD, 900, {"SPARSE_ATTN_RESCALE": "lazy"}),
    "test_mass_weighted_residual_matches_twins_in_interpreter":
        (MASS_CHILD, 900, {}),
    "test_scores_ahead_matches_twins_in_interpreter":
        (AHEAD_CHILD, 900, {}),
    "test_triton_kernels_match_twins_in_interpreter":
        (CHILD, 900, {}),
    "test_compact_keep_kernel_matches_twin_in_interpreter":
        (COMPACT_CHILD, 300, {}),
    "test_keep_at_threshold_kernel_matches_twin_in_interpreter":
        (THRESHOLD_CHILD, 600, {}),
    "test_row_gather_kernel_matches_index_select_in_interpreter":
        (GATHER_CHILD, 600, {}),
    "test_compact_token_kernel_decodes_lists_in_the_interpreter":
        (COMPACT_TOKEN_CHILD, 600, {}),
    "test_block_sparse_triton_path_under_inference_mode_in_interpreter":
        (INFERENCE_CHILD, 600, {}),
    "test_fp8_residual_read_as_bytes_where_triton_has_no_fp8_type":
        (FP8_BYTES_CHILD, 600, {}),
    "test_fp8_residual_store_rounds_as_torch":
        (FP8_STORE_CHILD, 300, {}),
    "test_packed_mass_kernel_configs_match_twin_in_interpreter":
        (PACKED_MASS_CHILD, 600, {}),
    "test_residual_of_kernel_matches_twin_in_interpreter":
        (RESIDUAL_OF_CHILD, 600, {}),
}

