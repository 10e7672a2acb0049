"""Every bundled preset loads, validates, names its source, and bad presets fail with file and field."""

from pathlib import Path

import pytest
import yaml

from comfyui_sparse_attention.engine.presets import (PRESET_DIR, list_presets, load_preset, preset_fingerprint,
                                                     preset_title)

FAMILIES = ["wan21_t2v_1.3b", "wan21_t2v_14b", "wan21_i2v_14b", "wan22_5b_ti2v", "wan22_14b_high_noise",
            "wan22_14b_low_noise", "hunyuan_video", "hunyuan_video_1.5", "ltx_video", "cosmos_predict2", "kandinsky5",
            "flux", "qwen_image", "sd35", "lumina2_zimage", "hidream", "hunyuan3d_2", "minimax_h3",
            "minimax_h3_turbo_8step", "minimax_h3_turbo_4step", "ltx2", "cogvideox", "z_image", "trellis2"]


def test_every_family_has_a_preset():
    assert set(FAMILIES) <= set(list_presets())


@pytest.mark.parametrize("name", list_presets())
def test_preset_is_valid_and_documented(name):
    cfg = load_preset(name)
    text = (PRESET_DIR / f"{name}.yaml").read_text()
    assert text.lstrip().startswith("#") and ("Source" in text or "source" in text)
    assert preset_title(name) != name
    assert 0 < cfg.density <= 1
    doc = yaml.safe_load(text)
    assert set(doc) == {"title", "sparse"}


def test_bad_preset_names_file_and_field(tmp_path: Path):
    (tmp_path / "broken.yaml").write_text("title: x\nsparse:\n  density: 3\n")
    with pytest.raises(ValueError, match=r"broken\.yaml: density"):
        load_preset("broken", directory=tmp_path)
    with pytest.raises(ValueError, match=r"not one of the \d+ presets"):
        load_preset("nope", directory=tmp_path)
    assert load_preset("wan21_t2v_14b", {"density": 0.1}).density == 0.1


def test_a_preset_name_is_never_a_path(tmp_path: Path):
    """Names come from workflows and the server's API: a path (relative or absolute) to any YAML file is refused
    before it is read, so no other file's keys show in an error."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.yaml").write_text("title: x\nsparse:\n  api_token: 1\n")
    inside = tmp_path / "presets"
    inside.mkdir()
    (inside / "ok.yaml").write_text("title: ok\nsparse:\n  density: 0.2\n")
    for name in ("../outside/secret", str(outside / "secret"), "ok/../../outside/secret", "", None):
        with pytest.raises(ValueError, match=r"not one of the \d+ presets") as err:
            load_preset(name, directory=inside)
        assert "api_token" not in str(err.value) and str(tmp_path) not in str(err.value)
    assert load_preset("ok", directory=inside).density == 0.2


def test_a_preset_edited_on_disk_changes_its_fingerprint(tmp_path: Path):
    """ComfyUI re-runs a node whose inputs did not change only when its fingerprint changes: editing the preset file
    (or, for `auto`, any preset file) must change it, or the edit is ignored until the server restarts."""
    (tmp_path / "a.yaml").write_text("title: a\nsparse:\n  density: 0.25\n")
    (tmp_path / "b.yaml").write_text("title: b\nsparse:\n  density: 0.1\n")
    one, every = preset_fingerprint("a", tmp_path), preset_fingerprint(None, tmp_path)
    assert preset_fingerprint("a", tmp_path) == one and preset_fingerprint(None, tmp_path) == every
    (tmp_path / "a.yaml").write_text("title: a\nsparse:\n  density: 0.75\n")
    assert preset_fingerprint("a", tmp_path) != one and preset_fingerprint(None, tmp_path) != every
    every = preset_fingerprint(None, tmp_path)
    (tmp_path / "c.yaml").write_text("title: c\nsparse:\n  density: 0.1\n")
    assert preset_fingerprint(None, tmp_path) != every
    assert preset_fingerprint("gone", tmp_path) == (("gone", None),)
