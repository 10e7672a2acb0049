"""Triton kernels under the CPU interpreter (TRITON_INTERPRET=1), compared with their PyTorch twins.

fp16 and fp32 only: the interpreter's bf16 ``tl.dot`` is wrong (triton issue #11584). Each case runs in
a child process because TRITON_INTERPRET is read when the kernels are defined.
"""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.skipif(__import__("importlib").util.find_spec("triton") is None,
                                reason="Triton not installed")

CHILD = r"""
import importlib.util, json, sys, torch
spec = importlib.util.spec_from_file_location("comfyui_sparse_attention", sys.argv[1] + "/__init__.py",
                                              submodule_search_locations=[sys.argv[1]])
pack = importlib.util.module_from_spec(spec); sys.modules["comfyui_sparse_attention"] = pack
spec.loader.exec_module(pack)
sys.path.insert(0, sys.argv[1] + "/tests")
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
print("RESULT:" + json.dumps(results))
"""


def test_triton_kernels_match_twins_in_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", CHILD, str(ROOT)], env=env, capture_output=True, text=True,
                          timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT:")]
    assert proc.returncode == 0 and lines, proc.stderr[-6000:]
    results = json.loads(lines[-1][7:])
    assert len(results) == 2 * 4 * 6
    bad = {}
    for name, errs in results.items():
        tol = 2e-3 if "float16" in name else 1e-5
        for e in errs:
            if e["nan"] or not e["same_inf"] or e["rel"] > tol:
                bad[name] = errs
    assert not bad, bad
