"""bench/hopper.py's plans run end to end under the Triton interpreter on tiny shapes (--dry), so the device
benchmark does not rot between device sessions."""

import json
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.skipif(__import__("importlib").util.find_spec("triton") is None,
                                reason="Triton not installed")


PLANS = ("full", "rescale", "loop", "mass", "anchor", "epilogue", "tilings", "gluon", "token", "gluon_anchor")


@pytest.fixture(scope="module")
def dry_runs(request, tmp_path_factory):
    """The selected plans' dry runs, two at a time (each is one single-threaded interpreter process): {plan:
    (process, out folder)}."""
    from concurrent.futures import ThreadPoolExecutor
    selected = [item.callspec.params["plan"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")]

    def run(plan):
        out = tmp_path_factory.mktemp(f"hopper-{plan}")
        return plan, (subprocess.run([sys.executable, str(ROOT / "bench" / "hopper.py"), "--dry", "--plan", plan,
                                      "--shapes", "wan14b", "--out", str(out)], capture_output=True, text=True,
                                     timeout=900, cwd=str(ROOT)), out)
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(run, [plan for plan in PLANS if plan in selected]))


@pytest.mark.parametrize("plan", PLANS)
def test_hopper_bench_dry_run(dry_runs, plan):
    proc, tmp_path = dry_runs[plan]
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads((tmp_path / "hopper.json").read_text())
    rows = doc["rows"]
    failed = [r for r in rows if "error" in r]
    assert not failed, failed
    kinds = {(r["kind"], r["variant"]) for r in rows}
    if plan == "rescale":  # each kernel timed in both modes
        for mode in ("eager", "lazy"):
            assert {("bsa128", f"tma-{mode}"), ("dense_lse", f"tma-{mode}"), ("anchor", f"fused_fp8-{mode}"),
                    ("token128", f"pointer-{mode}")} <= kinds
        assert sum(1 for r in rows if r["kind"] == "bsa128") == 6  # 3 densities x 2 modes
    elif plan == "loop":  # plain, ahead, plain again; the token kernel on compact lists too
        for mode in ("plain", "ahead", "plain-again"):
            assert {("bsa128", f"tma-{mode}"), ("dense_lse", f"tma-{mode}"), ("anchor", f"fused_fp8-{mode}"),
                    ("token128", f"pointer-{mode}"), ("token128_reuse", f"compact_fp8-{mode}")} <= kinds
        assert sum(1 for r in rows if r["kind"] == "bsa128") == 9
    elif plan == "mass":  # fixed, mass, fixed again for the anchor and the reuse call at two densities
        for label in ("fixed", "mass", "fixed-again"):
            assert {("anchor", f"fused_fp8-{label}"), ("reuse", f"fused_fp8-{label}")} <= kinds
        assert sum(1 for r in rows if r["kind"] in ("anchor", "reuse")) == 2 * 6
    elif plan == "anchor":  # three anchor paths at each of seven densities, then our dense kernels for reference
        paths = {("anchor", "fused_fp8"), ("anchor", "cudnn+epilogue"), ("anchor", "api")}
        assert kinds - {("dense", "cudnn"), ("dense_lse", "cudnn"), ("dense_lse", "tma"), ("dense_lse", "pointer")} \
            == paths
        assert sorted({r["target"] for r in rows if "target" in r}) == [0.05, 0.08, 0.1, 0.12, 0.15, 0.2, 0.25]
        assert len(rows) == 3 * 7 + 2 + 2  # and the cuDNN dense rows every shape starts with
    elif plan == "gluon_anchor":  # no Gluon in the interpreter: the composed path and the TMA fused pass, alternated
        dens = [0.15, 0.2, 0.25, 0.3, 0.5]  # the plan's default densities, all above FUSED_ANCHOR_ABOVE
        assert kinds - {("dense", "cudnn"), ("dense_lse", "cudnn")} == {
            ("anchor_ab", f"{p}#{i}") for p in ("tma+epilogue", "tma_fused") for i in (1, 2)} | {
            ("anchor_ab_median", "-")}
        summaries = [r for r in rows if r["kind"] == "anchor_ab_median"]
        assert [r["target"] for r in summaries] == dens
        assert all(set(r["medians"]) == {"tma+epilogue", "tma_fused"} for r in summaries)
    elif plan == "tilings":  # the fused anchor on each candidate tiling alone, then the composed path and the API's
        tilings = [r for r in rows if r["kind"] == "anchor" and r["variant"].startswith("fused_t")]
        assert {r["variant"] for r in tilings} == {f"fused_t{i}" for i in range(len(tilings) // 3)}
        assert len({r["config"] for r in tilings}) == len(tilings) // 3 >= 2  # each row names its own tiling
        assert kinds - {("dense", "cudnn"), ("dense_lse", "cudnn")} == {r2 for r2 in kinds if r2[0] == "anchor"}
        assert {("anchor", "cudnn+epilogue"), ("anchor", "api")} <= kinds and ("anchor", "fused_fp8") not in kinds
        assert sorted({r["target"] for r in rows if "target" in r}) == [0.08, 0.15, 0.25]
    elif plan == "epilogue":  # four kernels at two densities (the halves in sequence are timed on a GPU only)
        assert kinds - {("dense", "cudnn"), ("dense_lse", "cudnn")} == {
            ("bsa128", "tma"), ("residual_epilogue", "alone"), ("reuse", "fused_fp8_mass"), ("anchor", "api")}
        assert sorted({r["target"] for r in rows if "target" in r}) == [0.08, 0.1]
        assert len(rows) == 4 * 2 + 2
    elif plan == "gluon":  # the interpreter has no Gluon: its rows are the TMA side of each comparison
        assert kinds - {("dense", "cudnn")} == {
            ("dense_lse", "cudnn"), ("dense_lse", "tma"), ("bsa128", "tma"), ("bsa128_skew", "tma"),
            ("reuse", "tma_fp8_mass"), ("anchor", "api"), ("anchor", "cudnn+epilogue"), ("anchor", "fused_fp8"),
            ("anchor", "tma+epilogue")}
        assert sorted({r["target"] for r in rows if r["kind"] == "anchor"}) == [0.08, 0.1, 0.15, 0.25]
        assert sum(1 for r in rows if r["kind"] == "bsa128") == 3 and sum(
            1 for r in rows if r["kind"] == "bsa128_skew") == 2
    elif plan == "token":  # the interpreter has no Gluon: the pointer kernel's side, int32 and compact lists
        assert kinds - {("dense", "cudnn"), ("dense_lse", "cudnn")} == {
            ("token128", "pointer"), ("token128_reuse", "pointer_compact_fp8")}
        assert {r["target"] for r in rows if r["kind"].startswith("token")} == {0.15}
    else:
        assert {("bsa128", "tma"), ("bsa128", "pointer"), ("dense_lse", "tma"), ("anchor", "fused_fp8"),
                ("token128", "pointer"), ("pass2_mass", "tma")} <= kinds
    assert (tmp_path / "hopper.md").read_text().count("| wan14b |") == len(rows)
