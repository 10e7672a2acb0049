"""Regressions found by fuzzing the engine, the configuration and the numerics (docs/reliability.md): each test
failed on the code it was written against, or guards a fix that landed with the finding. CPU only."""

import json
import threading

import pytest
import torch
from sparse_ref import rel_l2

from comfyui_sparse_attention.engine import CallContext, SparseConfig, SparseEngine, TokenLayout
from comfyui_sparse_attention.engine.block_geometry import rows_above_threshold
from comfyui_sparse_attention.engine.residual import Residual
from comfyui_sparse_attention.kernels import attention_dense

SDPA = torch.nn.functional.scaled_dot_product_attention
SMALL = dict(min_tokens=0, backend="torch", block_q=64, block_k=64, group_size=64)


def _qkv(b, h, n, d=32, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=g).to(dtype) for _ in range(3))


# 1. a call with no image tokens ------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["mc_sparse", "block_topk", "static", "hybrid"])
def test_calls_with_no_image_tokens_run_dense(method):
    q, k, v = _qkv(1, 2, 100)
    eng = SparseEngine(SparseConfig(method=method, density=0.15, **SMALL))
    eng.begin_run()
    outs = [eng.attend(q, k, v, CallContext(layer=0, step=s, layout=TokenLayout(text_len=100))) for s in range(3)]
    eng.end_run()
    assert all(rel_l2(o, SDPA(q, k, v)) < 1e-5 for o in outs)


# 2. float block and group sizes -------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [("block_k", 128.0), ("block_q", 64.0), ("group_size", 64.0),
                                         ("block_k", True), ("group_size", "64")])
def test_non_integer_sizes_are_refused_naming_the_field(field, value, tmp_path):
    with pytest.raises(ValueError, match=field):
        SparseConfig(**{field: value})
    preset = tmp_path / "sizes.yaml"
    preset.write_text(f"sparse:\n  {field}: {json.dumps(value)}\n")
    with pytest.raises(ValueError, match=rf"sizes\.yaml: .*{field}"):
        SparseConfig.from_yaml(preset)


# 3. batch or head count changing under one cache key ----------------------------------------------------------
@pytest.mark.parametrize("method", ["mc_sparse", "block_topk", "static"])
@pytest.mark.parametrize("first,then", [((2, 2), (1, 2)), ((1, 2), (2, 2)), ((1, 4), (1, 2))])
def test_a_changed_batch_or_head_count_anchors_again(method, first, then):
    eng = SparseEngine(SparseConfig(method=method, density=0.25, **SMALL))
    eng.begin_run()
    lay = TokenLayout(grid=(2, 8, 16))
    q, k, v = _qkv(*first, 256)
    eng.attend(q, k, v, CallContext(layer=0, step=0, layout=lay))
    for step in (1, 2, 3):
        q, k, v = _qkv(*then, 256, seed=step)
        out = eng.attend(q, k, v, CallContext(layer=0, step=step, layout=lay))
        assert out.shape == q.shape and torch.isfinite(out).all()
        if step == 1:  # the entry of the other shape cannot serve: this call anchors (exact)
            assert rel_l2(out, SDPA(q, k, v)) < 1e-5
    t = eng.end_run().totals()
    assert t["anchors"] == 2 and t["reuses"] == 2


# a step cache skipping steps: the anchor that never ran moves to the next computed step ---------------------------
@pytest.mark.parametrize("schedule,total,ran,expected", [
    ("5", 10, [0, 1, 2, 3, 4, 6, 7, 8, 9], "ArrrrArrr"),             # step 5 skipped: 6 anchors
    ("every 3", 12, [0, 1, 2, 4, 5, 7, 8, 10, 11], "ArrArArArr"[:9]),  # 3, 6, 9 skipped: 4, 7, 10 anchor
    ("50%", 8, [0, 1, 2, 3, 5, 6, 7], "ArrrArr"),                     # step 4 skipped
    ("5", 10, [0, 1, 2, 3, 4, 5, 5, 6], "ArrrrArr"),                  # a repeated step reuses its anchor
    ("", 10, [0, 1, 2, 3, 1, 2], "ArrrAr"),                          # the steps went back: select afresh
])
def test_a_skipped_anchor_step_makes_the_next_computed_step_the_anchor(schedule, total, ran, expected):
    eng = SparseEngine(SparseConfig(anchor_steps=schedule, **SMALL))
    eng.begin_run()
    lay = TokenLayout(grid=(1, 16, 16))
    letters = ""
    for step in ran:
        q, k, v = _qkv(1, 1, 256, seed=step)
        before = eng.stats.totals()["anchors"]
        eng.attend(q, k, v, CallContext(layer=0, step=step, total_steps=total, layout=lay))
        letters += "A" if eng.stats.totals()["anchors"] > before else "r"
    eng.end_run()
    assert letters == expected


# 4. ties at the top of a group's mass ----------------------------------------------------------------------
def test_tied_scores_fill_the_budget_instead_of_emptying_it():
    row = torch.zeros(3, 1000)
    row[:, 200:300] = 0.5  # 100 tied entries, more than the budget
    row[1, 5] = 0.9        # one above them
    row[2] = 1.0           # everything tied
    idx, cnt = rows_above_threshold(row, 51)
    assert cnt.tolist() == [51, 51, 51]
    assert set(idx[0, :51].tolist()) <= set(range(200, 300))
    assert 5 in idx[1, :51].tolist()
    long = torch.zeros(2, 20_000)  # the sampled-threshold path (rows longer than 4 x 4096)
    long[:, 3000:3400] = 1.0
    idx, cnt = rows_above_threshold(long, 100)
    assert (cnt > 0).all() and (cnt <= 400).all()


def test_sampled_threshold_skips_the_tie_count_only_where_ties_fit():
    """keep_top on long rows takes every tie without a prefix count when each row's ties fit its room (or it has
    no room); one row whose ties overflow makes the whole call fill ties in index order, exactly k."""
    from comfyui_sparse_attention.engine.block_geometry import keep_top
    gen = torch.Generator().manual_seed(3)
    rows = torch.rand(4, 70_000, generator=gen)  # distinct values: the sampled threshold ties only with itself
    keep = keep_top(rows, 7000)
    thresh = torch.where(keep, rows, torch.full_like(rows, 2.0)).amin(-1, keepdim=True)
    assert torch.equal(keep, rows >= thresh)  # a threshold cut, no holes
    assert ((keep.sum(-1) - 7000).abs() <= 700).all()  # k up to sampling noise
    zeros = rows.clone()
    zeros[1] = 0.0
    zeros[1, :50] = 1.0  # 50 above, 69 950 tied at 0: the ties must fill up to k in order
    keep = keep_top(zeros, 7000)
    assert int(keep[1].sum()) == 7000 and bool(keep[1, :7000].all()) and not bool(keep[1, 7000:].any())
    assert torch.equal(keep[0], keep_top(rows, 7000)[0])  # the other rows keep their cut


def test_mc_sparse_keeps_tied_keys_that_hold_all_the_attention():
    n, d = 512, 32
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, n, d, generator=g) * 0.1 + 1.0
    k = torch.randn(1, 1, n, d, generator=g) * 0.1
    k[:, :, 100:200] = 1.0  # 100 identical keys with all the mass (budget: 0.1 * 512 = 51 keys)
    v = torch.randn(1, 1, n, d, generator=g)
    v[:, :, 100:200] = 3.0
    eng = SparseEngine(SparseConfig(method="mc_sparse", density=0.1, **SMALL))
    eng.begin_run()
    lay = TokenLayout(grid=(1, 16, 32))
    eng.attend(q, k, v, CallContext(layer=0, step=0, layout=lay))
    entry = eng.cache.peek(CallContext(layer=0, step=0).key(n))
    assert int(entry.selection.kv_counts.min()) > 0
    out = eng.attend(q, k, v * 2, CallContext(layer=0, step=1, layout=lay))  # reuse with changed values
    assert rel_l2(out, SDPA(q, k, v * 2)) < 0.05
    eng.end_run()


# 5/6. pass 2 with an inconsistent LSE -----------------------------------------------------------------------
@pytest.mark.parametrize("shift", [-200.0, -30.0, 30.0, float("inf"), float("-inf")])
def test_group_mass_with_an_inconsistent_lse_has_no_nan(shift):
    from comfyui_sparse_attention.kernels import group_kv_mass, group_queries
    q, k, v = _qkv(1, 2, 200)
    _, lse = attention_dense(q, k, v, return_lse=True)
    mass = group_kv_mass(q, k, lse + shift, group_queries(q, 64), backend="torch")
    assert not torch.isnan(mass).any()


# 7. configuration -------------------------------------------------------------------------------------
BAD_FIELDS = [
    ("cache_budget_mb", float("inf")), ("cpu_budget_mb", float("inf")), ("cpu_budget_mb", float("nan")),
    ("temporal_weight", True), ("temporal_weight", "1"), ("temporal_weight", float("nan")),
    ("anchor_steps", "every 0"), ("anchor_steps", [1.5, 2.7]), ("anchor_steps", {"evry": 5}),
    ("anchor_steps", {"steps": {"a": 1}}), ("anchor_steps", {"every": [1]}), ("anchor_steps", "9" * 5000),
    ("dense_layers", "\u00b2"), ("dense_layers", 2.5), ("anchor_steps", 1.5),
    ("dense_layers", "0-1000000000"), ("dense_layers", "99999999"), ("dense_layers", "0," * 20_000),
    ("densities", {"image_to_text": None}), ("densities", {"text_to_text": "x"}), ("densities", 5),
    ("density", "0.5"), ("mass", True), ("min_tokens", 1.5), ("warmup_layers", -1), ("sink_blocks", 2.0),
    ("method", ["mc_sparse"]), ("backend", {}), ("residual", "yes"), ("warmup_steps", [1]),
]


@pytest.mark.parametrize("field,value", BAD_FIELDS, ids=[f"{f}-{str(v)[:20]}" for f, v in BAD_FIELDS])
def test_bad_values_raise_a_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^cfg: {field.split('.')[0]}") as info:
        SparseConfig.from_dict({field: value}, source="cfg")
    assert len(str(info.value)) < 400  # no value is echoed whole


def test_a_huge_value_is_not_echoed_whole():
    big = "x" * 50_000_000
    for field in ("anchor_steps", "dense_layers", "method", "warmup_steps", "cache_budget_mb", "density"):
        with pytest.raises(ValueError) as info:
            SparseConfig.from_dict({field: big}, source="cfg")
        assert field in str(info.value) and len(str(info.value)) < 400, field


@pytest.mark.parametrize("text,match", [
    ("sparse:\n  anchor_steps: 10:26\n", "anchor_steps"),      # YAML 1.1 reads 626
    ("sparse:\n  density: 0.2\n  density: 0.3\n", "density"),  # duplicate key
    ("sparse: 5\n", "sparse"),
    ("5\n", "mapping"),
    ("- method: dense\n", "mapping"),
    ("sparse:\n  - method: dense\n", "sparse"),
    ("sparse:\n  cache_budget_mb: .inf\n", "cache_budget_mb"),
    ("sparse:\n  block_k: 128.0\n", "block_k"),
    ("sparse:\n  temporal_weight: true\n", "temporal_weight"),
    ("sparse:\n  dense_layers: 017\n  anchor_steps: 0x1f\n", "anchor_steps"),
    ("sparse:\n  residual: yes\n", "residual"),
    ("a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\nc: [*b, *b, *b, *b, *b]\n",
     "alias"),
])
def test_yaml_presets_are_read_strictly(tmp_path, text, match):
    preset = tmp_path / "bad_preset.yaml"
    preset.write_text(text)
    with pytest.raises(ValueError, match=match) as info:
        SparseConfig.from_yaml(preset)
    assert "bad_preset.yaml" in str(info.value)


def test_yaml_reads_decimal_numbers_and_plain_booleans(tmp_path):
    preset = tmp_path / "ok.yaml"
    preset.write_text("sparse:\n  dense_layers: 017\n  residual: false\n  min_tokens: 1e3\n".replace("1e3", "1000"))
    cfg = SparseConfig.from_yaml(preset)
    assert cfg.dense_layers == (17,) and cfg.residual is False and cfg.min_tokens == 1000


def test_non_utf8_and_huge_files_name_the_file(tmp_path):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("sparse:\n  method: d\xe9nse\n".encode("latin-1"))
    with pytest.raises(ValueError, match="latin1.yaml"):
        SparseConfig.from_yaml(bad)
    huge = tmp_path / "huge.yaml"
    huge.write_text("sparse:\n  method: dense\n" + "# padding\n" * 300_000)
    with pytest.raises(ValueError, match="huge.yaml"):
        SparseConfig.from_yaml(huge)


# 8. numerics -----------------------------------------------------------------------------------------------
def test_one_inf_in_v_stays_in_its_column_at_fp8_reuse():
    q, k, v = _qkv(1, 2, 256, seed=1)
    v[0, 0, 17, 5] = float("inf")
    eng = SparseEngine(SparseConfig(method="mc_sparse", density=0.25, residual_precision="fp8", **SMALL))
    eng.begin_run()
    lay = TokenLayout(grid=(1, 16, 16))
    eng.attend(q, k, v, CallContext(layer=0, step=0, layout=lay))
    out = eng.attend(q, k, v, CallContext(layer=0, step=1, layout=lay))
    eng.end_run()
    dense = SDPA(q, k, v)
    bad = ~torch.isfinite(out)
    assert bad.any(dim=(0, 1, 2))[5]  # the column the dense output loses too ...
    assert not bad[..., torch.arange(32) != 5].any()  # ... and no other column
    assert torch.isfinite(out[0, 1]).all() and rel_l2(out[0, 1], dense[0, 1]) < 0.2


def test_fp8_residual_keeps_small_rows_on_fp16_models():
    rows = torch.logspace(-6, -2, 64).view(1, 1, -1, 1)  # row sizes down to fp16's subnormal range
    diff = (torch.randn(1, 2, 64, 32, generator=torch.Generator().manual_seed(0)) * rows).half()
    r = Residual.encode(diff, "fp8")
    out = torch.zeros(1, 2, 64, 32, dtype=torch.float16)
    r.add_to(out)
    ref = diff.float()
    err = (out.float() - ref).norm(dim=-1) / ref.norm(dim=-1)
    big = ref.abs().amax(-1) >= 3e-6  # ~50 fp16 subnormal steps: the fp8 rounding (<= 1/16) dominates
    assert float(err[big].max()) < 0.1  # fp16 per-row scales went subnormal: rows under ~3e-4 lost R


def test_engine_encode_keeps_finite_rows_exact_with_inf_elsewhere():
    diff = torch.randn(1, 1, 4, 8)
    diff[0, 0, 1, 3] = float("inf")
    r = Residual.encode(diff, "fp8")
    dec = r.decode(torch.float32)
    assert torch.isfinite(dec[0, 0, [0, 2, 3]]).all() and torch.isfinite(dec[0, 0, 1, [0, 1, 2, 4, 5, 6, 7]]).all()
    assert not torch.isfinite(dec[0, 0, 1, 3])


def test_kernel_residual_encoding_confines_an_inf_to_its_element():
    from comfyui_sparse_attention.kernels._residual import encode_residual
    diff = torch.randn(1, 1, 4, 8)
    diff[0, 0, 1, 3] = float("inf")
    data, scale = encode_residual(diff, "fp8", torch.float32)
    dec = data.float() * scale
    assert torch.isfinite(dec[0, 0, 1, [0, 1, 2, 4, 5, 6, 7]]).all()


def test_block_topk_at_a_ragged_length_does_not_favour_the_short_last_block():
    errs, share = {}, {}
    for n in (512, 513):
        q, k, v = _qkv(1, 4, n, 64, seed=0)
        eng = SparseEngine(SparseConfig(method="block_topk", density=0.25, residual=False, **SMALL))
        eng.begin_run()
        eng.attend(q, k, v, CallContext(layer=0, step=0, layout=TokenLayout()))
        sel = eng.cache.peek(CallContext(layer=0, step=0).key(n)).selection
        errs[n] = rel_l2(sel.run(q, k, v, backend="torch"), SDPA(q, k, v))
        share[n] = float((sel.kv_indices == (n - 1) // 64).any(-1).float().mean())  # query blocks taking the last
        eng.end_run()
    assert share[513] < 0.2, share  # a 1-token last block won the pooled top-k for 44 % of query blocks
    assert errs[513] < 1.1 * errs[512], errs


def test_meta_tensors_run_dense_without_reading_values():
    q, k, v = (torch.empty(1, 2, 256, 32, device="meta") for _ in range(3))
    for method in ("mc_sparse", "block_topk", "static"):
        eng = SparseEngine(SparseConfig(method=method, **SMALL))
        eng.begin_run()
        out = eng.attend(q, k, v, CallContext(layer=0, step=0, layout=TokenLayout(grid=(1, 16, 16))))
        assert out.device.type == "meta" and out.shape == q.shape
        eng.end_run()


# the engine under threads (one sampler per thread on one engine: calls are serialised, never corrupted) -----
def test_one_engine_called_from_threads_stays_consistent():
    lay = TokenLayout(grid=(1, 16, 16))

    def calls(chunk):
        for step in range(4):
            q, k, v = _qkv(1, 2, 256, seed=10 * chunk + step)
            yield CallContext(layer=0, step=step, chunk=(chunk,), layout=lay), q, k, v

    def run(threaded):
        eng = SparseEngine(SparseConfig(method="mc_sparse", density=0.25, **SMALL))
        eng.begin_run()
        outs, errors = {}, []

        def worker(chunk):
            try:
                for ctx, q, k, v in calls(chunk):
                    outs[chunk, ctx.step] = eng.attend(q, k, v, ctx)
            except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                errors.append(exc)
        if threaded:
            threads = [threading.Thread(target=worker, args=(c,)) for c in (0, 1)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        else:
            worker(0)
            worker(1)
        return outs, errors, eng.end_run().totals()
    alone, _, _ = run(False)
    together, errors, t = run(True)
    assert not errors and t["anchors"] == 2 and t["reuses"] == 6
    assert all(torch.equal(together[key], alone[key]) for key in alone)
