"""Reward functions by name: ``get_scorer("jpeg_compressibility")(images, prompts)``."""

from omnirl.reward.scorers import jpeg
from omnirl.reward.scorers.jpeg import jpeg_compressibility, jpeg_incompressibility
from omnirl.reward.scorers.registry import (
    Scorer,
    UnknownScorer,
    available_scorers,
    get_scorer,
    register_scorer,
)

__all__ = [
    "Scorer",
    "UnknownScorer",
    "available_scorers",
    "get_scorer",
    "jpeg",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "register_scorer",
]
