"""Segmented token layouts (engine/context.py): text, audio, video/image grids and reference tokens with a density
per modality pair; selections that respect segment boundaries; calls whose token count does not fit their layout.
CPU only; no ComfyUI needed."""

import dataclasses
import logging

import pytest
import torch

from comfyui_sparse_attention.engine import CallContext, SparseConfig, SparseEngine, TokenLayout
from comfyui_sparse_attention.engine.block_geometry import token_map
from comfyui_sparse_attention.engine.context import Segment
from comfyui_sparse_attention.engine.policy_block_topk import build_block_topk
from comfyui_sparse_attention.engine.policy_mc_sparse import build_mc_sparse
from comfyui_sparse_attention.engine.policy_static import build_static
from comfyui_sparse_attention.kernels import attention_dense
from comfyui_sparse_attention.nodes.families import BY_NAME, UNKNOWN, family_of
from comfyui_sparse_attention.nodes.forward import Forward
from comfyui_sparse_attention.nodes.patch import SparseAttentionPatch
from comfyui_sparse_attention.nodes.report import render_report

# text | audio (2 channels x 64 frames) | video 4 x 16 x 16: every segment a whole number of 64-token blocks
AV = TokenLayout.of(Segment("text", 64), Segment("audio", 64, label="left"), Segment("audio", 64, label="right"),
                    Segment("video", 1024, (4, 16, 16)))
N_AV = 64 + 128 + 1024


def qkv(n, h=2, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, h, n, d, generator=g) for _ in range(3))


# --- the layout -------------------------------------------------------------------------------------------

def test_text_grid_construction_reads_back_as_segments():
    lay = TokenLayout(text_len=5, grid=(1, 4, 4))
    assert [s.kind for s in lay.segments] == ["text", "image"]
    assert (lay.text_len, lay.grid, lay.text_first, lay.extra_len) == (5, (1, 4, 4), True, 0)
    assert lay.image_span(21) == (5, 21) and lay.describe(21) == "text 5 | image 4x4 = 21"
    trailing = TokenLayout(text_len=3, text_first=False, grid=(2, 2, 2), extra_len=4)
    assert [s.kind for s in trailing.segments] == ["image", "ref", "text"] and not trailing.text_first
    assert trailing.image_span(15) == (0, 8)
    assert TokenLayout().misfit(100) is None and TokenLayout().image_span(100) == (0, 100)
    closed = TokenLayout(text_len=5, grid=(1, 4, 4)).closed(21)
    assert [s.length for s in closed.segments] == [5, 16] and closed.misfit(21) is None


def test_misfits_are_explained_and_bad_segments_rejected():
    assert "needs at least" in TokenLayout(text_len=30, grid=(1, 4, 4)).misfit(20)
    assert "grid holds 16" in TokenLayout(text_len=2, grid=(1, 4, 4)).misfit(20)
    assert "has 1216" in AV.misfit(1200)
    with pytest.raises(ValueError, match="layout: does not fit"):
        AV.spans(1200)
    with pytest.raises(ValueError, match="segment kind"):
        Segment("speech", 3)
    with pytest.raises(ValueError, match="grid"):
        Segment("video", 10, (2, 2, 2))
    with pytest.raises(ValueError, match="at most one"):
        TokenLayout.of(Segment("text"), Segment("video"))


def test_token_map_places_each_segment_in_its_own_grid():
    tm = token_map(N_AV, AV, "cpu")
    assert tm.seg.tolist() == [0] * 64 + [1] * 64 + [2] * 64 + [3] * 1024
    v0 = 64 + 128
    assert tm.coords[v0 + 256 + 17].tolist() == [1.0, 1.0, 1.0]   # frame 1, row 1, col 1
    assert tm.coords[64 + 5].tolist() == [0.0, 0.0, 5.0]          # audio: 1-D
    assert tm.axes.tolist() == [[True, False, False]] * 3 + [[True, True, True]]


def test_densities_keep_old_keys_and_add_modality_pairs():
    cfg = SparseConfig.from_dict({"densities": {"image_to_text": 0.5, "image_to_audio": 0.25, "audio_to_audio": 0.5}})
    assert cfg.densities.pair("image", "text", 0.15) == 0.5
    assert cfg.densities.pair("image", "image", 0.15) == 0.15   # None: the global density
    assert cfg.densities.pair("image", "audio", 0.15) == 0.25 and cfg.densities.pair("ref", "image", 0.15) == 1.0
    with pytest.raises(ValueError, match="densities.audio_to_image"):
        SparseConfig.from_dict({"densities": {"audio_to_image": 0}})
    with pytest.raises(ValueError, match="unknown key"):
        SparseConfig.from_dict({"densities": {"video_to_speech": 0.5}})


# --- selections respect segment boundaries ----------------------------------------------------------------

def test_mc_sparse_groups_stay_in_their_segment_and_keep_each_pairs_density():
    cfg = SparseConfig(method="mc_sparse", density=0.15, group_size=64, backend="torch",
                       densities={"audio_to_audio": 0.5, "audio_to_image": 0.25})
    q, k, v = qkv(N_AV, seed=1)
    _, lse = attention_dense(q, k, v, return_lse=True)
    sel = build_mc_sparse(q, k, lse, AV, cfg, backend="torch")
    assert sel.dense_rows.tolist() == list(range(64))          # text rows dense
    seg = token_map(N_AV, AV, "cpu").seg
    groups, toks, cnt = sel.q_groups[0, 0], sel.kv_tokens()[0, 0], sel.kv_counts[0, 0]
    for g in range(groups.shape[0]):
        rows = groups[g][groups[g] >= 0].long()
        owner = set(seg[rows].tolist())
        assert len(owner) == 1                                  # a group never mixes segments
        kept = seg[toks[g, :cnt[g]].long()]
        per = [int((kept == s).sum()) for s in range(4)]
        assert per[0] == 64                                     # every text key
        if owner == {3}:                                        # video: 0.15 of the video, 0.5 of each audio channel
            assert per[1] == per[2] == 32 and abs(per[3] - 154) <= 2
        else:                                                   # audio: 0.5 of audio, 0.25 of the video
            assert per[1] == per[2] == 32 and abs(per[3] - 256) <= 3
    out = sel.run(q, k, v, backend="torch")
    assert torch.allclose(out[:, :, :64], attention_dense(q, k, v)[:, :, :64], atol=1e-5)


@pytest.mark.parametrize("grouping", ["pca", "cuboid"])
def test_mc_sparse_selections_cover_every_row(grouping):
    """build_mc_sparse marks its selections covers_all (a reuse call then skips the kernel's fill of rows in no
    group: engine/selection.py): every row must be in exactly one query group or among the dense rows, whatever
    the segments and whichever grouping."""
    cfg = SparseConfig(method="mc_sparse", density=0.15, group_size=64, backend="torch", grouping=grouping,
                       densities={"audio_to_audio": 1.0})  # the audio rows: a segment kept whole, so dense
    q, k, v = qkv(N_AV + 5, seed=4)  # 5 trailing reference tokens: a segment that is not a whole group
    _, lse = attention_dense(q, k, v, return_lse=True)
    # and an empty audio segment in the middle; then one video segment with nothing sparse (every row dense)
    layout = TokenLayout.of(*AV.segments[:2], Segment("audio", 0, label="none"), *AV.segments[2:], Segment("ref", 5))
    for layout, density in ((layout, 0.15), (TokenLayout(grid=(1, 1, N_AV + 5)), 1.0)):
        sel = build_mc_sparse(q, k, lse, layout, dataclasses.replace(cfg, density=density), backend="torch")
        assert sel.covers_all and (density < 1.0) == (sel.q_groups.shape[2] > 0)
        for h in range(q.shape[1]):
            grouped = sel.q_groups[0, h][sel.q_groups[0, h] >= 0].long()
            rows = torch.cat([grouped, sel.dense_rows]) if sel.dense_rows is not None else grouped
            assert sorted(rows.tolist()) == list(range(N_AV + 5))


def test_block_policies_budget_every_key_segment():
    cfg = SparseConfig(method="block_topk", density=0.25, block_q=64, block_k=64, backend="torch", sink_blocks=0)
    q, k, _ = qkv(N_AV, seed=2)
    for sel in (build_block_topk(q, k, AV, cfg), build_static(1, 2, N_AV, AV, cfg, "cpu"),
                build_block_topk(q, k, AV, cfg.replace(method="hybrid"), hybrid=True)):
        idx, cnt = sel.kv_indices[0, 0], sel.kv_counts[0, 0]
        owner = torch.tensor([0, 1, 2] + [3] * 16)               # key block -> segment
        for row in range(idx.shape[0]):
            kept = owner[idx[row, :cnt[row]].long()]
            per = [int((kept == s).sum()) for s in range(4)]
            if row == 0:
                assert per == [1, 1, 1, 16]                      # text row: dense
            elif row in (1, 2):
                assert per == [1, 1, 1, 16]                      # audio rows: dense by default
            else:
                assert per == [1, 1, 1, 4]                       # video: text, half of each audio channel, 0.25
    mass = build_block_topk(q, k, AV, cfg.replace(mass=0.5))
    assert (mass.kv_counts[0, 0, :3] == 19).all() and (mass.kv_counts[0, 0, 3:] < 19).all()


def test_static_window_across_segments_follows_time():
    cfg = SparseConfig(method="static", density=0.25, block_q=64, block_k=64, sink_blocks=0,
                       densities={"image_to_audio": 0.5})
    lay = TokenLayout.of(Segment("audio", 256), Segment("video", 1024, (4, 16, 16)))
    sel = build_static(1, 1, 1280, lay, cfg, "cpu")
    idx, cnt = sel.kv_indices[0, 0], sel.kv_counts[0, 0]
    # frame 0 (query blocks 4-7) keeps the first two audio blocks, frame 3 (16-19) the last two
    assert [i for i in idx[4, :cnt[4]].tolist() if i < 4] == [0, 1]
    assert [i for i in idx[19, :cnt[19]].tolist() if i < 4] == [2, 3]


def test_engine_refuses_a_layout_that_does_not_fit_and_text_only_calls():
    eng = SparseEngine(SparseConfig(min_tokens=0))
    ctx = CallContext(layer=0, step=0, layout=AV)
    assert "does not match the layout" in eng.skip_reason(ctx, 1000, 1000, 64)
    assert eng.skip_reason(ctx, N_AV, N_AV, 64) is None
    text = CallContext(layer=0, step=0, layout=TokenLayout.of(Segment("text", 50)))
    assert "text or reference tokens only" in eng.skip_reason(text, 50, 50, 64)


# --- numbering and the patch --------------------------------------------------------------------------------

class _Model:
    def __init__(self, module, **attrs):
        self.__class__ = type("M", (), {"__module__": module})
        self.__dict__.update(attrs)


def call(n, width=64, heads=2, nk=None):
    """Override arguments of a (B, N, H*D) call: q of n tokens, k of nk."""
    q = torch.zeros(1, n, width)
    k = torch.zeros(1, n if nk is None else nk, width)
    return (q, k, k, heads), {}


def test_refiner_and_repeated_block_calls_are_numbered_after_the_main_blocks():
    lumina = BY_NAME["lumina"].bind(_Model("comfy.ldm.lumina.model", patch_size=2, layers=[0] * 4))
    fwd = Forward(lumina, (1, 16, 12, 16), {}, lumina.layer_offsets(_Model("x", layers=[0] * 4)))
    to = {}
    layers = [fwd.next_layer(to, *call(7)), fwd.next_layer(to, *call(48))]  # caption refiner, noise refiner
    for i in range(4):
        to["block_index"], to["block_type"] = i, "double"
        layers.append(fwd.next_layer(to, *call(55)))
    assert layers == [4, 5, 0, 1, 2, 3]
    assert fwd.context(4, 7, to).layout.describe(7).startswith("text 7")
    assert fwd.context(5, 48, to).layout.describe(48) == "image 6x8 = 48"
    assert fwd.context(0, 55, to).layout.describe(55) == "text 7 | image 6x8 = 55"
    wan = BY_NAME["wan"].bind(_Model("comfy.ldm.wan.model", blocks=[0] * 2))
    fwd = Forward(wan, (1, 16, 3, 12, 16), {}, wan.layer_offsets(_Model("x", blocks=[0] * 2)))
    to = {"block_index": 0, "block_type": "double", "grid_sizes": (3, 6, 8)}
    assert [fwd.next_layer(to, *call(144)), fwd.next_layer(to, *call(144, nk=12)), fwd.next_layer(to, *call(144))] \
        == [0, None, 2]  # self, cross, a VACE pass in the same block


def test_ltx2_streams_when_video_and_audio_counts_are_equal():
    dm = _Model("comfy.ldm.lightricks.av_model", transformer_blocks=[
        _Model("x", attn1=_Model("x", heads=2, dim_head=64), audio_attn1=_Model("x", heads=2, dim_head=32))] * 2)
    fam = family_of(dm)
    assert fam.name == "ltx2" and fam.facts["video_width"] == 128 and fam.facts["audio_width"] == 64
    conds = {"latent_shapes": [(1, 128, 3, 6, 8), (1, 8, 144, 16)]}   # 144 video tokens, 144 audio frames
    fwd = Forward(fam, (1, 1, 999), {}, fam.layer_offsets(dm), conds=conds)
    to = {}
    seq = []
    for _ in range(2):  # per block: v-self, v-text, a-self, a-text, a2v (q video, k audio), v2a
        seq += [fwd.next_layer(to, *call(144, 128)), fwd.next_layer(to, *call(144, 128, nk=1024)),
                fwd.next_layer(to, *call(144, 64)), fwd.next_layer(to, *call(144, 64, nk=1024)),
                fwd.next_layer(to, *call(144, 64)), fwd.next_layer(to, *call(144, 64))]
    assert seq == [0, None, 2, None, None, None, 1, None, 3, None, None, None]
    assert fwd.context(0, 144, to).layout.describe(144) == "video 3x6x8 = 144"
    assert fwd.context(2, 144, to).layout.describe(144) == "audio 144 = 144"
    stg = Forward(fam, (1, 1, 999), {}, fam.layer_offsets(dm), conds=conds)
    to = {"stg_self_attn_blocks": [0]}  # block 0's video and audio self-attention do not run: block 1's are next
    assert [stg.next_layer(to, *call(144, 128)), stg.next_layer(to, *call(144, 128, nk=1024)),
            stg.next_layer(to, *call(144, 64))] == [1, None, 3]


def _run_patch(patch, x_shape, calls, conds=None):
    """Drive the patch like ComfyUI: one APPLY_MODEL forward whose attention calls go through the override."""
    dense = torch.nn.functional.scaled_dot_product_attention
    outs = []

    def func(q, k, v, heads, skip_reshape=False, skip_output_reshape=False, **kw):
        return dense(q, k, v) if skip_reshape else None

    def executor(x, t, c_concat, c_crossattn, control, to, **kw):
        for i, (q, k, v) in enumerate(calls):
            to.update(block_index=i, block_type="double")  # a block-indexed model's main blocks
            outs.append(patch(func, q, k, v, q.shape[1], skip_reshape=True, skip_output_reshape=True,
                              transformer_options=to))
        return x

    def sampler(*args, **kwargs):  # one sampling run (OUTER_SAMPLE) holding one forward (APPLY_MODEL)
        patch.apply_model(executor, torch.zeros(x_shape), torch.zeros(1), None, None, None, {}, **(conds or {}))

    patch.outer_sample(sampler)
    return outs


def test_a_call_that_does_not_fit_its_layout_runs_dense_and_is_reported(caplog):
    flux = BY_NAME["flux"].bind(_Model("comfy.ldm.flux.model", patch_size=2))
    patch = SparseAttentionPatch(SparseConfig(min_tokens=0, group_size=64, backend="torch"), family=flux)
    good, bad = qkv(7 + 16, h=2, d=32), qkv(10, h=2, d=32)    # text 7 | 4x4 image; 10 < 16 image tokens
    outs = _run_patch(patch, (1, 16, 8, 8), [good, bad])
    assert torch.allclose(outs[1], torch.nn.functional.scaled_dot_product_attention(*bad))
    text, _ = render_report(patch, -1)
    assert "a token count that does not match the layout (10 tokens" in text
    assert "main: text 7 | image 4x4 = 23 (1 calls)" in text
    with caplog.at_level(logging.WARNING):
        unknown = family_of(_Model("comfy.ldm.newmodel.model"))
    assert unknown == UNKNOWN and any("comfy.ldm.newmodel.model.M" in r.message for r in caplog.records)
    patch = SparseAttentionPatch(SparseConfig(min_tokens=0, group_size=64, backend="torch"), family=unknown)
    _run_patch(patch, (1, 16, 8, 8), [good])
    text, _ = render_report(patch, -1)
    assert "model family unknown (comfy.ldm.newmodel.model.M): the pack assumes" in text


def test_a_run_with_every_call_below_min_tokens_says_nothing_ran_sparse():
    """An image at a size under min_tokens (Qwen-Image at 1328², Hunyuan3D's latent set) never reaches the engine:
    the report says so in its second line, not "0 calls" and steps "0-0"."""
    flux = BY_NAME["flux"].bind(_Model("comfy.ldm.flux.model", patch_size=2))
    patch = SparseAttentionPatch(SparseConfig(group_size=64, backend="torch"), family=flux)  # min_tokens 8192
    _run_patch(patch, (1, 16, 8, 8), [qkv(7 + 16, h=2, d=32)] * 2)
    text, _ = render_report(patch, -1)
    line = text.splitlines()[1]
    assert line.startswith("NOTHING RAN SPARSE") and "sequences shorter than min_tokens: 2" in line
    assert "min_tokens (8192)" in line
    assert "no call of this sampler reached the engine" in text and "ran steps" not in text
    sparse = SparseAttentionPatch(SparseConfig(min_tokens=0, group_size=64, backend="torch"), family=flux)
    _run_patch(sparse, (1, 16, 8, 8), [qkv(7 + 16, h=2, d=32)])
    assert "NOTHING RAN SPARSE" not in render_report(sparse, -1)[0]


def test_forward_keeps_minimax_segments_from_the_conditioning():
    class Packed:  # the segment table MiniMax H3 puts in its conditioning
        segments = [(0, 7, "text"), (7, 27, "audio"), (27, 171, "video")]
        seq_len = 171
    fam = family_of(_Model("comfy.ldm.minimax.model", blocks=[0] * 2))
    conds = {"minimax_payload": {"layout": Packed()}, "latent_shapes": [(1, 24, 3, 12, 16), (1, 32, 2, 10)]}
    fwd = Forward(fam, (1, 1, 9999), {}, fam.layer_offsets(_Model("x", blocks=[0] * 2)), conds=conds)
    assert fwd.next_layer({}, *call(171)) == 0 and fwd.next_layer({}, *call(7)) == 2  # in-forward text refiner
    assert fwd.context(0, 171, {}).layout.describe(171) == \
        "text 7 | audio 10 (left channel) | audio 10 (right channel) | video 3x6x8 = 171"


def test_settings_for_layers_the_run_did_not_have_are_reported():
    """dense_layers or layer_densities written for another model (or counted from 1) do nothing: the report says
    which, with the layers the engine saw; an engine error's message stands beside its count."""
    flux = BY_NAME["flux"].bind(_Model("comfy.ldm.flux.model", patch_size=2))
    cfg = SparseConfig(min_tokens=0, group_size=64, backend="torch", dense_layers="1, 7", layer_densities="{9: 0.5}")
    patch = SparseAttentionPatch(cfg, family=flux)
    _run_patch(patch, (1, 16, 8, 8), [qkv(7 + 16, h=2, d=32)] * 2)
    text, _ = render_report(patch, -1)
    assert "SETTINGS FOR LAYERS THIS RUN DID NOT HAVE (they did nothing): dense_layers 7; layer_densities 9" in text
    assert "were 0-1" in text
    fine = SparseAttentionPatch(SparseConfig(min_tokens=0, group_size=64, backend="torch", dense_layers="1"),
                                family=flux)
    _run_patch(fine, (1, 16, 8, 8), [qkv(7 + 16, h=2, d=32)] * 2)
    assert "SETTINGS FOR LAYERS" not in render_report(fine, -1)[0]
    # a head count the per-head densities do not fit: the engine refuses, the layer runs dense, the reason is shown
    heads = SparseAttentionPatch(SparseConfig(min_tokens=0, group_size=64, backend="torch",
                                              layer_densities="{0: [0.5, 1, 1.5]}"), family=flux)
    _run_patch(heads, (1, 16, 8, 8), [qkv(7 + 16, h=2, d=32)])
    text, _ = render_report(heads, -1)
    assert "an engine error (ValueError): 1" in text, text
    assert "  an engine error (ValueError): " in text and "head" in text.split("  an engine error (ValueError): ")[1]
