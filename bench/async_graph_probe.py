"""Which use of the query grouping's CUDA graph (kernels/grouping_graph.py) fails under PyTorch's cudaMallocAsync
backend (ComfyUI's default allocator): one stage per process, so that an abort names its stage.

    PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync python bench/async_graph_probe.py STAGE

Stages: "capture" (a shape's calls: as it is, captured, replayed; then release(), a collection and the cache emptied),
"graph_first" (the same calls, then each graph destroyed before its output is freed: the order release() had in v25),
"engine" (an mc_sparse run at 16 384 tokens: an anchor, two reuse steps, end_run, the engine dropped), "cublas"
(a capture whose first cuBLAS call on the capture's stream happens inside it, then torch.cuda.empty_cache()),
"torch_gather" (the grouping captured with PyTorch's row gather instead of the Triton kernel, whose launcher refuses
a pointer the capture allocated under cudaMallocAsync, as ``grouping_graph.graph_gather`` chooses there:
docs/kernel_notes.md, "v27", "v28"; then each way timed per call).
Each step is logged before it runs; "ok" last. Needs CUDA.
"""

from __future__ import annotations

import faulthandler
import gc
import logging
import sys
import time

import torch
from _pack import load

log = logging.getLogger("bench.async_graph_probe")


def step(name):
    log.info("step: %s", name)
    sys.stdout.flush()


def grouped_calls(K, GG, calls):
    """One shape's grouping called ``calls`` times (as it is, then captured, then replayed): the queries and the
    first call's groups, which every later call must equal."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 8, 16384, 128, device="cuda", generator=g).to(torch.bfloat16)
    want = None
    for i in range(calls):
        step(f"call {i} (graphs {len(GG._graphs)})")
        got = K.group_queries(q, 128, dims=16)
        want = got if want is None else want
        assert torch.equal(got, want)
    torch.cuda.synchronize()
    return q, want


def capture_stage(K, GG):
    q, want = grouped_calls(K, GG, 4)
    step("release")
    GG.release()
    step("synchronize")
    torch.cuda.synchronize()
    step("gc")
    gc.collect()
    step("empty_cache")
    torch.cuda.empty_cache()
    step("drop the outputs")
    del want, q
    torch.cuda.synchronize()


def graph_first_stage(K, GG):
    """v25's order, kept to test our reading of its crash (docs/kernel_notes.md, "v26"): the graph destroyed first,
    then its captured output freed (release() now frees the tensors first)."""
    grouped_calls(K, GG, 3)
    entries = list(GG._graphs.values())
    step(f"destroy {len(entries)} graph(s) first")
    for e in entries:
        graph, e.graph = e.graph, None
        graph.reset()
        del graph
    torch.cuda.synchronize()
    step("then free their outputs")
    for e in entries:
        e.groups = e.points = e.keep = None
    torch.cuda.synchronize()
    step("release")
    GG.release()
    torch.cuda.synchronize()


def torch_gather_stage(K, GG):
    """Captures the grouping with ``gather_torch.gather_rows`` (index_select) where the Triton gather's capture fails,
    checks the replays' groups against the uncaptured Triton path, and times per call (16 384 tokens, 8 and 40 heads):
    without a graph (Triton gathers, as under cudaMallocAsync before v28) against the graph, which captures PyTorch's
    gathers under cudaMallocAsync (``graph_gather``; the caller's Triton gathers under the native allocator)."""
    GT, gather_triton = (load(f"kernels.{m}") for m in ("grouping_torch", "gather_triton"))
    for heads in (8, 40):
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(1, heads, 16384, 128, device="cuda", generator=g).to(torch.bfloat16)
        ways = {"triton gathers, no graph": dict(gather=gather_triton.gather_rows),
                # as the engine calls it: group_points captures graph_gather(...) (PyTorch's gathers, cudaMallocAsync)
                "graph": dict(gather=gather_triton.gather_rows, partition=GG.group_points)}
        want = GT.group_queries(q, 128, 16, gather=gather_triton.gather_rows)
        for name, kw in ways.items():
            for i in range(3):  # as it is, captured, replayed
                step(f"{heads} heads, {name}: call {i} (graphs {len(GG._graphs)})")
                assert torch.equal(GT.group_queries(q, 128, 16, **kw), want)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                GT.group_queries(q, 128, 16, **kw)
            torch.cuda.synchronize()
            log.info("time: %d heads, %s: %.3f ms a call", heads, name, (time.perf_counter() - t0) / 20 * 1e3)
    step("release")
    GG.release()
    torch.cuda.synchronize()


def engine_stage():
    E = load("engine")
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(2, 4, 16384, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    layout = E.TokenLayout(text_len=0, grid=(16, 32, 32))
    eng = E.SparseEngine(E.SparseConfig(method="mc_sparse", density=0.15, min_tokens=0, residual=True))
    for run in range(2):
        step(f"run {run}: begin")
        eng.begin_run()
        for s in range(4):
            for layer in range(3):
                step(f"run {run} step {s} layer {layer}")
                eng.attend(q, k, v, E.CallContext(layer=layer, step=s, layout=layout))
        torch.cuda.synchronize()
        step(f"run {run}: end")
        eng.end_run()
        torch.cuda.synchronize()
    step("drop the engine")
    del eng
    gc.collect()
    torch.cuda.synchronize()
    step("empty_cache")
    torch.cuda.empty_cache()
    torch.cuda.synchronize()


def cublas_stage():
    a = torch.randn(256, 256, device="cuda")
    graph = torch.cuda.CUDAGraph()
    step("capture a matmul")
    with torch.cuda.graph(graph):
        b = a @ a
    graph.replay()
    torch.cuda.synchronize()
    step("drop the graph")
    del graph, b
    gc.collect()
    step("empty_cache")
    torch.cuda.empty_cache()
    torch.cuda.synchronize()


def main():
    faulthandler.enable()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    stage = sys.argv[1]
    log.info("allocator %s, torch %s, %s", torch.cuda.get_allocator_backend(), torch.__version__,
             torch.cuda.get_device_name())
    K = load("kernels")
    if stage == "capture":
        capture_stage(K, load("kernels.grouping_graph"))
    elif stage == "graph_first":
        graph_first_stage(K, load("kernels.grouping_graph"))
    elif stage == "torch_gather":
        torch_gather_stage(K, load("kernels.grouping_graph"))
    elif stage == "engine":
        engine_stage()
    elif stage == "cublas":
        cublas_stage()
    else:
        raise SystemExit(f"unknown stage {stage!r}")
    log.info("ok")


if __name__ == "__main__":
    main()
