"""Fuzzed Triton kernels under the CPU interpreter (TRITON_INTERPRET=1) against the float64 references: a few
hundred seeded cases of the same generator as tests/test_fuzz_primitives.py (head dims 64/80/96/128, fp16 and
fp32 — the interpreter's bf16 ``tl.dot`` is wrong, triton issue #11584 — N up to 160, residuals, garbage past
list counts) and corrupted calls that must raise ValueError. The cases run in one child process because
TRITON_INTERPRET is read when the kernels are defined."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")

COUNTS = dict(dense=60, block=90, token=90, mass=60, invalid=40)

CHILD = r"""
import importlib.util, json, sys, traceback, torch
root = sys.argv[1]
spec = importlib.util.spec_from_file_location("comfyui_sparse_attention", root + "/__init__.py",
                                              submodule_search_locations=[root])
pack = importlib.util.module_from_spec(spec); sys.modules["comfyui_sparse_attention"] = pack
spec.loader.exec_module(pack)
sys.path.insert(0, root + "/tests")
torch.set_num_threads(1)
from fuzz_checks import CHECKS
counts = json.loads(sys.argv[2])
ran, failures = {}, []
for i, (kind, n) in enumerate(counts.items()):
    ran[kind] = 0
    for seed in range(50_000_000 + 1_000_000 * i, 50_000_000 + 1_000_000 * i + n):
        try:
            CHECKS[kind](seed, "triton")
        except Exception as exc:
            failures.append(f"{kind} seed {seed}: {type(exc).__name__}: {str(exc)[:300]}")
        ran[kind] += 1
print("RESULT:" + json.dumps(dict(ran=ran, failures=failures)))
"""


def test_fuzzed_triton_kernels_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), json.dumps(COUNTS)], env=env, capture_output=True,
                          text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT:")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    r = json.loads(lines[-1][len("RESULT:"):])
    assert r["ran"] == COUNTS
    assert not r["failures"], "\n".join(r["failures"][:20])
