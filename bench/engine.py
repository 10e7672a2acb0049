"""Engine cost at a real shape on one CUDA GPU: one anchor call and one reuse call, in multiples of one
cuDNN dense attention, cache bytes per layer with and without compaction, and the engine's per-call host
overhead on reuse calls.

    python bench/engine.py --out DIR [--heads 40 --frames 21 --height 45 --width 80]   # Wan 14B 720p
    python bench/engine.py --out DIR --heads 24 --frames 1 --height 72 --width 64      # 4 608 tokens
    python bench/engine.py --out DIR --methods mc_sparse --profile                      # + operator profile

Host overhead: ``--overhead-reps`` reuse calls back to back (one synchronisation at the end), once through
``SparseEngine.attend`` (schedule, cache lookup, statistics, the kernel with the residual in its epilogue) and
once as the bare kernel call ``selection.run(q, k, v, residual=...)`` on the same cache entry; the overhead is
the share of the engine's wall time that the bare kernels do not account for. The host time of one engine call
(until it returns, the GPU still working) is reported beside it: while it stays below the kernel's time the
GPU never waits for Python. The GPU time of both calls alone (the host's launches queued behind a held-back GPU)
gives the stricter share: the engine's wall time that the kernel's own GPU time does not account for.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import yaml
from _pack import load

log = logging.getLogger("bench.engine")


def timed(fn, reps):
    """Median ms of ``reps`` calls, each bracketed by CUDA events (first call excluded as warm-up)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def back_to_back(fn, reps, rounds=5):
    """(median wall ms per call of ``reps`` calls launched back to back with one synchronisation at the end,
    median host ms per call: the time until ``fn`` returns), over ``rounds`` rounds after a warm-up round."""
    walls, hosts = [], []
    for r in range(rounds + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        host = 0.0
        for _ in range(reps):
            a = time.perf_counter()
            fn()
            host += time.perf_counter() - a
        torch.cuda.synchronize()
        if r:
            walls.append((time.perf_counter() - t0) * 1e3 / reps)
            hosts.append(host * 1e3 / reps)
    return sorted(walls)[len(walls) // 2], sorted(hosts)[len(hosts) // 2]


def gpu_only(fn, reps):
    """Median GPU ms per call of ``fn`` with no host gaps: the GPU is held back (``torch.cuda._sleep``) while the host
    enqueues ``reps`` calls, so the events around them time the device work alone (3 rounds after a warm-up)."""
    times = []
    for r in range(4):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(2e9))  # ~1 s at Hopper clocks: longer than the host needs to enqueue the calls
        a.record()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        b.record()
        host = time.perf_counter() - t0
        torch.cuda.synchronize()
        if host > 0.9:
            log.warning("gpu_only: the host took %.2f s to enqueue %d calls; the GPU may have waited", host, reps)
        if r:
            times.append(a.elapsed_time(b) / reps)
    return sorted(times)[len(times) // 2]


def profile_to(path: Path, fn) -> None:
    """One call of fn under torch.profiler (after a warm-up call); the operators by total CUDA time to path."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    avg = prof.key_averages()
    try:
        table = avg.table(sort_by="device_time_total", row_limit=45)
    except (KeyError, ValueError, AttributeError):
        table = avg.table(sort_by="cuda_time_total", row_limit=45)
    path.write_text(table)
    log.info("profile -> %s\n%s", path, table)


@torch.inference_mode()  # as ComfyUI executes its nodes: the engine's cached tensors are inference tensors
def host_profile_to(path: Path, fn, reps: int) -> None:
    """cProfile of ``reps`` calls of ``fn`` launched back to back (host time per function, by own time)."""
    import cProfile
    import io
    import pstats
    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
    path.write_text(f"{reps} calls\n" + buf.getvalue())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--frames", type=int, default=21)
    ap.add_argument("--height", type=int, default=45)
    ap.add_argument("--width", type=int, default=80)
    ap.add_argument("--batch", type=int, default=1, choices=(1, 2),
                    help="2: cond and uncond batched (two steps of the synthetic problem side by side)")
    ap.add_argument("--density", type=float, default=0.15)
    ap.add_argument("--overhead-reps", type=int, default=50, help="reuse calls per round of the overhead measure")
    ap.add_argument("--methods", default="mc_sparse,block_topk")
    ap.add_argument("--config", default="", help="more SparseConfig fields for every method, KEY=VALUE,... (values "
                    "read as YAML, none containing a comma: grouping=cuboid,mass_queries=0)")
    ap.add_argument("--launch-ab", type=int, default=0, metavar="PAIRS",
                    help="also time reuse and bare calls with kernels/fast_launch.py's direct relaunch on and off, "
                    "alternating PAIRS times in this process")
    ap.add_argument("--replay-ab", type=int, default=0, metavar="PAIRS",
                    help="also time reuse calls with kernels/replay.py on and off (the direct relaunch on), "
                    "alternating PAIRS times in this process (--launch-ab adds Triton's own launch)")
    ap.add_argument("--host-profile", action="store_true", help="also write where the host time of reuse calls goes "
                    "(cProfile of --overhead-reps engine calls and as many bare kernel calls) to DIR/host-*.txt")
    ap.add_argument("--profile", action="store_true", help="also write the CUDA time per operator of one query "
                    "grouping and one mc_sparse selection (torch.profiler) to DIR/profile-*.txt")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    eng = load("engine")
    syn = load("engine.synthetic")
    problem = syn.SyntheticVideoAttention(frames=args.frames, height=args.height, width=args.width, text=0,
                                          heads=args.heads, head_dim=128, steps=3, device="cuda",
                                          dtype=torch.bfloat16)
    q0, k0, v0 = problem.qkv(0)
    q1, k1, v1 = problem.qkv(1)
    if args.batch == 2:  # the second sample: the problem's last step (the first sample's data as with --batch 1)
        q0, k0, v0 = (torch.cat(p) for p in zip((q0, k0, v0), problem.qkv(2)))
        q1, k1, v1 = (torch.cat(p) for p in zip((q1, k1, v1), problem.qkv(2)))
    n = problem.n
    log.info("shape: %d x %d heads, %d tokens", args.batch, args.heads, n)
    res = dict(batch=args.batch, heads=args.heads, tokens=n, density=args.density, gpu=torch.cuda.get_device_name(),
               torch=torch.__version__, triton=triton.__version__,
               allocator=torch.cuda.memory.get_allocator_backend(),
               side_stream=load("kernels.side_stream").enabled())
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        cudnn = timed(lambda: F.scaled_dot_product_attention(q1, k1, v1), 5)
    res["cudnn_dense_ms"] = cudnn
    bad = [kv for kv in args.config.split(",") if kv and "=" not in kv]
    if bad:
        ap.error(f"--config takes KEY=VALUE,... (no list values), got {bad[0]!r}")
    extra = {kv.split("=", 1)[0].strip(): yaml.safe_load(kv.split("=", 1)[1]) for kv in args.config.split(",") if kv}
    res["config"] = extra
    for method in args.methods.split(","):
        cfg = eng.SparseConfig(method=method, density=args.density, residual=True, residual_precision="fp8",
                               min_tokens=0, cache_budget_mb=1e6, offload=False, **extra)
        engine = eng.SparseEngine(cfg)
        layout = problem.layout

        def anchor():
            engine.begin_run()
            return engine.attend(q0, k0, v0, eng.CallContext(layer=0, step=0, layout=layout))
        torch.cuda.synchronize()
        reserved_before = torch.cuda.memory_reserved()
        torch.cuda.reset_peak_memory_stats()
        anchor_ms = timed(anchor, 3)
        torch.cuda.synchronize()
        # what the anchors left reserved (the side stream's cached scratch among it, docs/decisions.md, "The side
        # stream's memory") and their peaks, in MB; the problem's tensors and the cache entry are inside both
        memory = dict(reserved_before_mb=reserved_before / 2**20,
                      reserved_after_mb=torch.cuda.memory_reserved() / 2**20,
                      peak_reserved_mb=torch.cuda.max_memory_reserved() / 2**20,
                      peak_allocated_mb=torch.cuda.max_memory_allocated() / 2**20,
                      allocated_after_mb=torch.cuda.memory_allocated() / 2**20)
        key = eng.CallContext(layer=0, step=0, layout=layout).key(n)
        entry = engine.cache.on_device[key]
        selection = entry.selection

        def reuse():
            return engine.attend(q1, k1, v1, eng.CallContext(layer=0, step=1, layout=layout))
        reuse_ms = timed(reuse, 5)
        kernel_ms = timed(lambda: selection.run(q1, k1, v1), 5)
        engine_wall, engine_host = back_to_back(reuse, args.overhead_reps)
        bare_wall, bare_host = back_to_back(lambda: selection.run(q1, k1, v1, residual=entry.residual),
                                            args.overhead_reps)
        overhead = dict(engine_call_wall_ms=engine_wall, engine_call_host_ms=engine_host,
                        kernel_call_wall_ms=bare_wall, kernel_call_host_ms=bare_host,
                        host_overhead_pct=100 * max(0.0, engine_wall - bare_wall) / engine_wall,
                        engine_call_gpu_ms=gpu_only(reuse, args.overhead_reps),
                        kernel_call_gpu_ms=gpu_only(lambda: selection.run(q1, k1, v1, residual=entry.residual),
                                                    args.overhead_reps))
        overhead["host_overhead_vs_gpu_pct"] = 100 * max(0.0, engine_wall - overhead["kernel_call_gpu_ms"]) / \
            engine_wall
        fl = load("kernels.fast_launch")
        rp = load("kernels.replay")
        replay_was = rp.ENABLED

        def launch_mode(mode):
            os.environ["SPARSE_ATTN_FAST_LAUNCH"] = "0" if mode == "triton" else "1"
            rp.ENABLED = mode == "replay"
        modes = (["replay"] * bool(args.replay_ab) + ["direct"] * bool(args.replay_ab or args.launch_ab)
                 + ["triton"] * bool(args.launch_ab))
        for mode in modes:  # each pair's calls after one warm-up round, so a replay has its plan (kernels/replay.py)
            launch_mode(mode)
            back_to_back(reuse, 8)
        pairs = max(args.launch_ab, args.replay_ab)
        ab = {mode: [] for mode in modes}
        for _ in range(pairs if modes else 0):  # replay, the direct relaunch alone, Triton's launch: alternating
            for mode in modes:
                launch_mode(mode)
                ab[mode].append(back_to_back(reuse, args.overhead_reps)
                                + back_to_back(lambda: selection.run(q1, k1, v1, residual=entry.residual),
                                               args.overhead_reps))
        os.environ.pop("SPARSE_ATTN_FAST_LAUNCH", None)
        rp.ENABLED = replay_was
        names = ("engine_call_wall_ms", "engine_call_host_ms", "kernel_call_wall_ms", "kernel_call_host_ms")
        for mode, rows in ab.items():  # median and least over the pairs, and every pair's values
            cols = list(zip(*rows))
            overhead[f"launch_{mode}"] = dict(zip(names, (sorted(c)[len(c) // 2] for c in cols)))
            overhead[f"launch_{mode}_least"] = dict(zip(names, (min(c) for c in cols)))
            overhead[f"launch_{mode}_pairs"] = [dict(zip(names, r)) for r in rows]
        if modes:
            overhead["launch_counts"] = fl.counts()
        if args.host_profile:
            out_dir = Path(args.out)
            out_dir.mkdir(parents=True, exist_ok=True)
            host_profile_to(out_dir / f"host-{method}-engine.txt", reuse, args.overhead_reps)
            # a run start and an anchor call, 10 times (the entry and selection read below stay alive in this scope)
            host_profile_to(out_dir / f"host-{method}-anchor.txt", anchor, 10)
            host_profile_to(out_dir / f"host-{method}-bare.txt",
                            lambda: selection.run(q1, k1, v1, residual=entry.residual), args.overhead_reps)
        phases = {}
        if method == "mc_sparse":  # where the anchor's time goes
            kern = load("kernels")
            mc = load("engine.policy_mc_sparse")
            phases["dense_lse_ms"] = timed(lambda: kern.attention_dense(q0, k0, v0, return_lse=True), 3)
            lse = kern.attention_dense(q0, k0, v0, return_lse=True)[1]
            grouped = functools.partial(kern.group_queries, q0, cfg.group_size, dims=cfg.grouping_dims)
            phases["grouping_ms"] = timed(grouped, 3)
            phases["selection_total_ms"] = timed(lambda: mc.build_mc_sparse(q0, k0, lse, layout, cfg), 3)
            groups = mc.ranking_queries(grouped(), cfg)  # what pass 2 reads
            phases["mass_ms"] = timed(lambda: [kern.group_kv_mass(q0[:, i:i + 5], k0[:, i:i + 5], lse[:, i:i + 5],
                                                                  groups[:, i:i + 5], validate=False)
                                               for i in range(0, args.heads, 5)], 3)
            if args.profile:
                out_dir = Path(args.out)
                out_dir.mkdir(parents=True, exist_ok=True)
                profile_to(out_dir / "profile-grouping.txt", grouped)
                profile_to(out_dir / "profile-selection.txt", lambda: mc.build_mc_sparse(q0, k0, lse, layout, cfg))
            del lse, groups
            toks = selection.kv_tokens()
            decode_ms = timed(lambda: selection.kv_tokens(), 5)
            # the reuse kernel call with the fill of rows in no group (a decode pass of the residual), as before the
            # selections said they cover every row (engine/selection.py, covers_all)
            filled = dataclasses.replace(selection, covers_all=False)
            phases["kernel_call_filled_ms"] = timed(lambda: filled.run(q1, k1, v1, residual=entry.residual), 5)
            phases["kernel_call_unfilled_ms"] = timed(lambda: selection.run(q1, k1, v1, residual=entry.residual), 5)
            # the same compact lists without the residual: what the in-kernel decode costs apart from the fp8
            # residual's epilogue (docs/kernel_notes.md "v24")
            phases["kernel_compact_no_residual_ms"] = timed(lambda: selection.run(q1, k1, v1), 5)
            # the kernel on decoded int32 lists (the reuse path before the kernel decoded the int16 lists itself)
            phases["kernel_int32_lists_ms"] = timed(lambda: kern.token_sparse_attention(
                q1, k1, v1, selection.q_groups, toks, selection.kv_counts, validate=False), 5)
            plain = (selection.q_groups.numel() * 4 + toks.numel() * 4 + selection.kv_counts.numel() * 4)
            compact = selection.nbytes
            out_s = selection.run(q1, k1, v1)
            res_bytes = entry.residual.nbytes
            del toks, out_s
        else:
            decode_ms = 0.0
            plain = compact = selection.nbytes
            res_bytes = entry.residual.nbytes
        stats = engine.end_run()
        row = dict(anchor_ms=anchor_ms, reuse_ms=reuse_ms, sparse_kernel_ms=kernel_ms,
                   anchor_x_cudnn=anchor_ms / cudnn, reuse_x_kernel=reuse_ms / kernel_ms,
                   reuse_x_cudnn=reuse_ms / cudnn, density=float(selection.density), index_bytes_plain=plain,
                   index_bytes_compact=compact, residual_bytes=res_bytes, decode_ms=decode_ms,
                   fidelity=stats.totals()["fidelity_mean"], anchor_memory=memory, **overhead, **phases)
        res[method] = row
        log.info("%s: %s", method, json.dumps(row))
        torch.cuda.empty_cache()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "engine.json").write_text(json.dumps(res, indent=1))
    log.info("done")


if __name__ == "__main__":
    main()
