"""What the model families of ComfyUI 0.33.0 send through the attention-override hook (needs COMFYUI_PATH).

Tiny random-weight models (tests/comfy_families.py) sample two euler steps with a recording override;
each test asserts the token layout of the self-attention calls that docs/families.md documents: the
number of tokens per call equals the sum of its documented segments, the layout flags, masks, and the
transformer_options keys (block_index, img_slice, grid_sizes, reference_image_num_tokens). These tests
describe the models, not the pack. They document ComfyUI 0.33.0: on an older tree they are skipped (the
same classes there lack block_index, grid_sizes and newer constructor fields), and so is a family that the
tree under test lacks.
"""

import math
import re

import pytest
from comfy_subprocess import run_in_comfyui
from conftest import ROOT, comfyui_path

pytestmark = pytest.mark.comfyui

# steps, cfg per family (Trellis2's 16^3 structure grid costs ~2 s per forward on CPU: one step, no CFG)
RUNS = {"trellis2": (1, 1.0)}
FAMILIES = ("chroma", "lumina2", "z_image", "hunyuan_video_1_5", "kandinsky5", "cogvideox", "qwen_image_edit",
            "hidream_e1", "wan22_ti2v_5b", "wan_fun_ref", "ltx2_av", "minimax_h3", "trellis2", "trellis2_shape")

BODY = """
import sys, traceback, torch
sys.path.insert(0, {tests!r})
import comfy_families as F
import comfyui_version
out = {{"version": comfyui_version.__version__}}
for name in {families!r}:
    reason = F.missing(name)
    if reason:
        out[name] = {{"missing": reason}}
        continue
    try:
        model, latent, pos, neg = F.build(name)
        steps, cfg = {runs!r}.get(name, (2, 3.0))
        result, log = F.record(model, latent, pos, neg, steps=steps, cfg=cfg)
        dm = model.model.diffusion_model
        ps = getattr(dm, "patch_size", None)
        parts = result.unbind() if getattr(result, "is_nested", False) else [result]
        out[name] = {{"forwards": F.forwards(log), "finite": all(bool(torch.isfinite(p).all()) for p in parts),
                     "cls": type(dm).__module__ + "." + type(dm).__name__,
                     "patch_size": list(ps) if isinstance(ps, (list, tuple)) else ps}}
    except Exception:
        out[name] = {{"error": traceback.format_exc()[-4000:]}}

# MiniMax H3 hands q/k/v over in AttentionTensorContainer: an override with a container_function gets the
# containers (and no func); one without gets the tensors already taken out
if not F.missing("minimax_h3"):
    import comfy.ldm.modules.attention as attn
    seen = []

    class ContainerOverride:
        def __call__(self, func, *args, **kwargs):
            seen.append(("plain", type(args[0]).__name__))
            return func(*args, **kwargs)

        def container_function(self, *args, **kwargs):
            seen.append(("container", type(args[0]).__name__))
            q, k, v = (c.take() for c in args[:3])
            return attn.attention_pytorch(q, k, v, *args[3:], **kwargs)

    model, latent, pos, neg = F.build("minimax_h3")
    m = model.clone()
    m.model_options.setdefault("transformer_options", {{}})["optimized_attention_override"] = ContainerOverride()
    res = F.sample(m, latent, pos, neg, steps=1, cfg=1.0)
    out["minimax_containers"] = {{"seen": sorted(set(map(tuple, seen))), "count": len(seen),
                                 "finite": all(bool(torch.isfinite(p).all()) for p in res.unbind())}}
emit(out)
"""


def tree_version(root) -> tuple[int, ...]:
    text = (root / "comfyui_version.py").read_text()
    return tuple(int(x) for x in re.search(r'__version__ = "([0-9.]+)"', text).group(1).split("."))


@pytest.fixture(scope="module")
def runs():
    version = tree_version(comfyui_path())
    if version < (0, 33, 0):
        pytest.skip(f"these facts document ComfyUI 0.33.0; the tree under test is {'.'.join(map(str, version))}")
    return run_in_comfyui(comfyui_path(), BODY.format(tests=str(ROOT / "tests"), families=FAMILIES, runs=RUNS),
                          timeout=900)


def family(runs, name):
    r = runs[name]
    if "missing" in r:
        pytest.skip(f"ComfyUI {runs['version']} lacks {name}: {r['missing']}")
    assert "error" not in r, r["error"]
    assert r["finite"], name
    return r


def calls(r, forward=0):
    return r["forwards"][forward]["calls"]


def selfs(r, forward=0):
    return [c for c in calls(r, forward) if c["nq"] == c["nk"]]


def by_block(cs):
    return [(c["block_type"], c["block_index"]) for c in cs]


def test_chroma_text_first_joint_sequence(runs):
    r = family(runs, "chroma")
    cs = calls(r)
    n = 7 + (12 // 2) * (16 // 2)                     # text | 6 x 8 image patches
    assert all(c["nq"] == c["nk"] == n and c["skip_reshape"] and c["mask"] is None for c in cs)
    assert all(c["q"] == [2, 2, n, 32] and "mask" in c["kwargs"] for c in cs)
    assert by_block(cs) == [("double", 0), ("double", 1), ("single", 0), ("single", 1)]
    assert [c.get("img_slice") for c in cs] == [None, None, [7, n], [7, n]]
    assert r["patch_size"] == 2


def test_lumina2_refiners_then_joint_layers(runs):
    r = family(runs, "lumina2")
    cs = calls(r)
    # context refiner (caption only), noise refiner (image only): no block_index; then the joint layers
    assert [(c["nq"], c["block_index"]) for c in cs] == [(7, None), (48, None), (55, 0), (55, 1)]
    assert all(c["skip_reshape"] and c["mask"] is None and c["q"][1] == 4 for c in cs)  # k/v repeated to 4 heads


def test_z_image_pads_caption_and_image_to_32(runs):
    r = family(runs, "z_image")
    cs = calls(r)
    cap, img = math.ceil(7 / 32) * 32, math.ceil(48 / 32) * 32
    assert [(c["nq"], c["block_index"]) for c in cs] == [(cap, None), (img, None), (cap + img, 0), (cap + img, 1)]
    assert all(c["mask"] is None for c in cs)


def test_hunyuan_video_15_patch_1x1x1_vision_text_first(runs):
    r = family(runs, "hunyuan_video_1_5")
    assert r["patch_size"] == [1, 1, 1]
    cs = calls(r)
    refiner = [c for c in cs if c["block_index"] is None]
    joint = [c for c in cs if c["block_index"] is not None]
    assert [c["nq"] for c in refiner] == [7, 7]     # the text token refiner: text only, before any block
    txt = 5 + 7                                     # vision tokens | text
    n = txt + 3 * 6 * 8                             # | video, one token per latent voxel
    assert [(c["nq"], c["block_type"]) for c in joint] == [(n, "double"), (n, "single")]
    assert joint[1]["img_slice"] == [txt, n]
    assert all(c["skip_reshape"] and c["mask"] is None for c in cs)


def test_kandinsky5_text_blocks_then_video_self_and_cross(runs):
    r = family(runs, "kandinsky5")
    cs = calls(r)
    n = 3 * 6 * 8
    assert [(c["nq"], c["nk"], c["block_index"]) for c in cs] == [
        (7, 7, None), (n, n, 0), (n, 7, 0), (n, n, 1), (n, 7, 1)]
    assert all(c["skip_reshape"] and c["mask"] is None for c in cs)


def test_cogvideox_joint_text_first_no_block_index(runs):
    r = family(runs, "cogvideox")
    cs = calls(r)
    n = 7 + 3 * 6 * 8
    assert [c["nq"] for c in cs] == [n, n] and all(c["nk"] == n for c in cs)
    assert all(c["block_index"] is None and not c["skip_reshape"] and c["q"] == [2, n, 128] for c in cs)


def test_qwen_image_edit_reference_tokens_appended(runs):
    r = family(runs, "qwen_image_edit")
    cs = calls(r)
    refs = [8 // 2 * 8 // 2, 4 // 2 * 12 // 2]
    n = 7 + 6 * 8 + sum(refs)                        # text | image | ref 1 | ref 2
    assert all(c["nq"] == c["nk"] == n and c["reference_image_num_tokens"] == refs for c in cs)
    assert by_block(cs) == [("double", 0), ("double", 1)]


def test_hidream_e1_image_first_edit_image_beside(runs):
    r = family(runs, "hidream_e1")
    cs = calls(r)
    image = (12 // 2) * (2 * 16 // 2)                # the edit image is joined along the width: 6 x 16 patches
    n = image + 5 + 6 + 6                            # image | T5 | llama (last layer) | llama (this block's layer)
    assert len(cs) == 4 and all(c["nq"] == c["nk"] == n for c in cs)
    assert all(c["block_index"] is None and not c["skip_reshape"] and c["mask"] is None for c in cs)


def test_wan22_ti2v_5b_grid(runs):
    r = family(runs, "wan22_ti2v_5b")
    s = selfs(r)
    assert [c["block_index"] for c in s] == [0, 1]
    assert all(c["grid_sizes"] == [3, 6, 8] and c["nq"] == 3 * 6 * 8 for c in s)
    assert r["forwards"][0]["x"][1] == 48


def test_wan_fun_reference_prepended(runs):
    r = family(runs, "wan_fun_ref")
    s = selfs(r)
    assert all(c["grid_sizes"] == [3, 6, 8] and c["nq"] == 6 * 8 + 3 * 6 * 8 for c in s)  # ref frame | video
    cross = [c for c in calls(r) if c["nq"] != c["nk"]]
    assert sorted({c["nk"] for c in cross}) == [3, 12]  # CLIP-vision tokens, text
    assert all("low_precision_attention" in c["kwargs"] for c in cross if c["nk"] == 3)


def test_ltx2_av_separate_video_and_audio_streams(runs):
    r = family(runs, "ltx2_av")
    f = r["forwards"][0]
    assert f["latent_shapes"] == [[1, 128, 3, 6, 8], [1, 8, 20, 16]]
    pairs = [(c["nq"], c["nk"]) for c in f["calls"]]
    v, a, txt = 3 * 6 * 8, 20, 1024                  # text padded to 1024 by the connector's registers
    assert pairs == [(v, v), (v, txt), (a, a), (a, txt), (v, a), (a, v)] * 2
    assert all(c["block_index"] is None and not c["skip_reshape"] and c["mask"] is None for c in f["calls"])


def test_minimax_h3_packed_sequence_batch_one(runs):
    r = family(runs, "minimax_h3")
    assert len(r["forwards"]) == 4                   # cond and uncond run as separate batch-1 forwards
    for f in r["forwards"]:
        assert len(f["calls"]) == 2 and len(f["calls"][0]["cond_or_uncond"]) == 1
        for c in f["calls"]:
            assert c["nq"] == c["nk"] == 7 + 2 * 10 + 3 * 6 * 8   # text | audio (2 channels x 10) | video
            assert c["q"][0] == 1 and c["skip_reshape"] and c["mask"] is None and c["block_index"] is None
    cont = runs["minimax_containers"]
    assert cont["seen"] == [["container", "AttentionTensorContainer"]] and cont["finite"]


def test_trellis2_structure_grid_and_sparse_shape(runs):
    r = family(runs, "trellis2")
    cs = calls(r)
    assert [(c["nq"], c["nk"]) for c in cs] == [(16 ** 3, 16 ** 3), (16 ** 3, 6)]
    assert all(c["skip_reshape"] and c["skip_output_reshape"] and c["heads"] == 12 for c in cs)
    s = family(runs, "trellis2_shape")
    assert [(c["nq"], c["nk"]) for c in calls(s)] == [(40, 40), (40, 6)]
    assert all(c["mask"] is None for c in calls(s))  # equal voxel counts per batch entry: no padding mask
