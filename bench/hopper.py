"""Hopper kernels in one device call: GPU tests, then every variant timed, a table and JSON at the end.

Usage (H200, from the repository root; docs/kernel_notes.md has the plan and the predictions):
    PYTHONUNBUFFERED=1 python3 bench/hopper.py --out $OUT [--budget 300] [--skip-tests] [--shapes wan14b,...]
Writes $OUT/gpu-tests.log, $OUT/hopper.json (every measurement, the autotuner's picks, the compiler's
resource report of every compiled kernel) and $OUT/hopper.md (the table printed last).

Work is ordered so that a time cut loses the least: tests, then Wan 14B (block-sparse TMA / pointer /
persistent at d = 0.25, 0.1, 0.5; dense + LSE; anchor; fused residual; token-sparse; pass 2; skewed lists),
then Wan 1.3B and HunyuanVideo, then live FlexAttention (reference times from docs/benchmarks.md stand in
for any not measured), then the warp-specialised variant. Each step checks the budget first.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

if "--dry" in sys.argv:  # the interpreter is chosen when Triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from _pack import ROOT, load  # noqa: E402

import kernels as kb  # noqa: E402  (bench/kernels.py: SHAPES, block_lists, kept_fraction, flex_runner)

T0 = time.time()
DEV = "cuda"  # "cpu" with --dry (the script's logic under the Triton interpreter, tiny shapes, no GPU)
DRY_SHAPES = {"wan14b": (2, 300, 64), "wan13b": (2, 200, 64), "hyv": (1, 260, 64)}
# FlexAttention on the same generator's masks, H200, 2026-11-29 (docs/benchmarks.md): (shape, skewed, d) -> ms
FLEX_REF = {("wan13b", False, 0.5): 8.047, ("wan13b", False, 0.25): 4.125, ("wan13b", False, 0.1): 1.727,
            ("wan13b", True, 0.25): 4.597, ("wan13b", True, 0.1): 2.123,
            ("wan14b", False, 0.5): 139.460, ("wan14b", False, 0.25): 69.606, ("wan14b", False, 0.1): 29.514,
            ("wan14b", True, 0.25): 73.043, ("wan14b", True, 0.1): 29.341,
            ("hyv", False, 0.5): 206.731, ("hyv", False, 0.25): 103.486, ("hyv", False, 0.1): 43.051,
            ("hyv", True, 0.25): 111.068, ("hyv", True, 0.1): 42.193}


def say(msg):
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


class Budget:
    def __init__(self, seconds):
        self.deadline = time.time() + seconds
        self.skipped = []

    def ok(self, what, need=0.0):
        if time.time() + need < self.deadline:
            return True
        self.skipped.append(what)
        say(f"budget: skipped {what}")
        return False


def timeit(fn):
    """Median ms of a few event-timed calls after a warm-up call (which also autotunes and compiles)."""
    fn()
    if DEV == "cpu":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize()
    times = []
    while len(times) < 30 and (len(times) < 3 or sum(times) < 150.0):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def run_tests(out_dir, timeout, select=""):
    say(f"GPU tests: pytest -m gpu tests/test_gpu_kernels.py {'-k ' + repr(select) if select else ''} "
        "(SPARSE_ATTN_TUNE=first)")
    env = dict(os.environ, SPARSE_ATTN_TUNE="first", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-m", "gpu", "tests/test_gpu_kernels.py", "-p",
           "no:cacheprovider"] + (["-k", select] if select else [])
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        log, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        log, rc = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or ""), "timeout"
    (out_dir / "gpu-tests.log").write_text(log)
    tail = [ln for ln in log.splitlines() if ln.strip()][-12:]
    for ln in tail:
        print("    " + ln)
    say(f"GPU tests done (rc {rc})")
    return dict(rc=rc, tail=tail)


class Shape:
    """Inputs and measurements of one (heads, tokens, head_dim) shape."""

    def __init__(self, name, rows, budget, mods, flex):
        self.name, self.rows, self.budget, self.m, self.flex = name, rows, budget, mods, flex
        self.h, self.n, self.d = (DRY_SHAPES if DEV == "cpu" else kb.SHAPES)[name]
        self.gen = torch.Generator(device=DEV).manual_seed(0)
        dtype = torch.float16 if DEV == "cpu" else torch.bfloat16  # the interpreter's bf16 dot is wrong
        self.q, self.k, self.v = (torch.randn(1, self.h, self.n, self.d, device=DEV, dtype=dtype,
                                              generator=self.gen) for _ in range(3))
        self.flops = 4.0 * self.h * self.n * self.n * self.d
        self.cudnn = None
        self.lists = {}

    def rec(self, kind, variant, fn, density=1.0, config=None, **extra):
        """Time fn and record a row; failures are recorded, not fatal."""
        if not self.budget.ok(f"{self.name} {kind} {variant} {extra.get('target', '')}"):
            return None
        try:
            ms = timeit(fn)
        except Exception as exc:  # a variant that fails to compile or run is reported
            say(f"{self.name:7s} {kind:18s} {variant:12s} FAILED {type(exc).__name__}: {str(exc)[:300]}")
            self.rows.append(dict(shape=self.name, kind=kind, variant=variant, error=f"{type(exc).__name__}: "
                                  f"{str(exc)[:2000]}", trace=traceback.format_exc()[-3000:], **extra))
            return None
        try:
            cfg = config() if callable(config) else config
        except AttributeError:  # an autotuner that has not run in this process (another kernel took the call)
            cfg = None
        r = dict(shape=self.name, heads=self.h, tokens=self.n, head_dim=self.d, kind=kind, variant=variant, ms=ms,
                 density=density, eff_tflops=self.flops * density / ms / 1e9, config=str(cfg) if cfg else "",
                 **extra)
        if self.cudnn:
            r["x_cudnn"] = self.cudnn / ms
            r["x_d"] = self.cudnn / ms * density
            if kind in ("anchor", "pass2_mass", "dense_lse"):
                r["note"] = f"{ms / self.cudnn:.2f}x cuDNN dense time"
        self.rows.append(r)
        say(f"{self.name:7s} {kind:18s} {variant:12s} d={density:.3f} {ms:9.3f} ms {r['eff_tflops']:6.1f} TF/s "
            f"{r.get('x_d', 0):.2f}xd  {r['config'][:70]}")
        return r

    def block_lists(self, dens, skewed):
        key = (dens, skewed)
        if key not in self.lists:
            nb = math.ceil(self.n / 128)
            idx, cnt = kb.block_lists(self.h, nb, nb, dens, skewed, self.gen)
            self.lists[key] = (idx, cnt, kb.kept_fraction(cnt, self.n, 128, 128))
        return self.lists[key]

    # ---- the measurements ----

    def dense(self):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        q, k, v = self.q, self.k, self.v
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION] if DEV == "cuda" else [SDPBackend.MATH]):
            r = self.rec("dense", "cudnn", lambda: F.scaled_dot_product_attention(q, k, v))
        self.cudnn = r["ms"] if r else None
        if r:
            r["x_cudnn"], r["x_d"] = 1.0, 1.0
        self.rec("dense_lse", "cudnn", self.cudnn_lse)  # cuDNN itself: kernels/api.py's auto takes Gluon first

    def dense_ours(self):
        q, k, v, DT, AH = self.q, self.k, self.v, self.m["DT"], self.m["AH"]
        self.rec("dense_lse", "tma", lambda: DT.attention_dense(q, k, v, return_lse=True, path="tma"),
                 config=lambda: AH.last_config("dense"))
        self.rec("dense_lse", "pointer", lambda: DT.attention_dense(q, k, v, return_lse=True, path="pointer"),
                 config=lambda: DT._dense_fwd.best_config)

    def sparse(self, densities, skewed=False, variants=("tma", "pointer", "persistent")):
        q, k, v, BT, AH = self.q, self.k, self.v, self.m["BT"], self.m["AH"]
        tag = "bsa128_skew" if skewed else "bsa128"
        for dens in densities:
            idx, cnt, real = self.block_lists(dens, skewed)
            for var in variants:
                def fn(var=var, idx=idx, cnt=cnt):
                    return BT.block_sparse_attention(q, k, v, idx, cnt, block_q=128, block_k=128, validate=False,
                                                     path=var)
                cfg = (lambda: BT._bsa_fwd.best_config) if var == "pointer" else (
                    lambda var=var: AH.last_config("sparse" if var == "tma" else var))
                r = self.rec(tag, var, fn, real, config=cfg, target=dens)
                ref = FLEX_REF.get((self.name, skewed, dens))
                if r and ref:
                    r["vs_flex_ref"] = ref / r["ms"]

    def flex_call(self, tag, dens, skewed):
        """(FlexAttention's call on the lists of ``dens``, idx, cnt, kept share), or None when the budget has no room
        for its compilation or Flex fails (said)."""
        idx, cnt, real = self.block_lists(dens, skewed)
        if not self.budget.ok(f"{self.name} {tag} {dens}", need=40.0):  # a first call compiles (~30 s)
            return None
        try:
            return self.flex(self.q, self.k, self.v, idx, cnt, 128), idx, cnt, real
        except Exception as exc:
            say(f"flex failed: {str(exc)[:300]}")
            return None

    def flex_rows(self, densities, skewed=False):
        if self.flex is None:
            return
        tag = "flex128_skew" if skewed else "flex128"
        for dens in densities:
            got = self.flex_call(tag, dens, skewed)
            if got is None:
                return
            run, _, _, real = got
            r = self.rec(tag, "flex", run, real, target=dens)
            if r:
                for o in self.rows:
                    if (o.get("shape") == self.name and o.get("kind") == ("bsa128_skew" if skewed else "bsa128")
                            and o.get("target") == dens and "ms" in o):
                        o["vs_flex"] = r["ms"] / o["ms"]

    def anchor(self, densities):
        q, k, v, K, AT, AH, BT = self.q, self.k, self.v, self.m["K"], self.m["AT"], self.m["AH"], self.m["BT"]
        enc = self.m["encode"]
        for dens in densities:
            idx, cnt, real = self.block_lists(dens, False)
            for prec in ("fp8", "model"):
                self.rec("anchor", f"fused_{prec}",
                         lambda idx=idx, cnt=cnt, prec=prec: AT.block_anchor_attention(
                             q, k, v, idx, cnt, block_q=128, block_k=128, residual_precision=prec, validate=False),
                         config=lambda: AH.last_config("anchor"), target=dens)

            def composed(idx=idx, cnt=cnt):  # today's anchor: cuDNN dense + LSE, sparse kernel, residual pass
                out, _ = K.attention_dense(q, k, v, return_lse=True)
                sp = BT.block_sparse_attention(q, k, v, idx, cnt, block_q=128, block_k=128, validate=False)
                return out, enc(out.float() - sp.float(), "fp8", out.dtype)
            self.rec("anchor", "cudnn+bsa+res", composed, target=dens)
        self.rec("anchor", "fused_persist", lambda: AT.block_anchor_attention(
            q, k, v, *self.block_lists(densities[0], False)[:2], block_q=128, block_k=128, residual_precision="fp8",
            validate=False, path="persistent"), config=lambda: AH.last_config("persistent"), target=densities[0])

    def anchor_ab(self, densities, repeats=3):
        """The block anchor as the engine calls it (fp8 residual with its mass), alternated ``repeats`` times per
        density: the Gluon one-pass anchor (kernels/anchor_gluon.py), the Gluon dense call plus the TMA kernel
        forming R in its epilogue (kernels/api.py's path before it), and above FUSED_ANCHOR_ABOVE the TMA fused pass;
        a summary row per density with the medians (× cuDNN's dense call) and how far the Gluon anchor's dense output,
        R and mass lie from the composed path's (``rel_out`` / ``rel_r``: relative L2; ``rel_mass``: largest
        difference). Under --dry (no Gluon in the interpreter) the composed path's dense call is the TMA kernel's and
        the Gluon rows are left out."""
        q, k, v, AT, DT, api = self.q, self.k, self.v, self.m["AT"], self.m["DT"], self.m["API"]
        kw = dict(block_q=128, block_k=128, residual_precision="fp8", validate=False, return_mass=True)
        ours = "gluon" if DEV == "cuda" else "tma"
        for dens in densities:
            idx, cnt, real = self.block_lists(dens, False)

            def gluon(idx=idx, cnt=cnt):
                return AT.block_anchor_attention(q, k, v, idx, cnt, path="gluon", **kw)

            def composed(idx=idx, cnt=cnt):
                o, ls = DT.attention_dense(q, k, v, return_lse=True, path=ours)
                return o, AT.block_residual(q, k, v, idx, cnt, o, ls, **kw)

            def fused(idx=idx, cnt=cnt):
                return AT.block_anchor_attention(q, k, v, idx, cnt, path="tma", **kw)
            variants = [("gluon", gluon)] * (DEV == "cuda") + [(f"{ours}+epilogue", composed)]
            variants += [("tma_fused", fused)] if dens > api.FUSED_ANCHOR_ABOVE else []
            times = {name: [] for name, _ in variants}
            for i in range(1, repeats + 1):
                for name, fn in variants:
                    r = self.rec("anchor_ab", f"{name}#{i}", fn, target=dens, kept=real)
                    if r:
                        times[name].append(r["ms"])
            err = {}
            if DEV == "cuda":
                try:
                    (go, gr), (co, cr) = gluon(), composed()
                    dec = [r[0].float() * r[1] for r in (gr, cr)]
                    err = dict(rel_out=float((go.float() - co.float()).norm() / co.float().norm()),
                               rel_r=float((dec[0] - dec[1]).norm() / dec[1].norm().clamp(min=1e-30)),
                               rel_mass=float((gr[2] - cr[2]).nan_to_num(0, 0, 0).abs().max()))
                    del go, gr, co, cr, dec
                except Exception as exc:
                    err = dict(error=f"{type(exc).__name__}: {str(exc)[:300]}")
            summary = {name: statistics.median(t) for name, t in times.items() if t}
            self.rows.append(dict(shape=self.name, kind="anchor_ab_median", variant="-", target=dens, kept=real,
                                  medians=summary, cudnn=self.cudnn, **err))
            say(f"{self.name} anchor d={dens}: medians " + ", ".join(
                f"{n} {t:.2f} ms" + (f" ({t / self.cudnn:.3f}x cuDNN)" if self.cudnn else "")
                for n, t in summary.items()) + f"; {err}")
            torch.cuda.empty_cache()

    def anchor_paths(self, densities, tilings=False):
        """The block anchor as the engine calls it (fp8 residual with its mass) per density: the fused one-pass kernel
        (with ``tilings``, each candidate tiling of ``attention_hopper.ANCHOR_CONFIGS`` alone: docs/kernel_notes.md,
        "v16"), one cuDNN dense call plus the block-sparse kernel forming R in its epilogue, and what kernels/api.py
        chooses (FUSED_ANCHOR_ABOVE)."""
        q, k, v, K, AT, AH = self.q, self.k, self.v, self.m["K"], self.m["AT"], self.m["AH"]
        kw = dict(block_q=128, block_k=128, residual_precision="fp8", validate=False, return_mass=True)
        candidates = list(AH.ANCHOR_CONFIGS)
        for dens in densities:
            idx, cnt, real = self.block_lists(dens, False)

            def fused(idx=idx, cnt=cnt):
                return AT.block_anchor_attention(q, k, v, idx, cnt, **kw)
            if not tilings:
                self.rec("anchor", "fused_fp8", fused, config=lambda: AH.last_config("anchor"), target=dens, kept=real)
            else:
                try:
                    for i, cfg in enumerate(candidates):
                        AH.ANCHOR_CONFIGS[:] = [cfg]
                        AH._tuned.pop("anchor", None)
                        self.rec("anchor", f"fused_t{i}", fused, config=str(cfg), target=dens, kept=real)
                finally:
                    AH.ANCHOR_CONFIGS[:] = candidates
                    AH._tuned.pop("anchor", None)

            def epilogue(idx=idx, cnt=cnt):
                out, lse = self.cudnn_lse()
                return out, AT.block_residual(q, k, v, idx, cnt, out, lse, **kw)
            self.rec("anchor", "cudnn+epilogue", epilogue, config=lambda: AH.last_config("sparse"), target=dens,
                     kept=real)
            self.rec("anchor", "api", lambda idx=idx, cnt=cnt: K.block_anchor_attention(q, k, v, idx, cnt, **kw),
                     target=dens, kept=real)

    def cudnn_lse(self):
        """cuDNN's dense output and LSE (the dense half of the composed anchor before the Gluon kernel)."""
        if DEV == "cpu":
            return self.m["K"].attention_dense(self.q, self.k, self.v, return_lse=True)
        return self.m["DC"].attention_dense(self.q, self.k, self.v, scale=self.d ** -0.5, return_lse=True)

    def persistent_ab(self, densities, repeats=2):
        """The Gluon block kernel on its own grid and on the persistent one (kernels/attention_gluon.py) at each of
        ``densities``, uniform and skewed lists, the two alternated ``repeats`` times (variants "gluon",
        "gluon_persistent", then "#2", "#3", ...), so the run's own spread shows beside their difference (which grid
        the automatic choice should take at which density and shape; kernel_notes "v19")."""
        q, k, v, BT = self.q, self.k, self.v, self.m["BT"]
        for skewed in (False, True):
            tag = "bsa128_skew" if skewed else "bsa128"
            for dens in densities:
                idx, cnt, real = self.block_lists(dens, skewed)
                for again in [""] + [f"#{i}" for i in range(2, repeats + 1)]:
                    for path in ("gluon", "gluon_persistent"):
                        self.rec(tag, path + again, lambda idx=idx, cnt=cnt, path=path: BT.block_sparse_attention(
                            q, k, v, idx, cnt, block_q=128, block_k=128, validate=False, path=path), real,
                            target=dens)

    def flex_ab(self, densities, repeats=4):
        """The block kernel kernels/api.py picks (path "auto") against FlexAttention live on the same lists, uniform
        and skewed, at each of ``densities``, the two alternated ``repeats`` times (variants "auto#i", "flex#i"), so a
        ratio is a median over the run's own spread rather than one draw (docs/benchmarks.md: one skewed d 0.25 cell
        measured 1.19x and 1.38x in two runs)."""
        if self.flex is None:
            return
        q, k, v, BT = self.q, self.k, self.v, self.m["BT"]
        for skewed in (False, True):
            tag = "ab_skew" if skewed else "ab"
            for dens in densities:
                got = self.flex_call(tag, dens, skewed)
                if got is None:
                    return
                run, idx, cnt, real = got
                ratios = []
                for i in range(1, repeats + 1):
                    ours = self.rec(tag, f"auto#{i}", lambda idx=idx, cnt=cnt: BT.block_sparse_attention(
                        q, k, v, idx, cnt, block_q=128, block_k=128, validate=False), real, target=dens)
                    theirs = self.rec(tag, f"flex#{i}", run, real, target=dens)
                    if ours and theirs:
                        ours["vs_flex"] = theirs["ms"] / ours["ms"]
                        ratios.append(ours["vs_flex"])
                if ratios:
                    say(f"{self.name} {tag} d={dens}: vs Flex median {statistics.median(ratios):.2f} "
                        f"(lowest {min(ratios):.2f}, highest {max(ratios):.2f}, {len(ratios)} pairs)")

    def gluon(self, densities, anchor_densities=(0.08, 0.1), flex=False, fused_densities=()):
        """The Gluon kernel (kernels/attention_gluon.py) against the TMA kernel and cuDNN: dense + LSE; block-sparse on
        uniform and skewed lists (also on the Gluon kernel's persistent grid, "gluon_persistent"); the engine's
        reuse call (fp8 residual weighted by the mass); the block anchor as kernels/api.py runs it now (the
        Gluon dense call + the residual epilogue) against cuDNN + the epilogue; at ``fused_densities`` the
        fused one-pass anchor against the Gluon dense call + the epilogue; with ``flex``, FlexAttention live on
        the same lists."""
        q, k, v, K, AT, AH, BT, DT = (self.q, self.k, self.v, self.m["K"], self.m["AT"], self.m["AH"], self.m["BT"],
                                      self.m["DT"])
        paths = ("gluon", "tma") if DEV == "cuda" else ("tma",)  # the interpreter has no Gluon
        ours = paths[0]
        for path in paths:
            self.rec("dense_lse", path, lambda path=path: DT.attention_dense(q, k, v, return_lse=True, path=path))
        for skewed, dens_list in ((False, densities), (True, densities[:2])):
            tag = "bsa128_skew" if skewed else "bsa128"
            for dens in dens_list:
                idx, cnt, real = self.block_lists(dens, skewed)
                for path in paths[:1] + ("gluon_persistent",) * (DEV == "cuda") + paths[1:]:
                    r = self.rec(tag, path, lambda idx=idx, cnt=cnt, path=path: BT.block_sparse_attention(
                        q, k, v, idx, cnt, block_q=128, block_k=128, validate=False, path=path), real,
                        config=(lambda: AH.last_config("sparse")) if path == "tma" else None, target=dens)
                    ref = FLEX_REF.get((self.name, skewed, dens))
                    if r and ref:
                        r["vs_flex_ref"] = ref / r["ms"]
        kw = dict(block_q=128, block_k=128, residual_precision="fp8", validate=False, return_mass=True)
        out, lse = self.cudnn_lse()
        for dens in anchor_densities:
            idx, cnt, real = self.block_lists(dens, False)
            triple = AT.block_residual(q, k, v, idx, cnt, out, lse, **kw)
            for path in paths:
                self.rec("reuse", f"{path}_fp8_mass", lambda idx=idx, cnt=cnt, triple=triple, path=path:
                         BT.block_sparse_attention(q, k, v, idx, cnt, block_q=128, block_k=128, validate=False,
                                                   residual=triple, path=path), real, target=dens)
            del triple
            self.rec("anchor", "api", lambda idx=idx, cnt=cnt: K.block_anchor_attention(q, k, v, idx, cnt, **kw),
                     target=dens, kept=real)

            def cudnn_epilogue(idx=idx, cnt=cnt):
                o, ls = self.cudnn_lse()
                return o, AT.block_residual(q, k, v, idx, cnt, o, ls, **kw)
            self.rec("anchor", "cudnn+epilogue", cudnn_epilogue, target=dens, kept=real)
        del out, lse
        for dens in fused_densities:  # where kernels/api.py takes the fused one-pass anchor (FUSED_ANCHOR_ABOVE)
            idx, cnt, real = self.block_lists(dens, False)
            self.rec("anchor", "fused_fp8", lambda idx=idx, cnt=cnt: AT.block_anchor_attention(q, k, v, idx, cnt, **kw),
                     config=lambda: AH.last_config("anchor"), target=dens, kept=real)

            def our_epilogue(idx=idx, cnt=cnt):
                o, ls = DT.attention_dense(q, k, v, return_lse=True, path=ours)
                return o, AT.block_residual(q, k, v, idx, cnt, o, ls, **kw)
            self.rec("anchor", f"{ours}+epilogue", our_epilogue, target=dens, kept=real)
        if flex:
            self.flex_rows(densities[:2])
            self.flex_rows(densities[:2], True)

    def residual(self, densities):
        q, k, v, BT, AH = self.q, self.k, self.v, self.m["BT"], self.m["AH"]
        Residual = self.m["Residual"]
        diff = torch.randn(q.shape, device=DEV, dtype=q.dtype, generator=self.gen) * 0.05
        for prec in ("fp8", "model"):
            res = Residual.encode(diff, prec)
            pair = (res.data, res.scale)
            for dens in densities:
                idx, cnt, real = self.block_lists(dens, False)
                self.rec("reuse", f"fused_{prec}", lambda idx=idx, cnt=cnt, pair=pair: BT.block_sparse_attention(
                    q, k, v, idx, cnt, block_q=128, block_k=128, validate=False, residual=pair), real,
                    config=lambda: AH.last_config("sparse"), target=dens)
                self.rec("reuse", f"separate_{prec}", lambda idx=idx, cnt=cnt, res=res: res.add_to(
                    BT.block_sparse_attention(q, k, v, idx, cnt, block_q=128, block_k=128, validate=False)), real,
                    target=dens)

    def mass(self, densities):
        """The residual weighted by the mass (kernels/_residual.py) against the residual as cached: the fused anchor
        writing the mass or not, and the block-sparse reuse call (fp8 residual in the epilogue) reading it or not,
        interleaved fixed / mass / fixed again per kernel."""
        q, k, v, BT, AH, AT = self.q, self.k, self.v, self.m["BT"], self.m["AH"], self.m["AT"]
        for dens in densities:
            idx, cnt, real = self.block_lists(dens, False)
            _, triple = AT.block_anchor_attention(q, k, v, idx, cnt, block_q=128, block_k=128,
                                                  residual_precision="fp8", validate=False, return_mass=True)
            for label, mass in (("fixed", False), ("mass", True), ("fixed-again", False)):
                self.rec("anchor", f"fused_fp8-{label}", lambda idx=idx, cnt=cnt, mass=mass: AT.block_anchor_attention(
                    q, k, v, idx, cnt, block_q=128, block_k=128, residual_precision="fp8", validate=False,
                    return_mass=mass), config=lambda: AH.last_config("anchor"), target=dens)
            for label, res in (("fixed", triple[:2]), ("mass", triple), ("fixed-again", triple[:2])):
                self.rec("reuse", f"fused_fp8-{label}", lambda idx=idx, cnt=cnt, res=res: BT.block_sparse_attention(
                    q, k, v, idx, cnt, block_q=128, block_k=128, validate=False, residual=res), real,
                    config=lambda: AH.last_config("sparse"), target=dens)
            del triple

    def token(self, dens=0.15, variant="pointer", reuse=True):
        """The pointer token kernel (named: ``auto`` takes the Gluon kernel on Hopper at these shapes since the
        twenty-fifth session, and "gluon_token" compares the two) on random groups of 128 and their lists."""
        q, k, v, TT, Residual = self.q, self.k, self.v, self.m["TT"], self.m["Residual"]
        n = self.n
        fresh = getattr(self, "token_lists", None) is None
        grp, toks, tcnt, kk = self.make_token_lists(dens)
        self.rec("token128", variant, lambda: TT.token_sparse_attention(q, k, v, grp, toks, tcnt, validate=False,
                                                                        path="pointer"),
                 kk / n, config=lambda: TT._token_fwd.best_config, target=dens)
        if not fresh or not reuse:  # the same lists for every variant of this shape
            return
        res = Residual.encode(torch.randn(q.shape, device=DEV, dtype=q.dtype, generator=self.gen) * 0.05, "fp8")
        self.rec("token128_reuse", "fused_fp8", lambda: TT.token_sparse_attention(
            q, k, v, grp, toks, tcnt, validate=False, residual=(res.data, res.scale), path="pointer"), kk / n,
            target=dens, config=lambda: TT._token_fwd.best_config)
        self.rec("token128_reuse", "separate_fp8", lambda: res.add_to(TT.token_sparse_attention(
            q, k, v, grp, toks, tcnt, validate=False, path="pointer")), kk / n, target=dens)

    def gluon_token(self, dens=0.15):
        """kernels/token_sparse_gluon.py against the pointer kernel on the same lists: int32 lists without a
        residual (the Gluon kernel also on other tilings and with eight loader warps), and the engine's reuse call
        (compact lists, fp8 residual). Each Gluon row carries its output's relative L2 distance to the pointer
        kernel's (``rel_vs_pointer``)."""
        q, k, v, TT = self.q, self.k, self.v, self.m["TT"]
        TG = load("kernels.token_sparse_gluon")
        grp, toks, tcnt, kk = self.make_token_lists(dens)
        low, ends, res = self.compact_token_lists()
        calls = dict(token128=lambda path: TT.token_sparse_attention(q, k, v, grp, toks, tcnt, validate=False,
                                                                     path=path),
                     token128_reuse=lambda path: TT.token_sparse_attention_compact(
                         q, k, v, grp, low, ends, tcnt, validate=False, residual=(res.data, res.scale), path=path))
        refs = {}

        def rec(kind, variant, path):
            r = self.rec(kind, variant, lambda: calls[kind](path), kk / self.n, target=dens,
                         config=(lambda: TT._token_fwd.best_config) if path == "pointer" else None)
            if r is not None and path == "pointer":
                refs[kind] = calls[kind]("pointer").float()
            elif r is not None and kind in refs:
                out = calls[kind](path).float()
                r["rel_vs_pointer"] = float((out - refs[kind]).norm() / refs[kind].norm())
                say(f"{self.name:7s} {kind:18s} {variant:12s} rel to pointer {r['rel_vs_pointer']:.2e}")
        if DEV != "cuda":
            rec("token128", "pointer", "pointer")
            rec("token128_reuse", "pointer_compact_fp8", "pointer")
            return
        tiles, loader, flags = TG.TILES, TG.LOADER, TG.OFF32
        if not TG.offsets_fit_32(k, v):  # the _off32 rows would run the 64-bit loader (attention's off32=None)
            raise ValueError(f"{self.name}: K/V rows beyond 32-bit offsets; the OFF32 rows cannot run here")
        # the loader's row offsets in 64 and 32 bits (OFF32, the same for both kinds of list) alternated twice, so the
        # run's own spread shows beside their difference (kernel_notes "v24"); the other tilings and eight loader
        # warps were slower in every earlier run (kernel_notes "v18") and run only with GLUON_TOKEN_TILINGS=1
        runs = [(f"{'_off32' if o else ''}{'#2' if again else ''}", o)
                for again in (False, True) for o in (False, True)]
        variants = [("gluon" + tag, tiles, loader, o) for tag, o in runs]
        if os.environ.get("GLUON_TOKEN_TILINGS") == "1":
            variants += [(f"gluon_bn{a[0]}s{a[1]}", {**tiles, self.d: a}, loader, flags["int32"])
                         for a in ((64, 6), (64, 4))] + [("gluon_l8", tiles, (8, 40, 208), flags["int32"])]
        rec("token128", "pointer", "pointer")
        for name, t, ld, off32 in variants:
            TG.TILES, TG.LOADER, TG.OFF32 = t, ld, dict.fromkeys(flags, off32)
            try:
                rec("token128", name, "gluon")
            finally:
                TG.TILES, TG.LOADER, TG.OFF32 = tiles, loader, flags
        rec("token128_reuse", "pointer_compact_fp8", "pointer")
        for tag, off32 in runs:
            TG.OFF32 = dict.fromkeys(flags, off32)
            try:
                rec("token128_reuse", "gluon_compact_fp8" + tag, "gluon")
            finally:
                TG.OFF32 = flags

    def make_token_lists(self, dens=0.15):
        """Random groups of 128 queries and sorted lists of dens x N tokens each, made once per shape: (groups int32
        (1, H, G, 128), lists int32 (1, H, G, k), counts int32 (1, H, G), k)."""
        if getattr(self, "token_lists", None) is not None:
            return self.token_lists
        h, n = self.h, self.n
        perm = torch.randperm(n, device=DEV, generator=self.gen).to(torch.int32)
        g = math.ceil(n / 128)
        groups = torch.full((g * 128,), -1, dtype=torch.int32, device=DEV)
        groups[:n] = perm
        self.groups = groups.view(1, 1, g, 128).expand(1, h, g, 128).contiguous()
        kk = int(dens * n)
        toks = torch.empty((1, h, g, kk), dtype=torch.int32, device=DEV)
        for h0 in range(h):  # per head: the (g, n) random scores of all heads at once are large
            t = torch.topk(torch.rand(g, n, device=DEV, generator=self.gen), kk, dim=-1).indices
            toks[0, h0] = torch.sort(t, -1).values.to(torch.int32)
        tcnt = torch.full((1, h, g), kk, dtype=torch.int32, device=DEV)
        self.token_lists = (self.groups, toks, tcnt, kk)
        return self.token_lists

    def pass2(self):
        q, k, v, K, MT = self.q, self.k, self.v, self.m["K"], self.m["MT"]
        if not hasattr(self, "groups"):
            return
        _, lse = K.attention_dense(q, k, v, return_lse=True)
        pass1 = next((r["ms"] for r in self.rows if r.get("shape") == self.name and r.get("kind") == "dense_lse"
                      and r.get("variant") == "cudnn" and "ms" in r), None)
        for path in ("tma", "pointer"):
            r = self.rec("pass2_mass", path, lambda path=path: MT.group_kv_mass(q, k, lse, self.groups,
                                                                                validate=False, path=path),
                         config=lambda: MT._mass_fwd.best_config)
            if r and pass1 and self.cudnn:
                r["note"] = f"{r['ms'] / self.cudnn:.2f}x cuDNN; pass1+pass2 {(pass1 + r['ms']) / self.cudnn:.2f}x"
        torch.cuda.empty_cache()

    def rescale(self, densities):
        """Eager against lazy rescaling (SPARSE_ATTN_RESCALE, kernels/_triton_common.py): the TMA block-sparse
        kernel at each density, the TMA dense + LSE kernel, the fused block anchor (fp8 residual) and the
        token-sparse kernel at 0.15, each tuned for its mode (LAZY is in the autotune keys)."""
        self.compare("SPARSE_ATTN_RESCALE", ("eager", "lazy"), densities, compact=False)

    def loop(self, densities):
        """Plain loops against scores one tile ahead (SPARSE_ATTN_LOOP, kernels/_triton_common.py, loop_ahead): the
        same kernels as ``rescale`` plus the token kernel on compact lists with an fp8 residual (the engine's
        reuse call). Each kernel is timed plain, ahead, then plain again, so a drift of the GPU's clocks during the
        run shows as a difference between the two plain rows."""
        self.compare("SPARSE_ATTN_LOOP", ("plain", "ahead"), densities, compact=True, again=True)

    def compare(self, env, modes, densities, compact, again=False):
        """Time each kernel under each value of the environment switch ``env`` (read at every launch, in the
        autotune keys, so each mode is tuned for itself); with ``again`` the first mode once more at the end of
        each kernel. Variants are labelled ``<path>-<mode>`` (``-again`` for the repeat)."""
        q, k, v, BT, AH, AT, DT = self.q, self.k, self.v, self.m["BT"], self.m["AH"], self.m["AT"], self.m["DT"]
        order = [(m, m) for m in modes] + ([(modes[0], f"{modes[0]}-again")] if again else [])
        kernels = []
        for dens in densities:
            idx, cnt, real = self.block_lists(dens, False)
            kernels.append(lambda label, idx=idx, cnt=cnt, real=real, dens=dens: self.rec(
                "bsa128", f"tma-{label}", lambda: BT.block_sparse_attention(
                    q, k, v, idx, cnt, block_q=128, block_k=128, validate=False, path="tma"), real,
                config=lambda: AH.last_config("sparse"), target=dens))
        kernels.append(lambda label: self.rec("dense_lse", f"tma-{label}", lambda: DT.attention_dense(
            q, k, v, return_lse=True, path="tma"), config=lambda: AH.last_config("dense")))
        idx, cnt, _ = self.block_lists(densities[0], False)
        kernels.append(lambda label: self.rec("anchor", f"fused_fp8-{label}", lambda: AT.block_anchor_attention(
            q, k, v, idx, cnt, block_q=128, block_k=128, residual_precision="fp8", validate=False),
            config=lambda: AH.last_config("anchor"), target=densities[0]))
        kernels.append(lambda label: self.token(variant=f"pointer-{label}", reuse=False))
        if compact:
            kernels.append(lambda label: self.token_compact(variant=f"compact_fp8-{label}"))
        saved = os.environ.get(env)
        try:
            for kernel in kernels:
                for mode, label in order:
                    os.environ[env] = mode
                    kernel(label)
        finally:
            if saved is None:
                os.environ.pop(env, None)
            else:
                os.environ[env] = saved

    def epilogue(self, densities):
        """Where the composed anchor's time goes, per density: the block-sparse kernel alone, the same walk forming R
        (fp8, with its mass) from cuDNN's output in its epilogue (block_residual), the reuse call (fp8 residual
        weighted by the mass), the whole anchor as kernels/api.py runs it, and that anchor's two halves timed in
        sequence (events around the dense call and around block_residual, median of the rounds), which tells
        whether a half costs more right after the other than alone."""
        q, k, v, K, AT, AH, BT = self.q, self.k, self.v, self.m["K"], self.m["AT"], self.m["AH"], self.m["BT"]
        kw = dict(block_q=128, block_k=128, residual_precision="fp8", validate=False, return_mass=True)
        out, lse = K.attention_dense(q, k, v, return_lse=True)
        for dens in densities:
            idx, cnt, real = self.block_lists(dens, False)
            self.rec("bsa128", "tma", lambda idx=idx, cnt=cnt: BT.block_sparse_attention(
                q, k, v, idx, cnt, block_q=128, block_k=128, validate=False, path="tma"), real,
                config=lambda: AH.last_config("sparse"), target=dens)
            self.rec("residual_epilogue", "alone", lambda idx=idx, cnt=cnt: AT.block_residual(
                q, k, v, idx, cnt, out, lse, **kw), real, config=lambda: AH.last_config("sparse"), target=dens)
            triple = AT.block_residual(q, k, v, idx, cnt, out, lse, **kw)
            self.rec("reuse", "fused_fp8_mass", lambda idx=idx, cnt=cnt, triple=triple: BT.block_sparse_attention(
                q, k, v, idx, cnt, block_q=128, block_k=128, validate=False, residual=triple), real,
                config=lambda: AH.last_config("sparse"), target=dens)
            del triple
            self.rec("anchor", "api", lambda idx=idx, cnt=cnt: K.block_anchor_attention(q, k, v, idx, cnt, **kw),
                     target=dens, kept=real)
            if DEV == "cuda" and self.budget.ok(f"{self.name} anchor halves {dens}"):
                halves = []
                for _ in range(5):
                    ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
                    ev[0].record()
                    o, ls = K.attention_dense(q, k, v, return_lse=True)
                    ev[1].record()
                    AT.block_residual(q, k, v, idx, cnt, o, ls, **kw)
                    ev[2].record()
                    ev[2].synchronize()
                    halves.append((ev[0].elapsed_time(ev[1]), ev[1].elapsed_time(ev[2])))
                    del o, ls
                for i, label in enumerate(("dense_lse", "residual_epilogue")):
                    ms = sorted(h[i] for h in halves)[len(halves) // 2]
                    dn = 1.0 if i == 0 else real
                    row = dict(shape=self.name, heads=self.h, tokens=self.n, head_dim=self.d, kind=label,
                               variant="in_sequence", ms=ms, density=dn, eff_tflops=self.flops * dn / ms / 1e9,
                               config="", target=dens, rounds=[round(h[i], 3) for h in halves])
                    if self.cudnn:
                        row.update(x_cudnn=self.cudnn / ms, x_d=self.cudnn / ms * dn)
                    self.rows.append(row)
                    say(f"{self.name:7s} {label:18s} in_sequence  {ms:9.3f} ms")

    def token_compact(self, variant, dens=0.15):
        """The token kernel on the compact int16 lists the engine caches (kernels/compact_torch.py), made from the
        shape's int32 token lists, with an fp8 residual: what a mc_sparse reuse call runs (on the pointer kernel,
        named: see ``token``)."""
        grp, toks, tcnt, kk = self.make_token_lists(dens)
        low, ends, res = self.compact_token_lists()
        q, k, v, TT = self.q, self.k, self.v, self.m["TT"]
        self.rec("token128_reuse", variant, lambda: TT.token_sparse_attention_compact(
            q, k, v, grp, low, ends, tcnt, validate=False, residual=(res.data, res.scale), path="pointer"),
            kk / self.n, config=lambda: TT._token_fwd.best_config, target=dens)

    def compact_token_lists(self):
        """``make_token_lists``'s lists compacted as the engine caches them, with an fp8 residual: (low, ends,
        residual), made once per shape."""
        if getattr(self, "compact_lists", None) is None:  # the engine's own compaction, at the engine's width
            _, toks, tcnt, kk = self.make_token_lists()
            width = self.m["CT"].aligned_width(kk)
            padded = torch.nn.functional.pad(toks, (0, width - kk), value=-1)
            low, ends = self.m["TokenSelection"].compact(padded, tcnt, self.n)
            res = self.m["Residual"].encode(torch.randn(self.q.shape, device=DEV, dtype=self.q.dtype,
                                                        generator=self.gen) * 0.05, "fp8")
            self.compact_lists = (low, ends, res)
        return self.compact_lists

    def warp_spec(self, dens=0.25):
        q, k, v, BT, AH = self.q, self.k, self.v, self.m["BT"], self.m["AH"]
        idx, cnt, real = self.block_lists(dens, False)
        self.rec("bsa128", "warp_spec", lambda: BT.block_sparse_attention(
            q, k, v, idx, cnt, block_q=128, block_k=128, validate=False, path="warp_spec"), real,
            config=lambda: AH.last_config("warp_spec"), target=dens)


def resources(mods):  # noqa: C901
    """Registers, spills and shared memory of every compiled variant of the main kernels."""
    out = []
    fns = dict(attn_tma=mods["AH"]._attn_tma, bsa_pointer=mods["BT"]._bsa_fwd, token=mods["TT"]._token_fwd,
               mass=mods["MT"]._mass_fwd, dense_pointer=mods["DT"]._dense_fwd)
    for name, fn in fns.items():
        while not hasattr(fn, "device_caches") and hasattr(fn, "fn"):
            fn = fn.fn
        for cache in getattr(fn, "device_caches", {}).values():
            kernels = next((c for c in (cache if isinstance(cache, tuple) else (cache,)) if isinstance(c, dict)), {})
            for key, ker in kernels.items():
                try:
                    if getattr(ker, "n_regs", None) is None and hasattr(ker, "_init_handles"):
                        ker._init_handles()
                    md = ker.metadata
                    out.append(dict(kernel=name, n_regs=ker.n_regs, n_spills=ker.n_spills, shared=md.shared,
                                    num_warps=md.num_warps, num_stages=md.num_stages,
                                    maxnreg=getattr(md, "maxnreg", None), key=str(key)[:600]))
                except Exception as exc:
                    out.append(dict(kernel=name, error=str(exc)[:200], key=str(key)[:300]))
    return out


def table(meta, rows, tests, budget):
    dims = "/".join(str(d) for d in sorted({r["head_dim"] for r in rows if "head_dim" in r})) or "128"
    lines = [f"GPU {meta['gpu']}, torch {meta['torch']}, Triton {meta['triton']}, {meta['date']}. bf16, B=1, "
             f"D={dims}, 128-blocks. ms = median; x cuDNN = cuDNN dense ms / ms; x d = x cuDNN * density "
             f"(1 = ideal 1/d); vs Flex = Flex ms / ms (* = reference Flex time of docs/benchmarks.md).",
             f"GPU tests: {tests.get('tail', ['not run'])[-1] if tests else 'not run'}", "",
             "| shape | kernel | variant | d | ms | TF/s | x cuDNN | x d | vs Flex | note | config |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "medians" in r:  # Shape.anchor_ab's summary of the alternated calls
            lines.append(f"| {r['shape']} | anchor medians | " + ", ".join(
                f"{n} {t:.2f} ms" + (f" ({t / r['cudnn']:.3f}x cuDNN)" if r.get("cudnn") else "")
                for n, t in r["medians"].items()) + f" | {r['target']} | | | | | | {r.get('error', '')[:80]} | |")
            continue
        if "ms" not in r:
            lines.append(f"| {r['shape']} | {r['kind']} | {r['variant']} | {r.get('target', '')} | FAILED "
                         f"| | | | | | {r['error'][:80]} |")
            continue
        vf = f"{r['vs_flex']:.2f}" if "vs_flex" in r else (f"{r['vs_flex_ref']:.2f}*" if "vs_flex_ref" in r else "")
        cfg = r.get("config", "").replace("num_ctas: 1, ", "").replace(", maxnreg: None", "")
        # an anchor's list density
        dens = r["target"] if r["kind"] in ("anchor", "anchor_ab") and "target" in r else r["density"]
        lines.append(f"| {r['shape']} | {r['kind']} | {r['variant']} | {dens:.3f} | {r['ms']:.3f} | "
                     f"{r['eff_tflops']:.0f} | {r.get('x_cudnn', 0):.2f} | {r.get('x_d', 0):.2f} | {vf} | "
                     f"{r.get('note', '')} | {cfg[:90]} |")
    if budget.skipped:
        lines += ["", f"Skipped for time: {', '.join(budget.skipped)}"]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/hopper-out"))
    ap.add_argument("--budget", type=float, default=240.0, help="seconds for the timing part")
    ap.add_argument("--tests-timeout", type=float, default=200.0)
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--shapes", default="wan14b,wan13b,hyv")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--tests-k", default="", help="only the GPU tests pytest's -k selects")
    ap.add_argument("--plan", choices=("full", "rescale", "loop", "mass", "anchor", "epilogue", "tilings", "gluon",
                                           "token", "persistent", "flex", "gluon_anchor"),
                    default="full",
                    help="full: every variant; rescale: eager against lazy rescaling only (Shape.rescale); loop: "
                         "plain loops against scores one tile ahead (Shape.loop); mass: the mass-weighted residual "
                         "against the fixed one (Shape.mass); anchor: the fused anchor against the dense call plus "
                         "the residual epilogue, per density (Shape.anchor_paths); epilogue: the composed anchor's "
                         "halves, alone and in sequence (Shape.epilogue); tilings: the fused anchor on each candidate "
                         "tiling against the composed anchor (Shape.anchor_paths with tilings); gluon: the Gluon "
                         "kernel against the TMA kernel and cuDNN (Shape.gluon; live Flex on the first shape); "
                         "token: the Gluon token kernel's variants (Shape.gluon_token); persistent: the Gluon block "
                         "kernel's two grids at d 0.15-0.5 (Shape.persistent_ab); flex: the automatic block "
                         "kernel against live FlexAttention, alternated --repeats times at --densities "
                         "(Shape.flex_ab); gluon_anchor: the Gluon one-pass block anchor against the composed one, "
                         "alternated (Shape.anchor_ab)")
    ap.add_argument("--densities", default="0.15,0.2,0.25,0.3,0.5",
                    help="persistent, flex and gluon_anchor plans: the densities")
    ap.add_argument("--repeats", type=int, default=2,
                    help="persistent, flex and gluon_anchor plans: how often the variants alternate")
    ap.add_argument("--dry", action="store_true", help="CPU + Triton interpreter, tiny shapes: checks the script")
    args = ap.parse_args()
    if args.dry:
        global DEV
        DEV = "cpu"
        args.skip_tests, args.no_flex = True, True
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = dict(gpu=torch.cuda.get_device_name() if DEV == "cuda" else "cpu (dry run)",
                capability=torch.cuda.get_device_capability() if DEV == "cuda" else None,
                torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
                date=time.strftime("%Y-%m-%d %H:%M"))
    say(f"meta {meta}")
    tests = None if args.skip_tests else run_tests(out_dir, args.tests_timeout, args.tests_k)
    budget = Budget(args.budget)
    mods = dict(K=load("kernels"), API=load("kernels.api"), BT=load("kernels.block_sparse_triton"),
                AH=load("kernels.attention_hopper"),
                DT=load("kernels.dense_triton"), AT=load("kernels.anchor_triton"),
                TT=load("kernels.token_sparse_triton"), MT=load("kernels.mass_triton"),
                CT=load("kernels.compact_torch"), DC=load("kernels.dense_cudnn"),
                TokenSelection=load("engine.selection").TokenSelection,
                encode=load("kernels._residual").encode_residual,
                Residual=load("engine.residual").Residual)
    flex = None if args.no_flex else kb.flex_runner()
    rows = []
    names = args.shapes.split(",")
    shapes = {}

    def save():
        (out_dir / "hopper.json").write_text(json.dumps(dict(meta=meta, tests=tests, rows=rows,
                                                             skipped=budget.skipped,
                                                             broken=load("kernels._hopper").broken()), indent=1))

    def step(name, what, *a):
        try:
            if name not in shapes:
                if not budget.ok(f"{name} (all)", need=10.0):
                    return
                say(f"--- {name}: H={kb.SHAPES[name][0]} N={kb.SHAPES[name][1]} D={kb.SHAPES[name][2]}")
                shapes[name] = Shape(name, rows, budget, mods, flex)
                shapes[name].dense()
            getattr(shapes[name], what)(*a)
        except torch.OutOfMemoryError as exc:
            say(f"{name} {what}: out of memory ({str(exc)[:200]})")
        except Exception as exc:
            say(f"{name} {what}: {type(exc).__name__}: {str(exc)[:300]}")
            rows.append(dict(shape=name, kind=what, variant="-", error=str(exc)[:2000],
                             trace=traceback.format_exc()[-3000:]))
        save()

    # per shape: the core first, FlexAttention last (reference times stand in when it is cut)
    plan = [(name, args.plan, (0.25, 0.1, 0.5)) for name in names] if args.plan in ("rescale", "loop") else []
    if args.plan == "mass":
        plan = [(name, "mass", (0.15, 0.1)) for name in names]
    if args.plan == "anchor":
        plan = [step for name in names
                for step in ((name, "anchor_paths", (0.05, 0.08, 0.1, 0.12, 0.15, 0.2, 0.25)), (name, "dense_ours"))]
    if args.plan == "epilogue":
        plan = [(name, "epilogue", (0.08, 0.1)) for name in names]
    if args.plan == "gluon":
        plan = [(name, "gluon", (0.25, 0.1, 0.5), (0.08, 0.1) if i == 0 else (0.08,), i == 0,
                 (0.15, 0.25) if i == 0 else ()) for i, name in enumerate(names)]
    if args.plan == "token":
        plan = [(name, "gluon_token") for name in names]
    if args.plan == "persistent":
        plan = [(name, "persistent_ab", tuple(float(d) for d in args.densities.split(",")), args.repeats)
                for name in names]
    if args.plan == "flex":
        plan = [(name, "flex_ab", tuple(float(d) for d in args.densities.split(",")), args.repeats)
                for name in names]
    if args.plan == "gluon_anchor":
        plan = [(name, "anchor_ab", tuple(float(d) for d in args.densities.split(",")), args.repeats)
                for name in names]
    if args.plan == "tilings":
        plan = [(name, "anchor_paths", (0.08, 0.15, 0.25), True) for name in names]
    for i, name in enumerate(names if args.plan == "full" else ()):
        anchors = (0.25, 0.1) if i == 0 else (0.25,)
        plan += [(name, "sparse", (0.25, 0.1, 0.5)), (name, "dense_ours"), (name, "anchor", anchors)]
        if i == 0:
            plan += [(name, "residual", (0.25,))]
        plan += [(name, "token"), (name, "pass2"),
                 (name, "sparse", (0.25, 0.1), True, ("tma", "persistent", "pointer") if i == 0 else ("tma",)),
                 (name, "flex_rows", (0.25, 0.1))]
        if i == 0:
            plan += [(name, "flex_rows", (0.25, 0.1), True)]
        if i == len(names) - 1:
            plan += [(name, "warp_spec")]
    for name, what, *a in plan:
        for other in [o for o in shapes if o != name]:  # one shape's tensors at a time
            del shapes[other]
            torch.cuda.empty_cache()
        step(name, what, *a)
    save()
    try:
        res = resources(mods)
    except Exception as exc:  # Triton's cache layout differs between versions: report, do not fail
        res = [dict(error=f"{type(exc).__name__}: {exc}")]
    (out_dir / "resources.json").write_text(json.dumps(res, indent=1))
    say(f"compiled kernels: {len(res)} (registers / local memory in 4-byte words (Triton's n_spills) / shared bytes, "
        "warps, stages)")
    for r in res:
        if "n_regs" in r:
            print(f"    {r['kernel']:13s} regs {r['n_regs']:3d} spills {r['n_spills']:4d} shared {r['shared']:6d} "
                  f"w{r['num_warps']} s{r['num_stages']} maxnreg {r['maxnreg']}")
    md = table(meta, rows, tests, budget)
    (out_dir / "hopper.md").write_text(md)
    say("done")
    print(md)


if __name__ == "__main__":
    main()
