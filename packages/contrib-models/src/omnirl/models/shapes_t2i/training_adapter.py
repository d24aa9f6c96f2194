"""ShapesT2I training adapter: :class:`SD3TrainingAdapter` unchanged but for its key.

A ShapesT2I folder keeps the transformer and the scheduler where SD3 keeps them
(``transformer/``, ``scheduler/``), and the trainer needs nothing else (embeddings arrive
with the trajectories), so loading, LoRA, transitions, reference and export are SD3's; only the
sample encoder (prompts through the small CLIP, images as pixels or through the tiny VAE) is
this family's own.
"""

from __future__ import annotations

from omnirl.models.base import SampleEncoder
from omnirl.models.registry import register_training_adapter
from omnirl.models.sd3.training_adapter import SD3TrainingAdapter
from omnirl.models.shapes_t2i.pipeline import ARCHITECTURE


@register_training_adapter(ARCHITECTURE)
class ShapesT2ITrainingAdapter(SD3TrainingAdapter):
    """The ShapesT2I transformer as a policy over recorded transitions."""

    architecture = ARCHITECTURE

    def sample_encoder(self) -> SampleEncoder:
        """The folder's tokenizer and text encoder, and its VAE for a latent model (images
        become that model's latents; a pixel model's are the pixels)."""
        from omnirl.models.shapes_t2i.encoder import ShapesT2ISampleEncoder

        if self.path is None:
            raise RuntimeError("sample_encoder() needs the model path (from_pretrained)")
        return ShapesT2ISampleEncoder.from_pretrained(self.path, device=self.device)
