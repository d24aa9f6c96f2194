"""ShapesT2I training adapter: :class:`SD3TrainingAdapter` unchanged but for its key.

A ShapesT2I folder keeps the transformer and the scheduler where SD3 keeps them
(``transformer/``, ``scheduler/``), and the trainer needs nothing else (embeddings arrive
with the trajectories), so loading, LoRA, transitions, reference and export are SD3's.
"""

from __future__ import annotations

from omnirl.models.registry import register_training_adapter
from omnirl.models.sd3.training_adapter import SD3TrainingAdapter
from omnirl.models.shapes_t2i.pipeline import ARCHITECTURE


@register_training_adapter(ARCHITECTURE)
class ShapesT2ITrainingAdapter(SD3TrainingAdapter):
    """The ShapesT2I transformer as a policy over recorded transitions."""

    architecture = ARCHITECTURE
