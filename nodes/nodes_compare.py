"""Sparse Attention Compare: what a setting costs in quality on the user's own model (an A/B of two runs)."""

from __future__ import annotations

from comfy_api.latest import io

from .image_metrics import compare

CATEGORY = "model_patches/sparse_attention"


class SparseAttentionCompare(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SparseAttn_Compare",
            display_name="Sparse Attention Compare",
            category=CATEGORY,
            description="PSNR and SSIM of a sparse run against the dense run of the same seed, and their difference "
                        "image: measure on your own model what a setting costs.",
            inputs=[
                io.Image.Input("image_a", tooltip="The reference: images or video frames decoded from the dense run "
                                                  "(the unpatched model)."),
                io.Image.Input("image_b", tooltip="The same seed, prompt and sampler with Sparse Attention: same size "
                                                  "and frame count as image_a."),
                io.Float.Input("amplify", default=4.0, min=0.1, max=100.0, step=0.1,
                               tooltip="The difference image shows |A - B| times this factor."),
            ],
            outputs=[io.String.Output(display_name="report", tooltip="PSNR (dB) and SSIM, mean and worst frame."),
                     io.Image.Output(display_name="difference", tooltip="|A - B| x amplify, per frame.")],
            is_output_node=True,
        )

    @classmethod
    def validate_inputs(cls, amplify=4.0):  # ComfyUI checks the inputs not named here
        if isinstance(amplify, bool) or not isinstance(amplify, (int, float)) or not 0.1 <= amplify <= 100.0:
            return f"amplify: must lie in [0.1, 100], got {str(amplify)[:60]}"
        return True

    @classmethod
    def execute(cls, image_a, image_b, amplify) -> io.NodeOutput:
        result = compare(image_a, image_b, amplify)
        return io.NodeOutput(result.text(), result.difference, ui={"text": [result.text()]})
