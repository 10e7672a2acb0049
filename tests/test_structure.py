"""The pack's structure: one policy registry, one family registry, widgets declared once, the call translation
and the per-forward facts (docs/architecture.md). CPU only; no ComfyUI needed."""

import dataclasses

import pytest
import torch

from comfyui_sparse_attention.engine import CallContext, SparseConfig, SparseEngine, TokenLayout
from comfyui_sparse_attention.engine import policy as policy_mod
from comfyui_sparse_attention.engine.presets import list_presets
from comfyui_sparse_attention.engine.selection import BlockSelection, block_pairs_fraction
from comfyui_sparse_attention.engine.widgets import WIDGETS, config_from_widgets
from comfyui_sparse_attention.nodes.call import translate
from comfyui_sparse_attention.nodes.families import BY_NAME, FAMILIES, UNKNOWN, family_of
from comfyui_sparse_attention.nodes.forward import Forward


def test_widget_defaults_are_the_balanced_presets_configuration():
    from comfyui_sparse_attention.engine.presets import load_preset

    cfg = config_from_widgets({})
    fields = {f for w in WIDGETS for f in w.fields}
    assert fields <= {f.name for f in dataclasses.fields(SparseConfig)}
    balanced = load_preset("balanced")
    for name in fields:
        assert getattr(cfg, name) == getattr(balanced, name), name
    # the measured speed setting, not the library's defaults (which differ in method, density and schedule)
    library = SparseConfig()
    for name in ("method", "density"):
        assert getattr(cfg, name) == getattr(balanced, name) != getattr(library, name), name
    assert cfg.anchor_steps.text() == balanced.anchor_steps.text() != library.anchor_steps.text()


def test_node_defaults_fall_back_to_the_engines_when_the_preset_is_broken(tmp_path, caplog):
    from comfyui_sparse_attention.engine.widgets import node_defaults

    assert node_defaults("nope", tmp_path) == SparseConfig()  # missing file
    (tmp_path / "bad.yaml").write_text("sparse:\n  density: 7\n")
    with caplog.at_level("WARNING"):
        assert node_defaults("bad", tmp_path) == SparseConfig()
    assert "bad.yaml" in caplog.text and "density" in caplog.text
    (tmp_path / "good.yaml").write_text("sparse:\n  method: block_topk\n  density: 0.2\n")
    assert (node_defaults("good", tmp_path).method, node_defaults("good", tmp_path).density) == ("block_topk", 0.2)
    names = [w.name for w in WIDGETS]  # permanent order: saved workflows store widget values by position
    assert names == ["method", "density", "block_size", "query_group_size", "warmup_steps", "warmup_layers",
                     "dense_layers", "anchor_steps", "residual_caching", "cache_offload", "min_tokens", "backend",
                     "layer_densities", "anchor_density_factors"]
    assert [w for w in WIDGETS if w.name == "method"][0].option_values()[-1] == "dense"


def test_widget_values_reach_the_configuration_and_errors_name_the_widget():
    cfg = config_from_widgets(dict(method="block_topk", block_size="64", query_group_size="64",
                                   dense_layers="0,2-3", anchor_steps="every 4", residual_caching=False))
    assert (cfg.method, cfg.block_q, cfg.block_k, cfg.group_size) == ("block_topk", 64, 64, 64)
    assert cfg.dense_layers == (0, 2, 3) and cfg.anchor_steps.every == 4 and cfg.residual is False
    with pytest.raises(ValueError, match="block_size"):
        config_from_widgets(dict(block_size="big"))
    with pytest.raises(ValueError, match="anchor_steps"):
        config_from_widgets(dict(anchor_steps="ten"))
    # the node's check takes every input, so ComfyUI checks none of their ranges: the widgets' own are checked here
    for name, value in (("density", 0.001), ("warmup_layers", 5000), ("min_tokens", 2e7), ("warmup_layers", -1)):
        with pytest.raises(ValueError, match=f"{name}: must lie in"):
            config_from_widgets({name: value})


class FullBlocks(policy_mod.Policy):
    """A policy written the way a new one would be: every KV block for every query block."""

    name = "full_blocks"

    def select(self, q, k, lse, layout, cfg, *, scale, backend):
        b, h, n, _ = q.shape
        nqb, nkb = -(-n // cfg.block_q), -(-n // cfg.block_k)
        idx = torch.arange(nkb, dtype=torch.int32).expand(b, h, nqb, nkb).contiguous()
        cnt = torch.full((b, h, nqb), nkb, dtype=torch.int32)
        return BlockSelection(idx, cnt, cfg.block_q, cfg.block_k,
                              block_pairs_fraction(idx, cnt, n, n, cfg.block_q, cfg.block_k))


def test_a_new_policy_is_one_registration(monkeypatch):
    registry = dict(policy_mod.policies())
    assert list(registry) == ["mc_sparse", "block_topk", "hybrid", "static"]
    assert policy_mod.method_names()[-1] == "dense"
    monkeypatch.setattr(policy_mod, "_POLICIES", {**registry, FullBlocks.name: FullBlocks()})
    cfg = SparseConfig(method="full_blocks", min_tokens=0, block_q=64, block_k=64, backend="torch")
    eng = SparseEngine(cfg)
    q, k, v = (torch.randn(1, 2, 200, 32, generator=torch.Generator().manual_seed(i)) for i in range(3))
    eng.begin_run()
    outs = [eng.attend(q, k, v, CallContext(layer=0, step=s)) for s in range(3)]
    t = eng.end_run().totals()
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert (t["anchors"], t["reuses"]) == (1, 2)
    assert all(torch.allclose(o, dense, atol=1e-5) for o in outs)
    with pytest.raises(ValueError, match="method"):
        SparseConfig(method="magic")


def test_policies_say_what_they_need():
    p = policy_mod.policies()
    assert p["mc_sparse"].needs_lse and not p["block_topk"].needs_lse
    assert p["static"].shape_only and not p["hybrid"].shape_only
    assert p["block_topk"].reselects(SparseConfig(select_every_step=True))
    assert not p["block_topk"].reselects(SparseConfig())
    assert policy_mod.policy_for("dense") is None


def test_both_selection_kinds_draw_their_report_picture():
    q, k, v = (torch.randn(1, 2, 300, 32, generator=torch.Generator().manual_seed(i)) for i in range(3))
    lay = TokenLayout(text_len=12, grid=(2, 12, 12))
    for method in ("block_topk", "mc_sparse"):
        cfg = SparseConfig(method=method, min_tokens=0, block_q=64, block_k=64, group_size=64, backend="torch")
        eng = SparseEngine(cfg)
        eng.begin_run()
        eng.attend(q, k, v, CallContext(layer=0, step=0, layout=lay))
        pic = eng.cache.peek(CallContext(layer=0, step=0, layout=lay).key(300)).selection.picture(300)
        eng.end_run()
        assert pic["kind"] == ("block" if method == "block_topk" else "token")
        assert pic["map"].min() >= 0 and pic["map"].max() <= 1 and pic["map"].sum() > 0


class _Model:
    def __init__(self, module, **attrs):
        self.__class__ = type("M", (), {"__module__": module})
        self.__dict__.update(attrs)


def test_family_registry_detects_numbers_and_links_presets():
    assert family_of(_Model("comfy.ldm.flux.model")).name == "flux"
    assert family_of(_Model("comfy.ldm.modules.diffusionmodules.mmdit")).name == "sd3"
    unknown = family_of(_Model("somewhere.else"))
    assert unknown == UNKNOWN and "somewhere.else" in unknown.describe() and "1-D" in unknown.describe()
    assert family_of(_Model("comfy.ldm.lightricks.av_model")).name == "ltx2"  # the longest module path wins
    assert family_of(_Model("comfy.ldm.lightricks.model")).name == "ltxv"
    presets = set(list_presets())
    for fam in FAMILIES:
        for dim in (1536, 3072, 5120):
            assert fam.preset_for(_Model("x", dim=dim)) in presets, fam.name
    wan = BY_NAME["wan"]
    assert wan.preset_for(_Model("x", dim=1536)) == "wan21_t2v_1.3b"
    assert wan.preset_for(_Model("x", dim=5120, model_type="i2v")) == "wan21_i2v_14b"
    assert BY_NAME["flux"].layer_offsets(_Model("x", double_blocks=[0] * 19, single_blocks=[0] * 38)) == \
        {"single": 19, "extra": 57}  # extra (refiner) calls are numbered after every main block
    assert BY_NAME["wan"].layer_offsets(_Model("x")) == {}
    assert len({f.name for f in FAMILIES}) == len(FAMILIES)
    assert len({m for f in FAMILIES for m in f.modules}) == sum(len(f.modules) for f in FAMILIES)


def test_forward_facts_are_computed_once_per_forward():
    sched = torch.tensor([1.0, 0.5, 0.0])
    to = {"sigmas": torch.tensor([0.5]), "sample_sigmas": sched, "cond_or_uncond": [1, 0]}
    fwd = Forward(BY_NAME["flux"], (2, 16, 8, 8), to, {"single": 2})
    assert (fwd.step, fwd.total, fwd.chunk) == (1, 2, (1, 0))
    to["sigmas"] = torch.tensor([1.0])  # read once: a later change of the dict does not move this forward
    ctx = fwd.context(fwd.next_layer({}), 5 + 16, to)
    assert (ctx.step, ctx.layer, ctx.chunk, ctx.layout.text_len, ctx.layout.grid) == (1, 0, (1, 0), 5, (1, 4, 4))
    assert fwd.layout(21, {}) is ctx.layout  # cached per token count
    assert fwd.next_layer({"block_index": 1, "block_type": "single"}) == 3
    assert fwd.next_layer({}) == 2  # position of the call in the forward


def test_call_translation():
    q = torch.randn(2, 10, 4 * 8)
    out = translate((q, q, q.view(2, 10, 4, 8), 4), {})
    assert out.q.shape == (2, 4, 10, 8) and out.v.shape == (2, 4, 10, 8)
    assert torch.equal(out.output(out.q), q)
    assert translate((q, q, q), {}) == "an unexpected call signature"
    assert translate((q, q, q, 4, torch.ones(10, 10)), {}) == "calls with an attention mask"
    assert translate((q, q, q, 5), {}) == "an unexpected call signature"
    bhnd = torch.randn(2, 4, 10, 8)
    call = translate((bhnd, bhnd, bhnd, 4), {"skip_reshape": True, "skip_output_reshape": True})
    assert call.q is bhnd and call.output(bhnd) is bhnd and call.kv_group == 1 and call.kv() == (bhnd, bhnd)


def test_grouped_query_calls_are_repeated_to_the_query_heads():
    """OmniGen2 / Boogu on 0.33.0 pass k/v with fewer heads and enable_gqa: query head i reads k/v head i // group,
    as torch's enable_gqa does, in both of ComfyUI's layouts; heads that do not divide still run dense."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    q, k, v = torch.randn(2, 6, 10, 8), torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8)
    want = sdpa(q, k, v, enable_gqa=True)
    call = translate((q, k, v, 6), {"skip_reshape": True, "enable_gqa": True})
    assert call.kv_group == 3 and call.k is k  # nothing copied until the pack takes the call
    ek, ev = call.kv()
    assert ek.shape == ev.shape == q.shape and torch.allclose(sdpa(call.q, ek, ev), want, atol=1e-6)
    assert torch.equal(call.kv(1)[0], ek[1]) and torch.equal(call.kv(1)[1], ev[1])  # one row, as recorded
    flat = [t.transpose(1, 2).reshape(2, 10, -1) for t in (q, k, v)]  # (B, N, H*D), k/v with 2 heads of 8
    call = translate((*flat, 6), {"enable_gqa": True})
    assert call.kv_group == 3 and torch.allclose(call.output(sdpa(call.q, *call.kv())),
                                                 want.transpose(1, 2).reshape(2, 10, 48), atol=1e-6)
    same = translate((q, q, q, 6), {"skip_reshape": True, "enable_gqa": True})  # HiDream O1: equal heads
    assert same.kv_group == 1 and same.k is q
    assert translate((q, k, v, 6), {"skip_reshape": True}) == "grouped-query attention"  # fewer heads, no flag
    assert translate((q, torch.randn(2, 4, 10, 8), torch.randn(2, 4, 10, 8), 6),
                     {"skip_reshape": True, "enable_gqa": True}) == "grouped-query attention"
    assert translate((flat[0], torch.randn(2, 10, 12), flat[2], 6), {"enable_gqa": True}) == \
        "an unexpected call signature"  # 12 is not a whole number of 8-wide heads


def test_block_indices_are_looked_for_in_the_classes_a_model_inherits_from(tmp_path, monkeypatch):
    """Chroma Radiance's module has no ``block_index``: it inherits Chroma's forward, whose module sets it."""
    import sys
    import types

    from comfyui_sparse_attention.nodes.families import _sets_block_index

    def module(name, text):
        path = tmp_path / f"{name}.py"
        path.write_text(text)
        mod = types.ModuleType(name)
        mod.__file__ = str(path)
        monkeypatch.setitem(sys.modules, name, mod)
        return name

    parent = type("Chroma", (torch.nn.Module,), {"__module__": module("fake_chroma", "to['block_index'] = i\n")})
    child = type("ChromaRadiance", (parent,), {"__module__": module("fake_radiance", "class ChromaRadiance: pass\n")})
    plain = type("WanModel", (torch.nn.Module,), {"__module__": module("fake_wan_0375", "no indices here\n")})
    assert _sets_block_index(child) is True and _sets_block_index(plain) is False
    gone = type("Gone", (), {"__module__": "not_a_loaded_module"})
    assert _sets_block_index(gone) is None


def test_lens_masks_change_nothing_without_padded_text():
    """Lens passes an additive key mask on every call, built from the conditioning's text mask: without one, or with
    one of all ones, it is all zeros and the pack takes the calls; a padded text makes it real (dense)."""
    from comfyui_sparse_attention.nodes.families import BY_NAME

    lens = BY_NAME["lens"]
    assert lens.mask_is_noop({}) and lens.mask_is_noop({"attention_mask": torch.ones(2, 7, dtype=torch.long)})
    assert not lens.mask_is_noop({"attention_mask": torch.tensor([[1, 1, 1, 1, 1, 0, 0]])})
    assert not lens.mask_is_noop({"attention_mask": torch.ones(1, 7, device="meta")})
    assert not BY_NAME["qwen_image"].mask_is_noop({})  # other families: a masked call runs dense
    mask = torch.zeros(1, 1, 1, 10)
    q = torch.randn(1, 2, 10, 8)
    assert translate((q, q, q, 2), {"skip_reshape": True, "mask": mask}) == "calls with an attention mask"
    assert translate((q, q, q, 2), {"skip_reshape": True, "mask": mask}, ignore_mask=True).q is q
    square = torch.zeros(1, 1, 10, 10)  # a patch's own mask (regional prompting): never ignored
    assert translate((q, q, q, 2), {"skip_reshape": True, "mask": square}, ignore_mask=True) == \
        "calls with an attention mask"
    flat = torch.randn(1, 10, 16)
    assert translate((flat, torch.randn(1, 10, 12), flat, 2), {}) == "an unexpected call signature"  # k of 12 wide
