"""Modalities of the tokens in a self-attention sequence, and the density kept for each pair of them.

A segment of the sequence (engine/context.py) has a kind — what the model calls it — and each kind belongs to
one of four modalities (docs/method.md, "Modalities"):

- ``text``: text and conditioning embeddings, caption padding (short, semantically global);
- ``image``: the latent tokens being generated — video frames, image patches, 3-D voxels;
- ``audio``: audio latent frames generated with the video (LTX-2, MiniMax H3);
- ``ref``: reference or conditioning latents placed in the sequence (edit images, reference frames,
  keyframe guides, in-context latents).

A query of modality A attending keys of modality B keeps the fraction ``densities.A_to_B`` of those keys
(1.0: all of them, dense). The defaults keep every text row and column, every reference row and column and
audio self-attention dense; image->image takes the configured global density.
"""

from __future__ import annotations

from dataclasses import dataclass

MODALITIES = ("text", "image", "audio", "ref")

# segment kind -> modality
KIND_MODALITY = {
    "text": "text", "pad": "text",
    "video": "image", "image": "image", "voxels": "image", "tokens": "image",
    "audio": "audio",
    "ref": "ref", "cond": "ref",
}
KINDS = tuple(KIND_MODALITY)


@dataclass(frozen=True)
class Densities:
    """Fraction of keys kept per modality pair (query -> key), in (0, 1]; None means "the global density".

    Field names are ``<query modality>_to_<key modality>`` over text, image (video/image/3-D latent tokens),
    audio and ref (reference/conditioning latents). Defaults: every pair involving text or ref, and audio
    rows, dense (1.0); image->image the global density; image->audio 0.5 (video queries keep half of the
    audio keys: audio is a small share of the keys, so this is a small saving; not yet tuned on a model).
    """

    text_to_text: float | None = 1.0
    text_to_image: float | None = 1.0
    text_to_audio: float | None = 1.0
    text_to_ref: float | None = 1.0
    image_to_text: float | None = 1.0
    image_to_image: float | None = None
    image_to_audio: float | None = 0.5
    image_to_ref: float | None = 1.0
    audio_to_text: float | None = 1.0
    audio_to_image: float | None = 1.0
    audio_to_audio: float | None = 1.0
    audio_to_ref: float | None = 1.0
    ref_to_text: float | None = 1.0
    ref_to_image: float | None = 1.0
    ref_to_audio: float | None = 1.0
    ref_to_ref: float | None = 1.0

    def pair(self, query: str, key: str, density: float) -> float:
        """Density kept for queries of modality ``query`` over keys of modality ``key``; ``density`` is the
        configured global density (used where the pair is None)."""
        v = getattr(self, f"{query}_to_{key}")
        return float(density if v is None else v)

    def table(self, density: float) -> list[list[float]]:
        """The 4 x 4 table [query modality][key modality] in MODALITIES order."""
        return [[self.pair(q, k, density) for k in MODALITIES] for q in MODALITIES]
