"""Extra passes of the same conds and conds ComfyUI cannot batch get their own cache entries.

A guidance pass run from a post-CFG function (LTXVSpatioTemporalGuidance, LTXVModalityGuidance,
SkipLayerGuidanceDiT) evaluates the cond through another forward, and two prompts of a ConditioningCombine that
ComfyUI cannot batch are both "cond": each must anchor at the anchor steps (exact there) and reuse its own
selection and residual, while split cond/uncond calls still read the rows of the batched entry (nodes/forward.py,
``chunk_of``; engine/cache.py, ``_covering``). CPU unit tests, then one run through ComfyUI's own sampling."""

import pytest
import torch
from comfy_subprocess import run_in_comfyui
from conftest import ROOT, comfyui_path

from comfyui_sparse_attention.engine import CallContext, SparseConfig, SparseEngine
from comfyui_sparse_attention.engine.synthetic import SyntheticVideoAttention
from comfyui_sparse_attention.nodes.forward import chunk_of

BASE = dict(density=0.15, warmup_steps=1, anchor_steps="", min_tokens=0, backend="torch", block_q=64, block_k=64,
            group_size=64)
U, C = "uncond-uuid", "cond-uuid"


class _Window:
    def __init__(self, index_list):
        self.index_list = index_list


def _opts(**extra):
    return {"cond_or_uncond": [1, 0], "uuids": [U, C], **extra}


# the chunk identity ------------------------------------------------------------------------------------
def test_chunk_names_each_cond_and_is_stable():
    assert chunk_of(_opts()) == ((1, U), (0, C))
    assert chunk_of(_opts()) == chunk_of(_opts())  # the same options (a run's steps, heun's evaluations)
    assert chunk_of({"cond_or_uncond": [1, 0]}) == (1, 0)  # no uuids: the cond/uncond order as before
    assert chunk_of({}) == ()
    # two prompts ComfyUI could not batch: both cond, told apart by their uuids
    assert chunk_of({"cond_or_uncond": [0], "uuids": ["a"]}) != chunk_of({"cond_or_uncond": [0], "uuids": ["b"]})


def test_options_that_change_the_forward_tag_the_chunk():
    plain = chunk_of(_opts())
    stg = chunk_of(_opts(stg_self_attn_blocks=frozenset({29, 3})))
    mod = chunk_of(_opts(a2v_cross_attn=False, v2a_cross_attn=False))
    slg = chunk_of(_opts(patches_replace={"dit": {("double_block", 7): object()}}))
    assert len({plain, stg, mod, slg}) == 4
    assert stg[:2] == mod[:2] == slg[:2] == plain  # the conds first, the pass tag after them
    assert stg == chunk_of(_opts(stg_self_attn_blocks={3, 29}))  # a set: compared sorted
    # options at their plain values leave the key as it was
    assert chunk_of(_opts(stg_self_attn_blocks=(), a2v_cross_attn=True, v2a_cross_attn=True,
                          patches_replace={})) == plain
    # a context window comes after the conds, before the pass tag
    win = chunk_of(_opts(context_window=_Window([4, 5, 6, 7])))
    assert win == plain + (("window", 4, 7),)
    assert chunk_of(_opts(context_window=_Window([8, 9]))) != win


# the cache: covering and separate entries ----------------------------------------------------------------
@pytest.fixture(scope="module")
def problem():
    return SyntheticVideoAttention(frames=4, height=16, width=16, text=32, heads=2, head_dim=64, steps=8, seed=3)


def _ctx(problem, step, chunk):
    return CallContext(layer=0, step=step, chunk=chunk, layout=problem.layout)


def test_split_calls_with_uuids_read_the_batched_entry(problem):
    """cond/uncond batched at one step, split at the next (memory ran low): the split calls reuse the batched
    entry's rows, as with the plain cond/uncond chunks (tests/test_engine.py)."""
    eng = SparseEngine(SparseConfig(method="block_topk", **BASE))
    eng.begin_run()
    q, k, v = (torch.cat([t, t.flip(1)]) for t in problem.qkv(1))
    both = chunk_of(_opts())
    eng.attend(q, k, v, _ctx(problem, 1, both))
    batched = eng.attend(q, k, v, _ctx(problem, 2, both))
    first = eng.attend(q[:1], k[:1], v[:1], _ctx(problem, 2, chunk_of({"cond_or_uncond": [1], "uuids": [U]})))
    second = eng.attend(q[1:], k[1:], v[1:], _ctx(problem, 2, chunk_of({"cond_or_uncond": [0], "uuids": [C]})))
    assert torch.allclose(torch.cat([first, second]), batched, atol=1e-5)
    t = eng.end_run().totals()
    assert t["anchors"] == 1 and t["reuses"] == 3
    # a context window: the split call of the same window reads the batched entry's rows, another window not
    eng.begin_run()
    win = _Window([0, 1, 2])
    eng.attend(q, k, v, _ctx(problem, 1, chunk_of(_opts(context_window=win))))
    one = chunk_of({"cond_or_uncond": [0], "uuids": [C], "context_window": win})
    other = chunk_of({"cond_or_uncond": [0], "uuids": [C], "context_window": _Window([2, 3, 4])})
    assert eng.decide(_ctx(problem, 2, one), q.shape[2]) == "reuse"
    assert eng.decide(_ctx(problem, 2, other), q.shape[2]) == "anchor"
    eng.end_run()


@pytest.mark.parametrize("extra", [dict(stg_self_attn_blocks=frozenset({0})),
                                   dict(a2v_cross_attn=False, v2a_cross_attn=False),
                                   dict(patches_replace={"dit": {("double_block", 0): print}}),
                                   dict(uuids=["another-prompt"])], ids=["stg", "modality", "slg", "uncombined"])
def test_an_extra_pass_anchors_with_the_cond_pass_and_keeps_its_own_entry(problem, extra):
    """The cond pass anchors at step 1; the extra pass of the same step (the cond alone, with options that
    change the forward, or a second prompt) anchors too, is exact there, and reuses its own entry after."""
    eng = SparseEngine(SparseConfig(method="block_topk", **{**BASE, "anchor_steps": "1, 3"}))
    eng.begin_run()
    main = chunk_of(_opts())
    one = {"cond_or_uncond": [0], "uuids": [C]}
    extra_chunk = chunk_of({**one, **extra})
    assert extra_chunk != chunk_of(one)
    for step in (1, 2, 3):
        q, k, v = (torch.cat([t, t.flip(1)]) for t in problem.qkv(step))
        eng.attend(q, k, v, _ctx(problem, step, main))
        qe, ke, ve = (t[1:].flip(2).contiguous() for t in (q, k, v))  # another forward: other activations
        want = "anchor" if step in (1, 3) else "reuse"
        assert eng.decide(_ctx(problem, step, extra_chunk), qe.shape[2]) == want
        out = eng.attend(qe, ke, ve, _ctx(problem, step, extra_chunk))
        dense = torch.nn.functional.scaled_dot_product_attention(qe, ke, ve)
        err = float((out - dense).norm() / dense.norm())
        if want == "anchor":
            assert err < 1e-5
        else:
            assert err > 1e-4  # a sparse reuse (density 0.15): not dense
    keys = {key[2] for key in eng.cache.on_device}
    assert keys == {main, extra_chunk}
    t = eng.end_run().totals()
    assert t["anchors"] == 4 and t["reuses"] == 2


# through ComfyUI's sampling ------------------------------------------------------------------------------
@pytest.mark.comfyui
def test_skip_layer_guidance_and_uncombined_prompts_anchor_in_comfyui():
    """A tiny Wan in ComfyUI at density 0.3, anchors at steps 0 and 3 of 6: SkipLayerGuidanceDiT's cond pass
    (block 0 replaced) and the second prompt of a ConditioningCombine ComfyUI cannot batch (12 and 7 tokens)
    anchor at the anchor steps, where each call equals dense attention; between them they reuse (not dense)."""
    res = run_in_comfyui(comfyui_path(), f"""
        import sys, importlib, torch
        sys.path.insert(0, {str(ROOT / "tests")!r})
        import comfy_child as C
        C.load_pack()
        import nodes as N
        import comfyui_sparse_attention.nodes.patch as P
        import comfyui_sparse_attention.engine.engine as E
        from comfyui_sparse_attention.nodes.patch import install
        from comfyui_sparse_attention.engine import SparseConfig
        REC, CUR = [], {{}}
        orig_decide, orig_call = E.SparseEngine.decide, P.SparseAttentionPatch.__call__
        def decide(self, ctx, n):
            d = orig_decide(self, ctx, n)
            CUR["d"] = (ctx.layer, d)
            return d
        def call(self, func, *args, **kwargs):
            CUR["d"] = None
            out = orig_call(self, func, *args, **kwargs)
            if CUR["d"] is not None:
                to = kwargs.get("transformer_options") or {{}}
                fw = to.get("sparse_attention_forward")
                ref = func(*args, **kwargs)
                err = float((out.double() - ref.double()).norm() / ref.double().norm())
                extra = bool(to.get("patches_replace", {{}}).get("dit"))
                REC.append([str(to.get("uuids")), extra, fw.step, *CUR["d"], err])
            return out
        E.SparseEngine.decide, P.SparseAttentionPatch.__call__ = decide, call
        model, latent, pos, neg = C.build("wan")
        cfg = SparseConfig(method="block_topk", density=0.3, warmup_steps=0, anchor_steps="0, 3", min_tokens=0,
                           block_q=64, block_k=64, backend="torch")
        out = {{}}
        m, p = install(model, cfg)
        slg = importlib.import_module("comfy_extras.nodes_slg").SkipLayerGuidanceDiT
        o = slg.execute(m, 3.0, 0.0, 1.0, "0", "", 0)
        m2 = o.result[0] if hasattr(o, "result") else o[0]
        with torch.inference_mode():
            C.sample(m2, latent, pos, neg, steps=6, cfg=3.0)
        out["slg"] = list(REC)
        REC.clear()
        g = torch.Generator().manual_seed(99)
        pos_b = [[torch.randn(1, 7, 64, generator=g) * 3, {{}}]]
        comb = N.ConditioningCombine().combine(pos, pos_b)[0]
        m, p = install(model, cfg)
        with torch.inference_mode():
            C.sample(m, latent, comb, neg, steps=6, cfg=1.0)
        out["combine"] = list(REC)
        emit(out)
    """)
    anchors = {0, 3}
    # SkipLayerGuidanceDiT: per step, the batched cond/uncond pass (two layers) and the cond pass with block 0
    # replaced (one self-attention call; 0.3.75 numbers it by position, so it is layer 0 of its own pass)
    slg = [r for r in res["slg"] if r[1]]
    main = [r for r in res["slg"] if not r[1]]
    assert sorted(r[2] for r in slg) == list(range(6))  # one call per step
    assert len(main) == 12
    for calls in (slg, main):
        for uuids, _, step, layer, decision, err in calls:
            assert decision == ("anchor" if step in anchors else "reuse"), (step, layer, decision)
            if step in anchors:
                assert err < 1e-5, (step, layer, err)
    assert any(r[5] > 1e-4 for r in slg if r[2] not in anchors)  # sparse between the anchors
    # ConditioningCombine: two cond calls per step, one per prompt, each anchoring at the anchor steps
    prompts = sorted({r[0] for r in res["combine"]})
    assert len(prompts) == 2
    for prompt in prompts:
        calls = [r for r in res["combine"] if r[0] == prompt]
        assert len(calls) == 12
        for uuids, _, step, layer, decision, err in calls:
            assert decision == ("anchor" if step in anchors else "reuse"), (prompt, step, layer, decision)
            if step in anchors:
                assert err < 1e-5, (prompt, step, layer, err)
        assert any(r[5] > 1e-4 for r in calls if r[2] not in anchors)
