"""The pack on every ComfyUI 0.33.0 family (needs COMFYUI_PATH): the tiny models of tests/comfy_families.py sampled
through ComfyUI's sampler (two euler steps, CFG 3) with the patch installed.

Per family: at density 1 the output equals the unpatched model's; at density 0.15 the layout the pack reports for
each stream matches the model's true segments (docs/families.md), every self-attention call over generated tokens
runs sparse (anchor or reuse) with layer numbers in model order, the refiners' text-only calls and every
cross-attention call run dense, and the density achieved is the one the segments' modality pairs give. Skipped on
trees older than 0.33.0 (the builders use its constructor fields).
"""

import math
import re

import pytest
from comfy_subprocess import run_in_comfyui
from conftest import ROOT, comfyui_path, comfyui_version

pytestmark = pytest.mark.comfyui

RUNS = {"trellis2": (2, 1.0)}  # 4 096 tokens: no CFG

# family -> {stream: layout the pack must report}, layer numbers of the sparse calls, dense fallbacks per reason
# (a substring of the reason: calls), and the segments (modality, tokens) of each layer for the density check
EXPECTED = {
    "chroma": ({"main": "text 7 | image 6x8 = 55"}, [0, 1, 2, 3], {}),
    "chroma_radiance": ({"main": "text 7 | image 6x8 = 55"}, [0, 1, 2, 3], {}),  # 96x128 pixels in 16x16 patches
    "mochi": ({"main": "video 3x6x8 | text 7 = 151"}, [0, 1], {}),
    "auraflow": ({"main": "text 15 | image 6x8 = 63"}, [0, 1, 2, 3], {}),  # text 15: 8 registers + 7 prompt tokens
    "lens": ({"main": "image 6x8 | text 7 = 55"}, [0, 1], {}),  # its key mask (no padded text) changes nothing
    "ideogram4": ({"main": "text 7 | image 6x8 = 55"}, [0, 1], {}),
    "joyimage": ({"main": "image 6x8 | text 7 = 55"}, [0, 1], {}),
    "mage_flow": ({"main": "text 7 | image 6x8 | ref 16 (reference image) = 71"}, [0, 1], {}),
    "pixeldit": ({"main": "text 7 | image 6x8 = 55", "extra": "image 6x8 = 48"}, [0, 1, 2, 3], {}),  # 2-3: pixel
    "pid": ({"main": "text 7 | image 6x8 = 55", "extra": "image 6x8 = 48"}, [0, 1, 2, 3], {}),  # blocks, image only
    # OmniGen2 / Boogu: the caption refiner (layer 2 / 4) is text only; 3 / 5: the noise refiner; Boogu's 6-7: the
    # image-only passes of its double blocks
    "omnigen2": ({"main": "text 7 | image 6x8 = 55", "extra": "image 6x8 = 48"}, [0, 1, 3],
                 {"text or reference tokens only": 2}),
    "omnigen2_gqa": ({"main": "text 7 | image 6x8 = 55", "extra": "image 6x8 = 48"}, [0, 1, 3],
                     {"text or reference tokens only": 2}),  # 2 query heads per k/v head, as released (21 / 7)
    "omnigen2_ref": ({"main": "text 7 | ref 16 (reference image) | image 6x8 = 71",
                      "extra": ("image 6x8 = 48", "ref 16 (reference image) = 16")},
                     [0, 1, 3], {"text or reference tokens only": 4}),  # and the reference refiner (layer 4)
    # a reference of the target's token count: the noise and reference refiners cannot be told apart, both dense
    "omnigen2_ref_same": ({"main": "text 7 | ref 48 (reference image) | image 6x8 = 103",
                           "extra": "ref 48 (reference image) = 48"}, [0, 1], {"text or reference tokens only": 6}),
    "boogu": ({"main": "text 7 | image 6x8 = 55", "extra": "image 6x8 = 48"}, [0, 1, 2, 3, 5, 6, 7],
              {"text or reference tokens only": 2}),
    # with a reference: its refiner is extra layer 6 (dense); 7-8, the image-only passes, run over [ref | image]
    "boogu_ref": ({"main": "text 7 | ref 16 (reference image) | image 6x8 = 71",
                   "extra": ("image 6x8 = 48", "ref 16 (reference image) | image 6x8 = 64",
                             "ref 16 (reference image) = 16")}, [0, 1, 2, 3, 5, 7, 8],
                  {"text or reference tokens only": 4}),
    "lumina2": ({"main": "text 7 | image 6x8 = 55", "extra": "image 6x8 = 48"}, [0, 1, 3],  # 2: caption refiner
                {"text or reference tokens only": 2}),
    "z_image": ({"main": "text 32 (caption and its padding) | image 6x8 | pad 16 (image padding) = 96",
                 "extra": "image 6x8 | pad 16 = 64"}, [0, 1, 3], {"text or reference tokens only": 2}),
    "hunyuan_video_1_5": ({"main": "text 12 | video 3x6x8 = 156"}, [0, 1], {"text or reference tokens only": 4}),
    "kandinsky5": ({"main": "video 3x6x8 = 144"}, [0, 1],
                   {"text or reference tokens only": 2, "cross-attention": 4}),
    "cogvideox": ({"main": "text 7 | video 3x6x8 = 151"}, [0, 1], {}),
    "qwen_image_edit": ({"main": "text 7 | image 6x8 | ref 16 (reference image) | ref 12 (reference image) = 83"},
                        [0, 1], {}),
    "hidream_e1": ({"main": "image 6x16 (target | edit image side by side) | text 17 = 113"}, [0, 1, 2, 3], {}),
    "wan22_ti2v_5b": ({"main": "video 3x6x8 = 144"}, [0, 1], {"cross-attention": 4}),
    "wan_fun_ref": ({"main": "ref 48 (reference image) | video 3x6x8 = 192"}, [0, 1], {"cross-attention": 8}),
    "ltx2_av": ({"main": "video 3x6x8 = 144", "audio": "audio 20 = 20"}, [0, 1, 2, 3], {"cross-attention": 16}),
    "ltx2_av_equal": ({"main": "video 3x6x8 = 144", "audio": "audio 144 = 144"}, [0, 1, 2, 3],
                      {"cross-attention": 16}),
    "minimax_h3": ({"main": "text 7 | audio 10 (left channel) | audio 10 (right channel) | video 3x6x8 = 171"},
                   [0, 1], {}),
    "krea2": ({"main": "text 7 | image 6x8 | ref 16 (reference image) = 71"}, [0, 1],
              {"text or reference tokens only": 8}),  # the text fusion transformer's calls: dense
    "trellis2": ({"main": "voxels 16x16x16 (structure grid) = 4096"}, [0], {"cross-attention": 2}),
    "trellis2_shape": ({"main": "voxels 40 (active voxels) = 40"}, [0], {"cross-attention": 2}),
}

# builders whose every self-attention call must stay dense, with the reason counted
DENSE_ONLY = ("lens_padded",)

BODY = """
import sys, traceback, torch
sys.path.insert(0, {tests!r})
import comfy_child as C
import comfy_families as F
C.load_pack()
from comfyui_sparse_attention.nodes.patch import install
from comfyui_sparse_attention.nodes.report import render_report
from comfyui_sparse_attention.engine import SparseConfig
out = {{}}

def cfg(method, density):
    return SparseConfig(method=method, density=density, min_tokens=0, group_size=64, block_q=64, block_k=64,
                        backend="torch")

def run(model, latent, pos, neg, steps, cfg_scale, config):
    m, p = install(model, config)
    res = F.sample(m, latent, pos, neg, steps=steps, cfg=cfg_scale)
    parts = res.unbind() if getattr(res, "is_nested", False) else [res]
    stats = p.last_stats
    layers = {{i: dict(calls=s.calls, dense=s.dense, anchors=s.anchors, reuses=s.reuses, density=s.density)
              for i, s in stats.layers.items()}}
    return parts, dict(layouts={{f"{{k[0]}}: {{k[1]}}": v for k, v in p.layouts.items()}}, fallbacks=dict(p.fallbacks),
                       layers=layers, totals=stats.totals(), report=render_report(p, -1)[0],
                       finite=all(bool(torch.isfinite(x).all()) for x in parts))

for name in {families!r}:
    reason = F.missing(name)
    if reason:
        out[name] = {{"missing": reason}}
        continue
    try:
        model, latent, pos, neg = F.build(name)
        steps, cfg_scale = {runs!r}.get(name, (2, 3.0))
        base = F.sample(model, latent, pos, neg, steps=steps, cfg=cfg_scale)
        base = base.unbind() if getattr(base, "is_nested", False) else [base]
        full, r1 = run(model, latent, pos, neg, steps, cfg_scale, cfg("mc_sparse", 1.0))
        r = {{"dense_equal_rel": max(C.rel(a, b) for a, b in zip(full, base)), "full_totals": r1["totals"]}}
        _, r["mc"] = run(model, latent, pos, neg, steps, cfg_scale, cfg("mc_sparse", 0.15))
        _, r["block"] = run(model, latent, pos, neg, steps, cfg_scale, cfg("block_topk", 0.15))
        out[name] = r
    except Exception:
        out[name] = {{"error": traceback.format_exc()[-4000:]}}
emit(out)
"""


@pytest.fixture(scope="module")
def runs():
    version = comfyui_version()
    if version < (0, 33, 0):
        pytest.skip(f"the tiny builders use ComfyUI 0.33.0's classes; the tree under test is "
                    f"{'.'.join(map(str, version))}")
    return run_in_comfyui(comfyui_path(), BODY.format(tests=str(ROOT / "tests"), families=tuple(EXPECTED) + DENSE_ONLY,
                                                      runs=RUNS), timeout=1500)


def result(runs, name):
    r = runs[name]
    if "missing" in r:
        pytest.skip(f"this ComfyUI lacks {name}: {r['missing']}")
    assert "error" not in r, r["error"]
    return r


def mc_density(layout: str, d: float = 0.15, slack: int = 0) -> float:
    """The density mc_sparse's per-pair budgets give a layout written as the report writes it (default
    densities: image->image d, image->audio 0.5, every other pair dense); with ``slack``, that many keys (or 3 %)
    fewer per sparse pair (a random tiny model's attention is nearly uniform: near-ties leave a group a few keys
    short of its budget)."""
    kinds = {"text": "text", "pad": "text", "video": "image", "image": "image", "voxels": "image",
             "audio": "audio", "ref": "ref"}
    segs = []
    for part in re.sub(r" \([^)]*\)", "", layout).split(" = ")[0].split(" | "):
        kind, size = part.split(" ")[:2]
        n = 1
        for v in size.split("x"):
            n *= int(v)
        segs.append((kinds[kind], n))
    pair = {("image", "image"): d, ("image", "audio"): 0.5}
    n = sum(s for _, s in segs)
    total = 0.0
    for qm, qn in segs:
        dens = [pair.get((qm, km), 1.0) for km, _ in segs]
        if min(dens) >= 1.0:
            total += qn * n
        else:
            keep = [kn if dk >= 1.0 else round(dk * kn) for dk, (_, kn) in zip(dens, segs)]
            total += qn * sum(k if dk >= 1.0 else max(1, k - max(slack, math.ceil(0.03 * k) if slack else 0))
                              for k, dk in zip(keep, dens))
    return total / (n * n)


@pytest.mark.parametrize("name", EXPECTED)
def test_density_one_equals_the_unpatched_model(runs, name):
    r = result(runs, name)
    assert r["dense_equal_rel"] <= 1e-3, r
    t = r["full_totals"]
    assert t["anchors"] > 0 and t["reuses"] > 0, t  # the override really ran sparse calls


@pytest.mark.parametrize("name", EXPECTED)
def test_reported_layout_numbering_and_sparse_share(runs, name):
    layouts, layers, fallbacks = EXPECTED[name]
    r = result(runs, name)
    for method in ("mc", "block"):
        m = r[method]
        assert m["finite"], name
        seen = {}
        for k in m["layouts"]:
            if "refiner" not in k:
                seen.setdefault(k.split(": ", 1)[0], set()).add(k.split(": ", 1)[1])
        assert seen == {s: {v} if isinstance(v, str) else set(v) for s, v in layouts.items()}, m["layouts"]
        assert sorted(int(i) for i in m["layers"]) == layers, m["layers"]
        t = m["totals"]
        assert t["calls"] == t["anchors"] + t["reuses"] and t["dense"] == 0, t  # every engine call ran sparse
        calls = {row["calls"] for row in m["layers"].values()}
        assert len(calls) == 1, m["layers"]  # each layer once per forward
        for reason, count in fallbacks.items():
            assert sum(v for k, v in m["fallbacks"].items() if reason in k) == count, m["fallbacks"]
        assert not any("does not match the layout" in k for k in m["fallbacks"]), m["fallbacks"]
        assert "segments seen" in m["report"]


@pytest.mark.parametrize("name", EXPECTED)
def test_density_follows_the_segments_modality_pairs(runs, name):
    layouts, _, _ = EXPECTED[name]
    r = result(runs, name)["mc"]
    for i, row in r["layers"].items():
        if name.startswith("ltx2") and int(i) >= 2:
            stream = "audio"  # layers 2-3: the audio self-attention of blocks 0-1
        elif name in ("lumina2", "z_image") and int(i) == 3:
            stream = "extra"  # layer 3: the noise refiner (image only)
        elif name in ("pixeldit", "pid") and int(i) >= 2:
            stream = "extra"  # layers 2-3: the pixel blocks' self-attention over the patches alone
        elif name.startswith("omnigen2") and int(i) >= 2 or name.startswith("boogu") and int(i) >= 4:
            stream = "extra"  # the refiners and Boogu's image-only passes
        else:
            stream = "main"
        # several extra layouts: the first is the noise refiner's; boogu_ref's layers 7-8 run over [ref | image]
        layout = layouts[stream] if isinstance(layouts[stream], str) else layouts[stream][int(i) >= 7]
        want, low = mc_density(layout), mc_density(layout, slack=2)
        assert low - 1e-9 <= row["density"] <= want + 1e-9, (i, row, want, layout)


def test_lens_with_padded_text_runs_its_masked_calls_dense(runs):
    """Lens's key mask is real when the text is padded: every call dense, counted as masked, output unchanged."""
    r = result(runs, "lens_padded")
    assert r["dense_equal_rel"] <= 1e-3
    for method in ("mc", "block"):
        m = r[method]
        assert m["totals"]["anchors"] == m["totals"]["reuses"] == 0, m["totals"]
        assert m["fallbacks"].get("calls with an attention mask", 0) > 0, m["fallbacks"]
