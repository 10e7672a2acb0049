"""Fuzzed attention primitives on the PyTorch backend against float64 references (docs/reliability.md).

Over 10 000 seeded cases: shapes (Nq != Nk, ragged blocks, one token), dtypes (fp32, bf16, fp16), head dims,
scales, index lists with empty rows, padding and garbage past their counts, query groups with pads and left-out
queries, duplicated keys, residuals in the model's dtype and in fp8; and corrupted calls (out-of-range,
repeated or unsorted indices, bad counts, shapes, dtypes, block sizes, scales, residuals) that must raise
ValueError. A failure names the primitive and the seed: ``fuzz_checks.CHECKS[kind](seed)`` replays it.
``SPARSE_ATTN_FUZZ_SCALE=N`` runs N times as many cases (other seeds).
"""

import os

import pytest
import torch
from fuzz_checks import CHECKS

SCALE = max(1, int(os.environ.get("SPARSE_ATTN_FUZZ_SCALE", "1")))
COUNTS = dict(dense=1300, block=2400, token=2400, mass=1300, grouping=500, pooled=700, anchor=300, invalid=1300)
BASE_SEED = {kind: 1_000_000 * (i + 1) for i, kind in enumerate(COUNTS)}


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread is as fast alone and 8x faster on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_counts_add_up_to_the_documented_total():
    assert sum(COUNTS.values()) >= 10_000


@pytest.mark.parametrize("kind", list(COUNTS))
def test_fuzzed_primitive(kind):
    check = CHECKS[kind]
    first = BASE_SEED[kind] + (SCALE - 1) * 100_000 * (os.environ.get("SPARSE_ATTN_FUZZ_SCALE") is not None)
    ran = 0
    for seed in range(first, first + COUNTS[kind] * SCALE):
        check(seed, "torch")
        ran += 1
    assert ran == COUNTS[kind] * SCALE
