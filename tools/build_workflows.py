"""Build the bundled workflows from ComfyUI's official templates, with our preset node inserted.

    pip download --no-deps -d tpl comfyui-workflow-templates-media-image==0.3.17 \
        comfyui-workflow-templates-media-video==0.3.12      # the templates ComfyUI 0.3.75 pins (PyPI)
    python tools/build_workflows.py --templates DIR          # DIR: those wheels' templates/*.json
                                                             # writes workflows/*.json and *.jpg

The templates pinned by ComfyUI 0.3.75 are used (not the newest) so the workflows load there and on
every newer ComfyUI: newer templates use core nodes 0.3.75 lacks (e.g. ComfySwitchNode). Models that only
newer ComfyUI runs come from the templates that release pins (NEWER below, e.g. MiniMax H3 from ComfyUI
0.33.0's comfyui-workflow-templates 0.11.44); the workflow records that minimum in
``extra.sparse_attention_min_comfyui`` and the tests validate it only on trees at least that new:

    python tools/build_workflows.py --templates DIR033 --only video_minimax_h3_t2v   # DIR033: 0.33.0's templates

For each template below, every model loader's MODEL output (UNETLoader, CheckpointLoaderSimple,
ImageOnlyCheckpointLoader; top level and inside subgraphs) is re-routed through a "Sparse Attention
(Preset)" node with the preset chosen for that loader's model file, and a Note explaining the settings
is added. Model file names and every other setting stay the template's, so users' files match.
"""

from __future__ import annotations

import argparse
import copy
import importlib.resources
import json
import logging
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOADERS = {"UNETLoader", "CheckpointLoaderSimple", "ImageOnlyCheckpointLoader"}
NODE = "SparseAttn_Preset"
log = logging.getLogger("build_workflows")

# output name: (template, title, {substring of the model file: preset}, expected speed-up note)
WORKFLOWS = {
    "image_flux1_dev_t2i": ("flux_dev_checkpoint_example", "Flux.1-dev text-to-image", {"": "flux"},
                            "At 1024² (4 608 tokens) attention is a small part of the step and min_tokens keeps it "
                            "dense; raise the resolution (2 MP and up) to see a speed-up."),
    "image_qwen_image_t2i": ("image_qwen_image", "Qwen-Image text-to-image", {"": "qwen_image"},
                             "Block top-k at density 0.3 after 8 dense steps; gains grow with resolution."),
    "video_wan2_1_t2v_1.3b": ("text_to_video_wan", "Wan 2.1 T2V 1.3B 480p", {"": "wan21_t2v_1.3b"},
                              "MC-Sparse at density 0.15 with anchors at steps 10 and 26: attention at reuse steps "
                              "runs ~4-5x faster than dense (docs/benchmarks.md)."),
    "video_wan2_2_14b_t2v": ("video_wan2_2_14B_t2v", "Wan 2.2 14B T2V (high- and low-noise models)",
                             {"high_noise": "wan22_14b_high_noise", "low_noise": "wan22_14b_low_noise"},
                             "Each expert model is patched with its own preset; each sampler run counts its own "
                             "steps. At 720p attention dominates the step, so most of its speed-up carries over."),
    "video_hunyuan_video_1.5_720p_t2v": ("video_hunyuan_video_1.5_720p_t2v", "HunyuanVideo 1.5 720p T2V",
                                         {"": "hunyuan_video_1.5"},
                                         "MC-Sparse at density 0.15 on both the 720p and the super-resolution "
                                         "model; EasyCache stays in the chain."),
    "3d_hunyuan3d_2_image_to_model": ("3d_hunyuan3d_image_to_model", "Hunyuan3D 2.0 image-to-model",
                                      {"": "hunyuan3d_2"},
                                      "One anchor at step 1 (the 3-D setting of the MC-Sparse paper)."),
    "video_minimax_h3_t2v": ("video_minimax_h3_t2v", "MiniMax H3 text-to-video with audio", {"": "minimax_h3"},
                             "The template samples 20 steps (preset minimax_h3); with its turbo_mode switch on "
                             "(8-step LoRA) pick minimax_h3_turbo_8step, with the 4-step LoRA "
                             "minimax_h3_turbo_4step. Video tokens take the density; text, audio rows and audio "
                             "keys of video queries follow the modality densities (docs/method.md). The preset "
                             "values are not yet measured on H3."),
}
# workflows whose template (and model) need a newer ComfyUI than 0.3.75: the minimum version
NEWER = {"video_minimax_h3_t2v": "0.33.0"}


def _graphs(doc):
    yield doc, False
    for sg in doc.get("definitions", {}).get("subgraphs", []):
        yield sg, True


def _max_ids(doc):
    nodes = links = 0
    for g, _ in _graphs(doc):
        nodes = max([nodes] + [int(n["id"]) for n in g.get("nodes", []) if str(n["id"]).lstrip("-").isdigit()])
        for ln in g.get("links", []):
            links = max(links, int(ln["id"] if isinstance(ln, dict) else ln[0]))
    return nodes, links


def _link_fields(ln):
    if isinstance(ln, dict):
        return ln["id"], ln["origin_id"], ln["origin_slot"], ln["target_id"], ln["target_slot"]
    return ln[0], ln[1], ln[2], ln[3], ln[4]


def _set_origin(ln, node_id, slot):
    if isinstance(ln, dict):
        ln["origin_id"], ln["origin_slot"] = node_id, slot
    else:
        ln[1], ln[2] = node_id, slot


def insert_presets(doc: dict, presets: dict[str, str]) -> list[str]:
    """Insert a preset node after every model loader; returns the presets used (in order)."""
    next_node, next_link = _max_ids(doc)
    used = []
    for g, is_sub in _graphs(doc):
        for loader in [n for n in g.get("nodes", []) if n["type"] in LOADERS]:
            out_slot = next((i for i, o in enumerate(loader.get("outputs", [])) if o.get("type") == "MODEL"), None)
            if out_slot is None or not loader["outputs"][out_slot].get("links"):
                continue
            model_file = str((loader.get("widgets_values") or [""])[0]).lower()
            preset = next((p for key, p in presets.items() if key and key in model_file), presets.get(""))
            if preset is None:
                continue
            next_node += 1
            next_link += 1
            node_id, link_id = next_node, next_link
            old = list(loader["outputs"][out_slot]["links"])
            for ln in g["links"]:
                if _link_fields(ln)[0] in old:
                    _set_origin(ln, node_id, 0)
            pos = loader.get("pos", [0, 0])
            pos = list(pos.values()) if isinstance(pos, dict) else list(pos)
            node = {
                "id": node_id, "type": NODE, "pos": [pos[0] + 20, pos[1] + 140], "size": [320, 110], "flags": {},
                "order": loader.get("order", 0) + 1, "mode": 0,
                "inputs": [{"name": "model", "type": "MODEL", "link": link_id}],
                "outputs": [{"name": "MODEL", "type": "MODEL", "links": old}],
                "properties": {"Node name for S&R": NODE, "cnr_id": "comfyui-sparse-attention", "ver": "0.1.0"},
                "widgets_values": [preset, 0.0],
            }
            g["nodes"].append(node)
            loader["outputs"][out_slot]["links"] = [link_id]
            new = ({"id": link_id, "origin_id": loader["id"], "origin_slot": out_slot, "target_id": node_id,
                    "target_slot": 0, "type": "MODEL"} if is_sub or (g["links"] and isinstance(g["links"][0], dict))
                   else [link_id, loader["id"], out_slot, node_id, 0, "MODEL"])
            g["links"].append(new)
            used.append(preset)
    doc["last_node_id"], doc["last_link_id"] = next_node, next_link
    for g, is_sub in _graphs(doc):
        if is_sub and isinstance(g.get("state"), dict):
            g["state"]["lastNodeId"], g["state"]["lastLinkId"] = next_node, next_link
    return used


def add_note(doc: dict, title: str, presets: list[str], expect: str) -> None:
    node_id = _max_ids(doc)[0] + 1
    doc["last_node_id"] = node_id
    text = (f"## Sparse Attention — {title}\n\n"
            f"The **Sparse Attention (Preset)** node after the model loader runs the model's long self-attention "
            f"sparsely with the preset{'s' if len(set(presets)) > 1 else ''} **{', '.join(dict.fromkeys(presets))}** "
            "(settings and their sources: the pack's `presets/` folder). Set `density_override` to trade speed "
            "for fidelity (0 keeps the preset), or replace the node by **Sparse Attention** to edit every "
            "setting. Add **Sparse Attention Report** after the sampler to see the density achieved and how close "
            f"anchor steps were to dense attention.\n\n**Expected:** {expect}\n\nWithout an NVIDIA GPU the same "
            "methods run on PyTorch (slower than dense there).")
    doc["nodes"].append({"id": node_id, "type": "MarkdownNote", "pos": [-700, -700], "size": [520, 320], "flags": {},
                         "order": 0, "mode": 0, "inputs": [], "outputs": [], "title": "Sparse Attention",
                         "properties": {}, "widgets_values": [text]})


def thumbnail(path: Path, title: str) -> None:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (512, 384), (22, 26, 38))
    draw = ImageDraw.Draw(img)
    for i in range(0, 512, 16):  # a block-sparse pattern as the motif
        for j in range(0, 256, 16):
            if abs(i - 2 * j) < 48 or (i // 16) % 11 == 0 or (j // 16) % 9 == 0:
                draw.rectangle([i, 96 + j // 2, i + 13, 96 + j // 2 + 5], fill=(70, 130, 230))
    draw.text((20, 24), "Sparse Attention", fill=(240, 240, 240))
    draw.text((20, 48), title, fill=(180, 200, 255))
    img.save(path, "JPEG", quality=85)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--templates", help="folder of template JSONs (default: the installed package)")
    ap.add_argument("--out", default=str(ROOT / "workflows"))
    ap.add_argument("--only", nargs="*", help="build only these workflows (names as in WORKFLOWS)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    src = (Path(args.templates) if args.templates
           else Path(str(importlib.resources.files("comfyui_workflow_templates_json") / "templates")))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, (template, title, presets, expect) in WORKFLOWS.items():
        if args.only and name not in args.only:
            continue
        doc = copy.deepcopy(json.loads((src / f"{template}.json").read_text(encoding="utf-8")))
        if name in NEWER:
            doc.setdefault("extra", {})["sparse_attention_min_comfyui"] = NEWER[name]
        used = insert_presets(doc, presets)
        if not used:
            raise SystemExit(f"{template}: no model loader found to patch")
        add_note(doc, title, used, expect)
        (out / f"{name}.json").write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        thumbnail(out / f"{name}.jpg", title)
        log.info("%s <- %s: presets %s", name, template, used)


if __name__ == "__main__":
    main()
