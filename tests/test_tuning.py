"""Autotuning options shared by every Triton kernel: tunings kept on disk (so a new ComfyUI process does not time
every configuration again), SPARSE_ATTN_TUNE=fresh to keep them in memory only."""

import pytest
from test_triton_interpret import PREAMBLE, run_child

pytestmark = pytest.mark.skipif(__import__("importlib").util.find_spec("triton") is None,
                                reason="Triton not installed")

CHILD = PREAMBLE + r"""
import inspect, triton
from comfyui_sparse_attention.kernels import (attention_hopper, block_sparse_triton, dense_triton, mass_triton,
                                              token_sparse_triton)
tuners = {"token": token_sparse_triton._token_fwd, "block": block_sparse_triton._bsa_fwd,
          "dense": dense_triton._dense_fwd, "mass": mass_triton._mass_fwd, "mass-packed": mass_triton._mass_packed_fwd,
          **{"hopper-" + k: attention_hopper._kernel(k) for k in ("sparse", "dense", "anchor", "persistent",
                                                                  "warp_spec")}}
supported = "cache_results" in inspect.signature(triton.autotune).parameters
print("RESULT:" + json.dumps(dict(supported=supported, cached={k: bool(getattr(t, "cache_results", False))
                                                              for k, t in tuners.items()})))
"""


def test_every_autotuned_kernel_keeps_its_tunings_on_disk():
    got = run_child(CHILD, 300, SPARSE_ATTN_TUNE="", TRITON_INTERPRET="0")  # compiled kernels, not the interpreter
    assert len(got["cached"]) == 10
    assert all(v == got["supported"] for v in got["cached"].values()), got


def test_fresh_tuning_keeps_tunings_in_memory_only():
    got = run_child(CHILD, 300, SPARSE_ATTN_TUNE="fresh", TRITON_INTERPRET="0")
    assert not any(got["cached"].values()), got
