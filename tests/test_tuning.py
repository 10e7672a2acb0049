"""Autotuning options shared by every Triton kernel: tunings kept on disk (so a new ComfyUI process does not time
every configuration again), SPARSE_ATTN_TUNE=fresh to keep them in memory only."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.skipif(__import__("importlib").util.find_spec("triton") is None,
                                reason="Triton not installed")

CHILD = r"""
import importlib.util, inspect, json, sys, triton
spec = importlib.util.spec_from_file_location("comfyui_sparse_attention", sys.argv[1] + "/__init__.py",
                                              submodule_search_locations=[sys.argv[1]])
pack = importlib.util.module_from_spec(spec); sys.modules["comfyui_sparse_attention"] = pack
spec.loader.exec_module(pack)
from comfyui_sparse_attention.kernels import (attention_hopper, block_sparse_triton, dense_triton, mass_triton,
                                              token_sparse_triton)
tuners = {"token": token_sparse_triton._token_fwd, "block": block_sparse_triton._bsa_fwd,
          "dense": dense_triton._dense_fwd, "mass": mass_triton._mass_fwd,
          **{"hopper-" + k: attention_hopper._kernel(k) for k in ("sparse", "dense", "anchor", "persistent",
                                                                  "warp_spec")}}
supported = "cache_results" in inspect.signature(triton.autotune).parameters
print("RESULT:" + json.dumps(dict(supported=supported, cached={k: bool(getattr(t, "cache_results", False))
                                                              for k, t in tuners.items()})))
"""


def _child(**env):
    proc = subprocess.run([sys.executable, "-c", CHILD, str(ROOT)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES="", **env))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT:")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][7:])


def test_every_autotuned_kernel_keeps_its_tunings_on_disk():
    got = _child(SPARSE_ATTN_TUNE="", TRITON_INTERPRET="0")
    assert len(got["cached"]) == 9
    assert all(v == got["supported"] for v in got["cached"].values()), got


def test_fresh_tuning_keeps_tunings_in_memory_only():
    got = _child(SPARSE_ATTN_TUNE="fresh", TRITON_INTERPRET="0")
    assert not any(got["cached"].values()), got
