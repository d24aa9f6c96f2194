"""Reward functions by name: ``build_reward("ocr")`` or ``get_scorer("jpeg_compressibility")``.

Importing this package registers the rewards that need no optional weights (JPEG, OCR,
CLIP-family loaders, the remote judge); building a model-based one loads its weights.
"""

from omnirl.reward.scorers import aesthetic, clip_score, jpeg, ocr, pickscore, remote_judge, shapes
from omnirl.reward.scorers.jpeg import jpeg_compressibility, jpeg_incompressibility
from omnirl.reward.scorers.registry import (
    READABLE,
    FunctionReward,
    Reward,
    RewardOptionError,
    ScoreBatch,
    Scorer,
    UnknownScorer,
    available_scorers,
    build_reward,
    get_scorer,
    register_reward,
    register_scorer,
)

__all__ = [
    "READABLE",
    "FunctionReward",
    "Reward",
    "RewardOptionError",
    "ScoreBatch",
    "Scorer",
    "UnknownScorer",
    "aesthetic",
    "available_scorers",
    "build_reward",
    "clip_score",
    "get_scorer",
    "jpeg",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "ocr",
    "pickscore",
    "register_reward",
    "register_scorer",
    "remote_judge",
    "shapes",
]
