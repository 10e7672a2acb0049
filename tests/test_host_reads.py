"""The pack's own code on an anchor's and a reuse call's path reads nothing back from the tensors it computes (issue 14;
docs/kernel_notes.md, "v27", "v28"): on a GPU each such read waits for the device. The GPU test
(tests/test_gpu_kernels.py, test_a_whole_anchor_never_waits_for_the_device) watches the whole call with PyTorch's
sync debug mode; this CPU twin watches the pack's part of it on every CI run, with a TorchFunctionMode that records
the operations that read a tensor's values on the host (item, tolist, bool/int/float, nonzero, equal, boolean-mask
indexing) when their caller is the pack's code (engine/, nodes/, kernels/). The kernels' PyTorch twins
(kernels/*_torch.py) may read (their Triton and Gluon kernels do not, which the GPU test checks), so their calls are
let through, but for the helpers there that the kernels' path runs too (SHARED_WITH_KERNELS). Not seen here: what
waits on CUDA without reading (a host scalar written into a tensor of another dtype, v27's `q_rows[-1] = n`), which
only the GPU test sees."""

import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from comfyui_sparse_attention.engine import CallContext, SparseConfig, SparseEngine, TokenLayout

from conftest import ROOT

WATCHED = (str(ROOT / "engine") + "/", str(ROOT / "nodes") + "/", str(ROOT / "kernels") + "/")
TORCH = str(Path(torch.__file__).parent) + "/"
READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
         torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero, torch.equal,
         torch.unique, torch.Tensor.unique, torch.masked_select}
# engine functions that read only off CUDA (on CUDA they take another branch): selection._same_rows compares the text
# rows' values on the CPU only
OFF_CUDA_ONLY = {"_same_rows"}
INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}
# helpers in kernels/*_torch.py that the Triton path runs as well, whose reads wait for the device on CUDA too:
# compact_triton.compact_keep sizes its lists with compact_torch.CompactLists (the width read back where no bound is
# given: mc_sparse's long key segments before keep_top's cap, docs/kernel_notes.md, "v27")
SHARED_WITH_KERNELS = {"CompactLists.__init__"}


def _watched_caller(allowed: set) -> str | None:
    """file:line of the frame that made the read, if it is the pack's code (engine/, nodes/, kernels/): the innermost
    frame outside PyTorch's own files. None where that frame is a kernel's PyTorch twin (kernels/*_torch.py, but for
    SHARED_WITH_KERNELS) or anyone else's code (ComfyUI's models, this test), or where its function is in ``allowed``
    or OFF_CUDA_ONLY."""
    frame = sys._getframe(2)
    while frame is not None and (TORCH in frame.f_code.co_filename or frame.f_code is _MODE_CODE):
        frame = frame.f_back  # PyTorch's dispatch, and another watch's own call of the operation
    name = frame.f_code.co_filename if frame is not None else ""
    if not name.startswith(WATCHED):  # not the pack's
        return None
    if name.endswith("_torch.py") and frame.f_code.co_qualname not in SHARED_WITH_KERNELS:  # a kernel's twin
        return None
    if frame.f_code.co_name in OFF_CUDA_ONLY | allowed:
        return None
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"


def _bool_index(args) -> bool:
    index = args[1] if len(args) > 1 else None
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


class NoHostReads(TorchFunctionMode):
    """While active, ``reads`` collects "operation at file:line" for each host read the pack's code makes (not its
    kernels' PyTorch twins), but for the functions named in ``allowed``."""

    def __init__(self, allowed=()):
        super().__init__()
        self.reads, self.allowed = [], set(allowed)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in READS or (func in INDEXING and _bool_index(args)):
            where = _watched_caller(self.allowed)
            if where is not None:
                self.reads.append(f"{getattr(func, '__name__', func)} at {where}")
        return func(*args, **(kwargs or {}))


_MODE_CODE = NoHostReads.__torch_function__.__code__


def watched_layer(eng, h: int, n: int, layout, seed: int):
    """Layer 0's anchor (it builds the plans and the head-group indices), then layer 1's anchor and reuse call under
    NoHostReads; q/k/v fp32 (1, h, n, 64). Returns (layer 1's cached selection, the run's statistics, the watch)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, n, 64, generator=g) for _ in range(3))
    ctx = [CallContext(layer=layer, step=step, total_steps=8, layout=layout) for layer in (0, 1) for step in (0, 1)]
    with torch.inference_mode():
        eng.begin_run()
        eng.attend(q, k, v, ctx[0])
        with NoHostReads() as watch:
            eng.attend(q, k, v, ctx[2])  # layer 1's anchor
            eng.attend(q, k, v, ctx[3])  # and its reuse call
        sel = eng.cache.on_device[ctx[2].key(n)].selection
        stats = eng.end_run()
    return sel, stats, watch


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("text", [0, 40])
@pytest.mark.parametrize("method", ["block_topk", "mc_sparse", "hybrid"])
def test_an_anchor_and_a_reuse_call_read_nothing_back_in_the_engine(method, text, per_head):
    """As the GPU test: layer 0's anchor builds the plans and the head-group indices, layer 1's anchor and reuse call
    are watched (text tokens make ragged last blocks; per_head: densities 0.05 and 0.15 on alternate heads)."""
    layout = TokenLayout(text_len=text, grid=(4, 16, 16))
    n, h = text + 1024, 4
    factors = {layer: [0.5, 1.5, 0.5, 1.5] for layer in (0, 1)} if per_head else {}
    eng = SparseEngine(SparseConfig(method=method, density=0.1, min_tokens=0, residual=True, block_q=64, block_k=64,
                                    group_size=64, backend="torch", layer_densities=factors))
    _, stats, watch = watched_layer(eng, h, n, layout, seed=3)
    assert stats.layers[1].reuses == 1
    assert watch.reads == []


@pytest.mark.parametrize("text,per_head,cap", [(0, False, True), (40, True, True), (0, False, False)],
                         ids=["video", "text-per-head", "uncapped"])
def test_a_long_segment_mc_sparse_anchor_reads_nothing_back(monkeypatch, text, per_head, cap):
    """mc_sparse with a key segment longer than 4 x SAMPLE (20 480 video tokens: keep_top's sampled threshold; with 40
    text tokens and per-head densities 0.05 / 0.15 too): layer 1's anchor and reuse call read nothing back, since
    keep_top caps long rows at keep_bound and the lists are that wide, known on the host (docs/kernel_notes.md, "v27").
    Uncapped (build_mc_sparse(..., cap=False), main's way before the cap) the watch sees the lists' width read back
    in CompactLists, the read the cap removes. ~3 s a case on the CPU."""
    from comfyui_sparse_attention.engine import policy_mc_sparse
    from comfyui_sparse_attention.engine.block_geometry import keep_bound
    if not cap:
        build = policy_mc_sparse.build_mc_sparse
        monkeypatch.setattr(policy_mc_sparse, "build_mc_sparse", lambda *a, **kw: build(*a, **kw, cap=False))
    layout = TokenLayout(text_len=text, grid=(5, 64, 64))
    video, h = 20480, 2 if per_head else 1
    n = text + video
    factors = {layer: [0.5, 1.5] for layer in (0, 1)} if per_head else {}
    eng = SparseEngine(SparseConfig(method="mc_sparse", density=0.1, min_tokens=0, residual=True, group_size=64,
                                    backend="torch", layer_densities=factors))
    sel, stats, watch = watched_layer(eng, h, n, layout, seed=5)
    assert stats.layers[1].reuses == 1
    bound = keep_bound(round((0.15 if per_head else 0.1) * video), video) + text  # the text keys: a dense pair
    if cap:
        assert watch.reads == []
        assert sel.kv_low.shape[-1] == -(-bound // 16) * 16 and int(sel.kv_counts.max()) <= bound
    else:
        assert watch.reads and all(r.startswith("__int__ at compact_torch.py") for r in watch.reads), watch.reads


OTHER_MODES = [dict(method="block_topk", residual_weighting="mass", anchor_steps="0,2"),
               dict(method="block_topk", select_every_step=True), dict(method="block_topk", residual_precision="int4"),
               dict(method="static"), dict(method="mc_sparse", residual_precision="int4"),
               dict(method="mc_sparse", grouping="cuboid"), dict(method="mc_sparse", anchor_steps="0,2"),
               dict(method="block_topk", mass=0.9)]


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("mode", OTHER_MODES, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
def test_other_modes_read_nothing_back_but_mass_widths(mode, batch):
    """Layer 1's four calls (anchors at the steps its schedule says, reuse calls between; the residual weighted by the
    mass after a later anchor, 4-bit residuals, cuboid groups, re-selection at every step, cond and uncond batched)
    read nothing back in the engine; block_topk with ``mass`` reads only its lists' widths (its counts follow the
    scores), never its key segments' columns (the plan's)."""
    layout = TokenLayout(text_len=40, grid=(4, 16, 16))
    n, h = 40 + 1024, 4
    cfg = dict(density=0.1, min_tokens=0, residual=True, block_q=64, block_k=64, group_size=64, backend="torch")
    eng = SparseEngine(SparseConfig(**{**cfg, **mode}))
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(batch, h, n, 64, generator=g) for _ in range(3))
    reads = []
    with torch.inference_mode():
        eng.begin_run()
        for layer in (0, 1):
            for step in range(4):
                ctx = CallContext(layer=layer, step=step, total_steps=8, layout=layout)
                with NoHostReads() as watch:
                    eng.attend(q, k, v, ctx)
                reads += watch.reads if layer == 1 else []
        eng.end_run()
    if mode.get("mass"):
        assert reads and all(r.startswith("__int__ at block_geometry.py") for r in reads), reads
    else:
        assert reads == []


def test_the_watch_sees_a_read_in_the_engine():
    """The watch itself: a read the engine makes is reported with its place; a kernel twin's is not, but for a helper
    the kernels' path shares (CompactLists reading the lists' width where no bound is given)."""
    from comfyui_sparse_attention.engine import block_geometry
    from comfyui_sparse_attention.kernels import compact_torch, threshold_torch
    counts = torch.tensor([[1, 2], [3, 0]])
    keep = torch.rand(2, 40) < 0.5
    with NoHostReads() as watch:
        block_geometry.rows_topk(torch.rand(2, 5), counts[:, 0])  # width=None: reads max(counts)
        threshold_torch.keep_at_threshold(torch.rand(2, 8), torch.full((2, 1), 0.5), 3)  # the twin's own check
        threshold_torch.keep_at_threshold(torch.rand(2, 8), torch.full((2, 1), 0.1), 3, cap=4)  # and its bisection
        compact_torch.compact_keep(keep, 16, width=40)  # a bound given: nothing read
        compact_torch.compact_keep(keep, 16)  # none: the width read back, as the Triton path would
        torch.equal(counts, counts)  # from here (tests/): not watched
    assert len(watch.reads) == 2, watch.reads
    assert "block_geometry.py" in watch.reads[0] and watch.reads[1].startswith("__int__ at compact_torch.py")


def test_a_comfyui_forward_reads_only_its_sigma_once():
    """Through the ComfyUI side (nodes/patch.py's wrappers and attention override, driven as ComfyUI drives them:
    tests/test_patch_runs.py): a forward's attention calls read nothing back. The one read is ``locate_call``'s, once
    per forward before its first attention call: the current sigma and the run's schedule (on the GPU in ComfyUI),
    where the device's queue holds only the sampler's update of the latent."""
    from test_patch_runs import CFG, SIGMAS, STEPS, Executor, Guider, forward

    from comfyui_sparse_attention.nodes.patch import SparseAttentionPatch
    patch, guider, reads, located = SparseAttentionPatch(CFG), Guider(), [], []

    def run(noise, latent, sampler, sigmas):
        for step in range(STEPS):  # anchors at 0 and 2 ("every 2"), reuse calls at 1 and 3; two layers each
            with NoHostReads() as everything, NoHostReads(allowed={"locate_call"}) as watch:
                forward(patch, guider.model_options["transformer_options"], step, 1)
            reads.extend(watch.reads)
            located.append(sorted({r.split(" at ")[1] for r in everything.reads}))
    patch.outer_sample(Executor(run, guider), None, None, None, SIGMAS)
    assert reads == []
    assert len(located) == STEPS and all(len(x) == 2 and all(p.startswith("forward.py") for p in x) for x in located)


COMFY_BODY = """
import sys, json, collections
sys.path.insert(0, {tests!r})
import comfy_child as C
pack = C.load_pack()
import comfy.patcher_extension as pe
import test_host_reads as H
from comfyui_sparse_attention.nodes.patch import install
from comfyui_sparse_attention.engine import SparseConfig
results = {{}}
for family in {families!r}:
    model, latent, pos, neg = C.build(family)
    cfg = SparseConfig(method={method!r}, density=0.15, min_tokens=0, group_size=64, block_q=64, block_k=64,
                       backend="torch", anchor_steps="0, 50%")
    patched, patch = install(model, cfg)
    C.sample(patched, latent, pos, neg, steps=5)  # a first run: plans built, kernels chosen
    reads, forwards = [], []

    def watched(executor, *args, **kwargs):  # around each model forward and so every attention call in it
        forwards.append(1)
        with H.NoHostReads(allowed={{"locate_call"}}) as watch:
            try:
                return executor(*args, **kwargs)
            finally:
                reads.extend(watch.reads)
    m = patched.clone()
    m.add_wrapper_with_key(pe.WrappersMP.APPLY_MODEL, "host_reads_test", watched)
    C.sample(m, latent, pos, neg, steps=5)
    results[family] = dict(forwards=len(forwards), reads=dict(collections.Counter(reads)),
                           stats=patch.last_stats.totals())
print("RESULT:" + json.dumps(results, default=str))
"""


@pytest.mark.comfyui
@pytest.mark.parametrize("method", ["mc_sparse", "block_topk"])
def test_a_comfyui_forward_reads_nothing_back_in_the_pack(method):
    """Sampling runs of ComfyUI's own tiny models (tests/comfy_child.py, every family it builds) with the patch
    installed, 5 steps with anchors at 0 and half the run: inside every model forward (the pack's wrapper and every
    attention call it overrides, anchors and reuse calls) the pack reads nothing back but the sigma ``locate_call``
    reads once per forward."""
    from comfy_subprocess import run_in_comfyui
    from conftest import comfyui_path
    from test_comfyui_integration import FAMILIES as families  # every family comfy_child.build makes
    got = run_in_comfyui(comfyui_path(), COMFY_BODY.format(tests=str(ROOT / "tests"), families=families,
                                                           method=method), timeout=900)
    assert set(got) == set(families)
    for family, r in got.items():
        assert r["forwards"] >= 5 and r["reads"] == {}, (family, r)
        assert r["stats"]["anchors"] > 0 and r["stats"]["reuses"] > 0, (family, r["stats"])
