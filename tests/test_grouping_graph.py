"""kernels/grouping_graph.py off the GPU: the partition runs as it is, nothing is kept, and the engine frees the
graphs at every run's end (the graphs themselves are tested on the GPU: tests/test_gpu_kernels.py)."""

import weakref

import torch

from comfyui_sparse_attention import kernels
from comfyui_sparse_attention.engine import SparseConfig, SparseEngine
from comfyui_sparse_attention.kernels import grouping_graph, grouping_torch


def test_off_cuda_the_partition_runs_as_it_is_and_keeps_nothing():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 700, 64, generator=g)
    points = grouping_torch.project_leading(q, 16)
    want = grouping_torch._group(points.clone(), 64, owned=True)
    for _ in range(3):  # a CUDA tensor would be captured at the second call and replayed at the third
        got = grouping_graph.group_points(points.clone(), 64, grouping_torch.gather_rows)
        assert torch.equal(got, want)
    assert not grouping_graph._graphs and not grouping_graph._seen
    assert torch.equal(kernels.group_queries(q, 64, dims=16, backend="auto"),
                       grouping_torch.group_queries(q, 64, 16))


def test_the_partition_hook_receives_the_projected_points():
    seen = []

    def partition(points, group_size, gather):
        seen.append((points.shape, points.dtype, group_size, gather))
        return grouping_torch._group(points, group_size, gather, owned=True)

    q = torch.randn(2, 3, 300, 64, generator=torch.Generator().manual_seed(1))
    got = grouping_torch.group_queries(q, 64, 16, partition=partition)
    assert seen == [((1, 3, 300, 16), torch.float32, 64, grouping_torch.gather_rows)] * 2  # a sample at a time
    assert torch.equal(got, grouping_torch.group_queries(q, 64, 16))
    seen.clear()
    grouping_torch.group_queries(q, 64, 0, partition=partition)  # every coordinate: the queries' own partition
    assert seen == []


def test_the_engine_frees_the_graphs_at_each_runs_end_and_when_it_makes_room(monkeypatch):
    calls = []
    monkeypatch.setattr(kernels, "release_graphs", lambda: calls.append("release") or False)
    engine = SparseEngine(SparseConfig(method="mc_sparse"))
    engine.begin_run()
    assert calls == []  # a run's start keeps them: a bench's anchors, each after begin_run, replay
    engine.end_run(log_summary=False)
    assert calls == ["release"]
    calls.clear()
    attempts = []

    def fn():
        attempts.append(1)
        if len(attempts) == 1:
            raise torch.OutOfMemoryError("out of memory")
        return "done"

    monkeypatch.setattr(engine.cache, "spill", lambda share, stop_prefetch=False: 1 << 20)
    assert engine._with_room(fn, "a test call", torch.zeros(1)) == "done"
    assert calls == ["release"]
    # no cache to move, but the graphs gave memory back: tried again rather than raised
    attempts.clear()
    monkeypatch.setattr(kernels, "release_graphs", lambda: True)
    monkeypatch.setattr(engine.cache, "spill", lambda share, stop_prefetch=False: 0)
    assert engine._with_room(fn, "a test call", torch.zeros(1)) == "done" and len(attempts) == 2


def test_release_forgets_every_shape_and_says_whether_it_dropped_a_graph():
    grouping_graph._seen.add(("a shape seen once",))
    assert grouping_graph.release() is False  # nothing was captured: no memory came back
    assert not grouping_graph._graphs and grouping_graph._pool is None and not grouping_graph._seen


def test_graphs_are_on_under_either_allocator_unless_turned_off(monkeypatch):
    """Graphs are made under the native allocator and under cudaMallocAsync (ComfyUI's default), where they capture
    PyTorch's gathers (docs/kernel_notes.md, "v28"); SPARSE_ATTN_GROUPING_GRAPH=0 turns them off under either, and
    "force" (which earlier versions needed under cudaMallocAsync) still turns them on."""
    backend = {"name": "native"}
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: backend["name"])
    for name in ("native", "cudaMallocAsync"):
        for mode, on in ((None, True), ("1", True), ("0", False), ("force", True)):
            backend["name"] = name
            if mode is None:
                monkeypatch.delenv("SPARSE_ATTN_GROUPING_GRAPH", raising=False)
            else:
                monkeypatch.setenv("SPARSE_ATTN_GROUPING_GRAPH", mode)
            assert grouping_graph.enabled() is on, (name, mode)


def test_under_cuda_malloc_async_the_graph_captures_pytorchs_gather(monkeypatch):
    """Triton's launcher refuses a pointer a capture allocated under cudaMallocAsync (docs/kernel_notes.md, "v27"):
    there the graph gathers with index_select, which gives the same rows; under the native allocator it keeps the
    caller's gather."""
    from comfyui_sparse_attention.kernels import gather_torch
    backend = {"name": "native"}
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: backend["name"])

    def mine(rows, index):
        return rows[index]

    assert grouping_graph.graph_gather(mine) is mine
    backend["name"] = "cudaMallocAsync"
    assert grouping_graph.graph_gather(mine) is gather_torch.gather_rows
    rows, index = torch.randn(50, 16), torch.tensor([3, 0, 49, 3])
    assert torch.equal(gather_torch.gather_rows(rows, index), mine(rows, index))

    def no_cuda():
        raise RuntimeError("no CUDA")

    monkeypatch.setattr(torch.cuda, "get_allocator_backend", no_cuda)  # a build or machine without CUDA
    assert grouping_graph.graph_gather(mine) is mine


class _FakeGraph:
    """Stands in for torch.cuda.CUDAGraph: records, at reset, whether the graph's output tensor was already freed."""

    def __init__(self, output, log):
        self.output, self.log = weakref.ref(output), log

    def reset(self):
        self.log.append(("reset", self.output() is None))


def test_a_graphs_tensors_are_dropped_before_the_graph_itself():
    """A graph's tensors are freed before the graph is destroyed, on release, on eviction and when an entry is
    collected (docs/kernel_notes.md, "v26")."""
    log = []

    def entry():
        groups = torch.zeros(2, dtype=torch.int32)
        return grouping_graph._Graph(_FakeGraph(groups, log), torch.zeros(2), groups, [torch.zeros(1)])

    one = entry()
    one.free()
    one.free()  # twice: nothing more happens
    assert log == [("reset", True)] and one.graph is None and one.points is None and one.keep is None
    log.clear()
    grouping_graph._graphs["k1"], grouping_graph._graphs["k2"] = entry(), entry()
    assert grouping_graph.release() is True
    assert log == [("reset", True)] * 2 and not grouping_graph._graphs
    log.clear()
    collected = entry()
    del collected  # the collector's path: __del__ frees in the same order
    assert log == [("reset", True)]
