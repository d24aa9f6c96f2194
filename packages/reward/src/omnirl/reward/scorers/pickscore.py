"""PickScore (Kirstain et al., 2023): a CLIP-H fine-tuned on Pick-a-Pic preferences.

``pickscore = logit_scale.exp() * cos(image, prompt)`` (the model's own logit scale, about
100 for the released weights, so values are around 20). flow_grpo divides this by 26 to
bring it near ``[0, 1]``; pass ``scale=0.0384615`` (1/26) for the same numbers, or scale
with the reward weight.

Real weights: download ``yuvalkirstain/PickScore_v1`` (the model) and
``laion/CLIP-ViT-H-14-laion2B-s32B-b79K`` (its processor) to folders elsewhere and pass
``pickscore(model=/models/PickScore_v1;processor=/models/CLIP-ViT-H-14)``.
"""

from __future__ import annotations

from omnirl.reward.scorers.clip_score import load_clip, prompt_image_cosine
from omnirl.reward.scorers.registry import ScoreBatch, register_reward


@register_reward("pickscore")
class PickScore:
    """``pickscore(model=FOLDER[;processor=FOLDER;scale=1;device=cpu;dtype=float32])``."""

    components = ("pickscore",)
    reads = frozenset({"images", "prompt"})
    batchable = True
    thread_safe = False

    def __init__(
        self,
        model: str,
        processor: str = "",
        scale: float = 1.0,
        device: str = "cpu",
        dtype: str = "float32",
    ):
        self.clip = load_clip(model, processor=processor, device=device, dtype=dtype)
        self.scale = float(scale)

    def __call__(self, batch: ScoreBatch) -> dict[str, list[float]]:
        logit_scale = float(self.clip.model.logit_scale.detach().float().exp())
        cosine = prompt_image_cosine(self.clip, batch)
        return {"pickscore": (self.scale * logit_scale * cosine).tolist()}
