"""kernels.compact_keep (the kept-token mask of an mc_sparse anchor -> compact int16 lists): the PyTorch twin
against the lists the engine built before (compact_rows + TokenSelection.compact), decoding, bad input."""

import pytest
import torch

from comfyui_sparse_attention.engine.block_geometry import compact_rows
from comfyui_sparse_attention.engine.selection import TokenSelection
from comfyui_sparse_attention.kernels import compact_keep
from comfyui_sparse_attention.kernels.compact_torch import LOW_PAD


def random_keep(shape, p, seed):
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(shape, generator=g) < p
    keep[..., 0, :] = False      # an empty row
    keep[..., -1, :] = True      # a full row
    return keep


@pytest.mark.parametrize("rows,length,p", [(5, 1000, 0.3), (3, 70000, 0.1), (4, 131072, 0.02), (2, 65536, 0.5)])
def test_twin_equals_the_lists_built_before(monkeypatch, rows, length, p):
    from comfyui_sparse_attention.kernels import compact_torch
    monkeypatch.setattr(compact_torch, "CHUNK_ELEMS", 2 * length)  # two rows per chunk: the chunk loop runs
    keep = random_keep((1, 1, rows, length), p, seed=rows + length)
    idx, cnt = compact_rows(keep.view(rows, length))
    low0, ends0 = TokenSelection.compact(idx.view(1, 1, rows, -1), cnt.view(1, 1, rows), length)
    low, ends, counts = compact_keep(keep, backend="torch")
    assert low.dtype == torch.int16 and ends.dtype == torch.int32 and counts.dtype == torch.int32
    w0 = low0.shape[-1]  # the old lists' width was the longest count; now it is rounded up to a multiple of 16
    assert low.shape[-1] == -(-w0 // 16) * 16 and (low[..., w0:] == LOW_PAD).all()
    assert torch.equal(low[..., :w0], low0) and torch.equal(ends, ends0) and torch.equal(counts, cnt.view(1, 1, rows))


@pytest.mark.parametrize("segment", [16, 64, 1 << 16])
def test_lists_decode_to_the_kept_columns(segment):
    keep = random_keep((2, 3, 200), 0.2, seed=segment)
    low, ends, counts = compact_keep(keep, segment=segment, backend="torch")
    assert ends.shape == (2, 3, -(-200 // segment)) and low.shape[-1] == -(-int(counts.max()) // 16) * 16
    slot = torch.arange(low.shape[-1])
    for b in range(2):
        for r in range(3):
            tok = low[b, r].to(torch.int64) + 32768
            tok = tok + segment * (slot.unsqueeze(-1) >= ends[b, r]).sum(-1)
            n = int(counts[b, r])
            assert torch.equal(tok[:n], keep[b, r].nonzero().view(-1))
            assert (low[b, r, n:] == LOW_PAD).all()
            assert int(ends[b, r, -1]) == n


def test_nothing_kept_gives_empty_lists():
    low, ends, counts = compact_keep(torch.zeros(2, 5, 300, dtype=torch.bool))
    assert low.shape == (2, 5, 0) and (ends == 0).all() and (counts == 0).all()


@pytest.mark.parametrize("keep,segment,match", [
    (torch.zeros(3, 4), 1 << 16, "bool"), (torch.zeros((), dtype=torch.bool), 1 << 16, "bool"),
    (torch.zeros(3, 4, dtype=torch.bool), 100, "segment"), (torch.zeros(3, 4, dtype=torch.bool), 8, "segment"),
    (torch.zeros(3, 4, dtype=torch.bool), 1 << 17, "segment"), (torch.zeros(3, 4, dtype=torch.bool), True, "segment"),
])
def test_bad_input_is_a_value_error(keep, segment, match):
    with pytest.raises(ValueError, match=match):
        compact_keep(keep, segment=segment)
