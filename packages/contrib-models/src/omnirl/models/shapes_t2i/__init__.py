"""ShapesT2I: a small text-to-image model for ShapesEval (``ShapesT2IPipeline``), over pixels
or over the latents of a tiny VAE.

Importing this package registers :class:`ShapesT2IRolloutAdapter` and
:class:`ShapesT2ITrainingAdapter` (the ``omnirl.models`` entry point ``shapes_t2i``).
"""

from omnirl.models.shapes_t2i.pipeline import (
    ARCHITECTURE,
    PRESETS,
    ShapesT2IConfig,
    ShapesT2IPipeline,
    build_pipeline,
    decode_images,
    encode_images,
)
from omnirl.models.shapes_t2i.rollout_adapter import ShapesT2IRolloutAdapter
from omnirl.models.shapes_t2i.training_adapter import ShapesT2ITrainingAdapter

__all__ = [
    "ARCHITECTURE",
    "PRESETS",
    "ShapesT2IConfig",
    "ShapesT2IPipeline",
    "ShapesT2IRolloutAdapter",
    "ShapesT2ITrainingAdapter",
    "build_pipeline",
    "decode_images",
    "encode_images",
]
