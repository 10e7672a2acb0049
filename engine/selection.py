"""Selections: what a policy chose for one attention call, ready to run and to cache.

BlockSelection holds CSR-like block lists (the block-sparse kernel's input); TokenSelection holds query
groups and per-group KV token lists (the token-sparse kernel's input) plus the query rows computed
densely (text rows). Both offer the same interface — ``run``, ``density`` (the exact fraction of query-key
pairs computed: a float, or a 0-d float64 tensor on the device that the run's statistics read after the run, so
that an anchor never waits for the device to count its pairs: docs/kernel_notes.md, "v27"), ``nbytes``,
``map``/``tensors`` (device moves for the cache's offload), ``host_form``/``device_form`` and ``host_nbytes`` (the
narrower lists host memory keeps), ``batch_slice`` and ``picture`` (the report's map) — so nothing outside this
file tells them apart.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .. import kernels
from .block_geometry import block_sizes

from ..kernels.compact_torch import LOW_PAD, SEGMENT, decode_lists  # one definition: the kernels' list format
DECODE_CHUNK = 1 << 26  # list entries compacted at a time (int32 scratch of 256 MiB)
HOST_INDEX_MAX = 32767  # block lists whose indices stay below this are kept as int16 in host memory


def _nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


@dataclass
class BlockSelection:
    """kv_indices int32 (B, H, nqb, max_k) sorted per row; kv_counts int32 (B, H, nqb); density: the exact fraction
    of pairs (a float, or a 0-d float64 tensor on the lists' device); planned: the fraction the policy aimed at,
    known on the host (None: ``density``, when a float, stands in), which chooses the anchor's path."""

    kv_indices: torch.Tensor
    kv_counts: torch.Tensor
    block_q: int
    block_k: int
    density: float | torch.Tensor
    planned: float | None = None

    def run(self, q, k, v, *, scale=None, backend="auto", residual=None) -> torch.Tensor:
        """q: (B, H, N, D) -> out (B, H, N, D) over the selected blocks, plus ``residual`` (a Residual or None)
        added in the kernel's epilogue."""
        return kernels.block_sparse_attention(q, k, v, self.kv_indices, self.kv_counts, block_q=self.block_q,
                                              block_k=self.block_k, scale=scale, backend=backend,
                                              validate=False, residual=residual)

    def anchor(self, q, k, v, *, scale=None, backend="auto", precision="fp8", mass=False):
        """The anchor step (kernels.block_anchor_attention: on Hopper one pass of the Gluon kernel; elsewhere one fused
        pass, or at low density one dense call plus the sparse kernel forming R; the planned density chooses):
        (out_dense (B, H, N, D), residual (data, scale) pair of R = dense - sparse in ``precision``: "fp8" or
        "model"; with ``mass`` a (data, scale, mass) triple, mass fp32 (B, H, N, 2) for mass-weighted reuse calls).
        Off the Gluon anchor the path is chosen by the planned density, so the exact one may stay on the device
        (without either, the kernels' host bound stands in)."""
        known = self.planned if self.planned is not None else \
            None if isinstance(self.density, torch.Tensor) else self.density
        return kernels.block_anchor_attention(q, k, v, self.kv_indices, self.kv_counts, block_q=self.block_q,
                                              block_k=self.block_k, scale=scale, residual_precision=precision,
                                              backend=backend, validate=False, return_mass=mass, density=known)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.kv_indices, self.kv_counts)

    def _narrows(self) -> bool:
        """Whether host memory keeps the lists as int16: int32 lists whose indices all fit. No synchronisation: the
        engine's lists are self-attention's (as many key as query tokens), so no index reaches
        ceil(nqb * block_q / block_k)."""
        bound = -(-self.kv_counts.shape[-1] * self.block_q // self.block_k)
        return self.kv_indices.dtype == torch.int32 and bound <= HOST_INDEX_MAX

    def host_form(self) -> "BlockSelection":
        """This selection as host memory keeps it: kv_indices int16 (half the bytes; an offloaded entry's lists at Wan
        14B 720p are ~9 MB a layer in int32) where every block index fits, else unchanged. ``device_form`` restores
        int32 for the kernels."""
        if not self._narrows():
            return self
        return dataclasses.replace(self, kv_indices=self.kv_indices.to(torch.int16))

    def host_tensor_nbytes(self) -> list[int]:
        """The bytes of each of ``host_form().tensors()`` without making it (the host buffers ``pinned`` asks for)."""
        idx = self.kv_indices.numel() * (2 if self._narrows() else self.kv_indices.element_size())
        return [idx, self.kv_counts.numel() * self.kv_counts.element_size()]

    @property
    def host_nbytes(self) -> int:
        """``host_form().nbytes`` without making it."""
        return sum(self.host_tensor_nbytes())

    @property
    def device_nbytes(self) -> int:
        """``device_form().nbytes`` without making it: a host form's int16 lists count as the int32 they become."""
        return self.nbytes + (self.kv_indices.numel() * 2 if self.kv_indices.dtype == torch.int16 else 0)

    def device_form(self) -> "BlockSelection":
        """The lists as the kernels take them (int32 kv_indices), from ``host_form`` or as they are."""
        if self.kv_indices.dtype == torch.int32:
            return self
        return dataclasses.replace(self, kv_indices=self.kv_indices.to(torch.int32))

    def map(self, fn) -> "BlockSelection":
        """A copy with ``fn`` applied to every tensor (device moves, pinned copies)."""
        return dataclasses.replace(self, kv_indices=fn(self.kv_indices), kv_counts=fn(self.kv_counts))

    def tensors(self):
        return (self.kv_indices, self.kv_counts)

    def batch_slice(self, start: int, stop: int) -> "BlockSelection":
        """The selection of batch rows [start, stop) (views)."""
        return self.map(lambda t: t[start:stop])

    def head_density(self, n: int) -> torch.Tensor:
        """Exact fraction of (query, key) pairs each head computes for a call of n tokens: float64 (H,), the mean
        over batch rows."""
        return _block_pairs(self.kv_indices, self.kv_counts, n, n, self.block_q, self.block_k).mean(0)

    @staticmethod
    def concat_heads(parts: list["BlockSelection"], heads: list[list[int]] | None = None) -> "BlockSelection":
        """One selection from selections of disjoint head sets of the same call: parts[i] holds the heads
        ``heads[i]`` (original head numbers; together a permutation of 0..H-1), or, without ``heads``, the
        parts follow each other in head order. List widths are padded with -1 to the widest part; the density
        is the head-weighted mean of the parts' exact densities (every part covers B x its heads x N x N)."""
        _same(parts, "block_q", "block_k")
        _same_shape(parts, lambda p: (p.kv_counts.shape[0], p.kv_counts.shape[2]), "batch and query blocks")
        width = max(p.kv_indices.shape[-1] for p in parts)
        idx = torch.cat([torch.nn.functional.pad(p.kv_indices, (0, width - p.kv_indices.shape[-1]), value=-1)
                         for p in parts], dim=1)
        cnt = torch.cat([p.kv_counts for p in parts], dim=1)
        heads_of = lambda p: p.kv_counts.shape[1]  # noqa: E731
        order = _inverse_order(parts, heads, heads_of, idx.device)
        if order is not None:
            idx, cnt = idx.index_select(1, order), cnt.index_select(1, order)
        planned = None if any(p.planned is None for p in parts) else \
            sum(p.planned * heads_of(p) for p in parts) / max(1, sum(map(heads_of, parts)))
        return BlockSelection(idx.contiguous(), cnt.contiguous(), parts[0].block_q, parts[0].block_k,
                              _head_mean(parts, heads_of), planned)

    def picture(self, n: int, width: int = 256) -> dict:
        """Batch 0, head 0 as a map for the report: {"kind": "block", "map": float (rows, cols) in [0, 1]},
        query blocks by KV blocks, average-pooled to at most ``width`` x ``width``."""
        idx, cnt = self.kv_indices[0, 0], self.kv_counts[0, 0]
        nqb = cnt.shape[0]
        nkb = -(-n // self.block_k)
        grid = torch.zeros(nqb, nkb + 1)
        valid = torch.arange(idx.shape[-1], device=idx.device) < cnt.unsqueeze(-1)
        cols = torch.where(valid, idx.long(), nkb).cpu()
        grid.scatter_(1, cols, 1.0)
        grid = grid[:, :nkb]
        if max(grid.shape) > width:  # bound the picture's memory
            grid = torch.nn.functional.adaptive_avg_pool2d(grid[None, None], (min(width, nqb), min(width, nkb)))[0, 0]
        return {"kind": "block", "map": grid}


@dataclass
class TokenSelection:
    """Groups of C queries with their own sorted KV token lists, stored compactly.

    q_groups int32 (B, H, G, C) (-1 pads); kv_low int16 (B, H, G, W), W a multiple of 16 (kernels.compact_keep):
    each token id minus 65536 * segment, shifted into int16, LOW_PAD past the count; seg_ends int32 (B, H, G, S):
    where each 65536-token segment's entries end in the (sorted) list; kv_counts int32 (B, H, G). Decoding is
    elementwise (no sort), half the bytes of int32 ids. dense_rows int64 (R,) query rows computed densely (text), or
    None. covers_all: every query row is in a group or in dense_rows (build_mc_sparse's selections are), so a reuse
    call writes every row itself and the kernel's fill of rows in no group (a decode pass of the whole residual) is
    skipped.
    """

    q_groups: torch.Tensor
    kv_low: torch.Tensor
    seg_ends: torch.Tensor
    kv_counts: torch.Tensor
    dense_rows: torch.Tensor | None
    density: float | torch.Tensor  # a float, or a 0-d float64 tensor on the lists' device
    covers_all: bool = False

    @staticmethod
    def compact(kv_tokens, kv_counts, n_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """int32 sorted lists (B, H, G, W) -> (kv_low int16 (B, H, G, W), seg_ends int32 (B, H, G, S)).

        Works a few heads at a time in int32, so the scratch stays small next to the lists (an anchor
        at 119k tokens and density 0.25 holds 2.7 GB of int32 lists; int64 copies of them ran the GPU
        out of memory)."""
        if n_tokens is None:
            n_tokens = (int(kv_tokens.max()) + 1) if kv_tokens.numel() else 1
        n_seg = max(1, -(-int(n_tokens) // SEGMENT))
        h = kv_tokens.shape[1]
        low = torch.empty(kv_tokens.shape, dtype=torch.int16, device=kv_tokens.device)
        seg_ends = torch.empty((*kv_tokens.shape[:3], n_seg), dtype=torch.int32, device=kv_tokens.device)
        step = max(1, DECODE_CHUNK // max(1, kv_tokens.numel() // max(1, h)))
        for h0 in range(0, h, step):
            tok = kv_tokens[:, h0:h0 + step].to(torch.int32, copy=True)
            seg = torch.where(tok >= 0, tok // SEGMENT, n_seg)
            for s in range(n_seg):
                seg_ends[:, h0:h0 + step, :, s] = (seg <= s).sum(-1, dtype=torch.int32)
            del seg
            low[:, h0:h0 + step] = (tok.clamp_(min=0).remainder_(SEGMENT).sub_(32768)).to(torch.int16)
        torch.minimum(seg_ends, kv_counts.to(torch.int32).unsqueeze(-1), out=seg_ends)
        return low, seg_ends

    def kv_tokens(self) -> torch.Tensor:
        """Decoded int32 token lists (B, H, G, W16), W16 the lists' width rounded up to a multiple of 16; entries past
        the count are meaningless (``kernels.compact_torch.decode_lists``; the kernels decode in registers)."""
        return decode_lists(self.kv_low, self.seg_ends, SEGMENT)

    def run(self, q, k, v, *, scale=None, backend="auto", residual=None) -> torch.Tensor:
        """q: (B, H, N, D) -> out (B, H, N, D): grouped token-sparse rows plus ``residual`` (a Residual or None,
        added in the kernel's epilogue), dense text rows."""
        out = kernels.token_sparse_attention_compact(q, k, v, self.q_groups, self.kv_low, self.seg_ends,
                                                     self.kv_counts, scale=scale, backend=backend, validate=False,
                                                     residual=residual, fill_ungrouped=not self.covers_all)
        if self.dense_rows is not None and self.dense_rows.numel():
            rows = self.dense_rows
            out[:, :, rows] = kernels.attention_dense(q[:, :, rows], k, v, scale=scale, backend=backend)
        return out

    @property
    def nbytes(self) -> int:
        return _nbytes(self.q_groups, self.kv_low, self.seg_ends, self.kv_counts, self.dense_rows)

    def host_form(self) -> "TokenSelection":
        """As host memory keeps it: unchanged (the lists are int16 already)."""
        return self

    def host_tensor_nbytes(self) -> list[int]:
        """The bytes of each of its tensors (host memory keeps them as they are)."""
        return [t.numel() * t.element_size() for t in self.tensors()]

    @property
    def host_nbytes(self) -> int:
        """Its bytes in host memory: ``nbytes``."""
        return self.nbytes

    @property
    def device_nbytes(self) -> int:
        """Its bytes on the device: ``nbytes``."""
        return self.nbytes

    def device_form(self) -> "TokenSelection":
        """As the kernels take it: unchanged."""
        return self

    def map(self, fn) -> "TokenSelection":
        """A copy with ``fn`` applied to every tensor (device moves, pinned copies)."""
        return dataclasses.replace(self, q_groups=fn(self.q_groups), kv_low=fn(self.kv_low),
                                   seg_ends=fn(self.seg_ends), kv_counts=fn(self.kv_counts),
                                   dense_rows=None if self.dense_rows is None else fn(self.dense_rows))

    def tensors(self):
        return tuple(t for t in (self.q_groups, self.kv_low, self.seg_ends, self.kv_counts, self.dense_rows)
                     if t is not None)

    def batch_slice(self, start: int, stop: int) -> "TokenSelection":
        """The selection of batch rows [start, stop) (views; the dense rows are shared by every row)."""
        return dataclasses.replace(self, q_groups=self.q_groups[start:stop], kv_low=self.kv_low[start:stop],
                                   seg_ends=self.seg_ends[start:stop], kv_counts=self.kv_counts[start:stop])

    def picture(self, n: int, width: int = 256) -> dict:
        """Batch 0, head 0 as a map for the report: {"kind": "token", "map": float (groups, bins) in [0, 1]},
        the share of each of ``min(width, n)`` token bins that each query group keeps. Decodes one head only."""
        one = self.head(0, 0)
        toks, cnt = one.kv_tokens()[0, 0], one.kv_counts[0, 0]
        g = cnt.shape[0]
        bins = min(width, n)
        if g == 0:  # every row computed densely (no segment with a sparse pair)
            return {"kind": "token", "map": torch.ones(1, bins)}
        grid = torch.zeros(g, bins + 1)
        valid = torch.arange(toks.shape[-1], device=toks.device) < cnt.unsqueeze(-1)
        cols = torch.where(valid, (toks.long() * bins) // n, bins).cpu()
        grid.scatter_add_(1, cols, torch.ones_like(cols, dtype=grid.dtype))
        per_bin = max(1, n // bins)
        return {"kind": "token", "map": (grid[:, :bins] / per_bin).clamp(max=1.0)}

    def head_density(self, n: int) -> torch.Tensor:
        """Exact fraction of (query, key) pairs each head computes for a call of n tokens: float64 (H,), the mean
        over batch rows (dense text rows count n keys each)."""
        real_q = (self.q_groups >= 0).sum(-1).double()
        text = 0 if self.dense_rows is None else self.dense_rows.numel()
        pairs = (real_q * self.kv_counts.double()).sum(-1) + text * n
        return (pairs / (n * n)).mean(0).cpu()

    @staticmethod
    def concat_heads(parts: list["TokenSelection"], heads: list[list[int]] | None = None) -> "TokenSelection":
        """One selection from selections of disjoint head sets of the same call (see
        ``BlockSelection.concat_heads`` for ``heads``). Token lists are padded to the widest part (entries past
        a group's count are never read); query groups, segment ends and the dense (text) rows must agree in
        shape, and the dense rows in value where that costs no wait (``_same_rows``); the density is the
        head-weighted mean of the parts' densities."""
        _same_shape(parts, lambda p: (p.q_groups.shape[0], p.q_groups.shape[2], p.q_groups.shape[3],
                                      p.seg_ends.shape[-1]), "batch, query groups and segments")
        rows = parts[0].dense_rows
        for p in parts[1:]:
            if (p.dense_rows is None) != (rows is None) or (rows is not None and not _same_rows(p.dense_rows, rows)):
                raise ValueError("concat_heads: the parts compute different dense (text) rows")
        width = max(p.kv_low.shape[-1] for p in parts)
        cat = lambda ts: torch.cat(ts, dim=1)  # noqa: E731
        out = [cat([p.q_groups for p in parts]),
               cat([torch.nn.functional.pad(p.kv_low, (0, width - p.kv_low.shape[-1]), value=LOW_PAD)
                    for p in parts]),
               cat([p.seg_ends for p in parts]), cat([p.kv_counts for p in parts])]
        order = _inverse_order(parts, heads, lambda p: p.kv_counts.shape[1], out[0].device)
        if order is not None:
            out = [t.index_select(1, order) for t in out]
        return TokenSelection(*(t.contiguous() for t in out), rows,
                              _head_mean(parts, lambda p: p.kv_counts.shape[1]), all(p.covers_all for p in parts))

    def head(self, b: int, h: int) -> "TokenSelection":
        """The selection of batch row ``b``, head ``h`` alone, shapes (1, 1, G, ...) (views): decoding it
        touches 1/(B*H) of the lists (a report picture of a CPU-resident entry stays cheap)."""
        pick = (slice(b, b + 1), slice(h, h + 1))
        return dataclasses.replace(self, q_groups=self.q_groups[pick], kv_low=self.kv_low[pick],
                                   seg_ends=self.seg_ends[pick], kv_counts=self.kv_counts[pick])


def _same(parts, *names) -> None:
    if not parts:
        raise ValueError("concat_heads: no parts")
    for name in names:
        values = {getattr(p, name) for p in parts}
        if len(values) > 1:
            raise ValueError(f"concat_heads: the parts differ in {name} ({sorted(values)})")


def _same_shape(parts, key, what: str) -> None:
    if not parts:
        raise ValueError("concat_heads: no parts")
    shapes = {tuple(key(p)) for p in parts}
    if len(shapes) > 1:
        raise ValueError(f"concat_heads: the parts differ in {what} ({sorted(shapes)})")


def _same_rows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two parts' dense (text) rows, int64 (R,), agree: in shape always, in value only off CUDA. On CUDA the
    comparison would wait for the device inside the anchor (issue 14; found by the whole-anchor GPU test,
    docs/kernel_notes.md, "v28"), and every part of one call lists the same layout's text rows, so it cannot differ
    there; the CPU tests check the values."""
    if a.shape != b.shape:
        return False
    return a.is_cuda or torch.equal(a, b)


def _head_mean(parts, n_heads) -> float | torch.Tensor:
    """Density of the union: each part's exact density weighted by its head count (same B and N); a 0-d tensor
    where a part's is one (computed on the device, not read)."""
    total = sum(n_heads(p) for p in parts)
    return sum(p.density * n_heads(p) for p in parts) / max(1, total)


def _inverse_order(parts, heads, n_heads, device):
    """Index that puts the concatenated heads back in original order (None: already in order)."""
    if heads is None:
        return None
    if len(heads) != len(parts) or any(len(h) != n_heads(p) for h, p in zip(heads, parts)):
        raise ValueError("concat_heads: heads must list each part's head numbers")
    flat = [h for hs in heads for h in hs]
    if sorted(flat) != list(range(len(flat))):
        raise ValueError(f"concat_heads: the parts' heads are not a permutation of 0..{len(flat) - 1}")
    if flat == sorted(flat):
        return None
    position = [0] * len(flat)
    for i, h in enumerate(flat):
        position[h] = i
    return device_index(tuple(position), device)


_INDICES: dict[tuple, torch.Tensor] = {}
INDICES_KEPT = 1024  # index tensors kept (a few per layer with per-head densities: docs/kernel_notes.md, "v27")


def device_index(values: tuple[int, ...], device) -> torch.Tensor:
    """int64 (len(values),) of ``values`` on ``device``, made once and kept: a tensor made from a host list is a copy
    that waits for the device, and a run asks for the same few (per-head densities' head groups) at every anchor.
    Callers must not write into it."""
    key = (values, str(device))
    out = _INDICES.get(key)
    if out is None:
        if len(_INDICES) >= INDICES_KEPT:
            _INDICES.clear()
        out = _INDICES[key] = torch.tensor(values, dtype=torch.long, device=device)
    return out


def block_pairs_fraction(kv_indices, kv_counts, nq, nk, block_q, block_k) -> float:
    """Exact fraction of (query, key) pairs a block selection computes (ragged last blocks counted), read on the
    host."""
    return float(block_pairs_on_device(kv_indices, kv_counts, nq, nk, block_q, block_k))


def block_pairs_on_device(kv_indices, kv_counts, nq, nk, block_q, block_k) -> torch.Tensor:
    """``block_pairs_fraction`` left on the lists' device: kv_indices int (B, H, nqb, K), kv_counts int (B, H, nqb)
    -> 0-d float64 tensor, computed without a host synchronisation."""
    return _pairs_per_head(kv_indices, kv_counts, nq, nk, block_q, block_k).mean()


def _block_pairs(kv_indices, kv_counts, nq, nk, block_q, block_k) -> torch.Tensor:
    """Exact fraction of (query, key) pairs per (batch, head): float64 (B, H) on the CPU."""
    return _pairs_per_head(kv_indices, kv_counts, nq, nk, block_q, block_k).cpu()


def _pairs_per_head(kv_indices, kv_counts, nq, nk, block_q, block_k) -> torch.Tensor:
    """Exact fraction of (query, key) pairs per (batch, head): float64 (B, H) on the lists' device."""
    dev = kv_counts.device
    q_rows = block_sizes(nq, block_q, dev)
    nkb = -(-nk // block_k)
    kv_size = torch.nn.functional.pad(block_sizes(nk, block_k, dev), (0, 1))  # slot nkb: the -1 pads, 0 tokens
    valid = torch.arange(kv_indices.shape[-1], device=kv_indices.device) < kv_counts.unsqueeze(-1)
    idx = torch.where(valid, kv_indices.long(), torch.full_like(kv_indices.long(), nkb))
    keys = kv_size[idx].sum(-1)
    return (keys * q_rows).sum(-1) / (nq * nk)
