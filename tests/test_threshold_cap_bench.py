"""bench/threshold_cap.py's dry run (CPU, 20 480 tokens: keep_top's long rows, the PyTorch twins) goes through the
same code as the GPU run at Wan 14B, so the device measurement of the cap (docs/kernel_notes.md, "v27") does not rot
between device sessions. A few seconds."""

import json


def test_threshold_cap_bench_dry_run(bench_import, tmp_path):
    bench = bench_import("threshold_cap")
    doc = bench.main(["--dry", "--densities", "0.1,0.05", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "threshold_cap.json").read_text()) == json.loads(json.dumps(doc))
    rows = doc["rows"]
    assert [(r["data"], r["density"]) for r in rows] == [(d, x) for d in ("random", "local") for x in (0.1, 0.05)]
    for r in rows:
        assert r["tokens"] == 20480 and r["rows"] == r["heads"] * r["groups"] == 160
        assert r["k"] == round(r["density"] * 20480) < r["bound"] < 1.25 * r["k"]
        assert 0.0 <= r["over_cap_share"] <= 1.0 and r["max_count_over_k"] >= r["count_over_k"]["p99.9"] > 0.5
        assert r["capped_max_count"] <= r["bound"]
        assert r["list_width"]["capped"] == -(-r["bound"] // 16) * 16  # known on the host
        assert r["list_width"]["uncapped"] == -(-round(r["max_count_over_k"] * r["k"]) // 16) * 16  # read back
        assert set(r["ms"]) == {"keep_at_threshold", "keep_at_threshold_capped", "keep_top", "keep_top_capped",
                                "keep_at_threshold_capped_all_over"}
        assert all(v > 0 for v in r["ms"].values()) and all(v > 0 for v in r["selection_ms"].values())
    table = (tmp_path / "threshold_cap.md").read_text().splitlines()
    assert sum(line.startswith("| random") or line.startswith("| local") for line in table) == len(rows)
