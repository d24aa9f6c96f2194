"""Stable Diffusion 3 family (``StableDiffusion3Pipeline``).

Importing this package registers :class:`SD3RolloutAdapter` and :class:`SD3TrainingAdapter`
(the ``omnirl.models`` entry point ``sd3`` does exactly that, on the first registry lookup).
"""

from omnirl.models.sd3.rollout_adapter import SD3RolloutAdapter
from omnirl.models.sd3.training_adapter import SD3TrainingAdapter

__all__ = ["SD3RolloutAdapter", "SD3TrainingAdapter"]
