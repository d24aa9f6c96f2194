"""The scorer registry: reward functions by name.

A scorer is a callable ``scorer(images, prompts) -> list[float]``, one finite float per
image of the group (``images`` uint8 ``[G, H, W, 3]``, ``prompts`` the group's prompt
repeated or ``None``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Scorer = Callable[[Any, "list[str] | None"], list[float]]

_SCORERS: dict[str, Scorer] = {}


class UnknownScorer(KeyError):
    """No scorer of that name; the message lists the names there are."""

    def __str__(self) -> str:
        return str(self.args[0])


def register_scorer(name: str) -> Callable[[Scorer], Scorer]:
    """Decorator: register ``fn`` under ``name`` (a second registration of a name is an error)."""

    def decorate(fn: Scorer) -> Scorer:
        if name in _SCORERS and _SCORERS[name] is not fn:
            raise ValueError(f"scorer {name!r} is already registered")
        _SCORERS[name] = fn
        return fn

    return decorate


def available_scorers() -> list[str]:
    return sorted(_SCORERS)


def get_scorer(name: str) -> Scorer:
    """The scorer registered as ``name``; :class:`UnknownScorer` lists the known names."""
    try:
        return _SCORERS[name]
    except KeyError:
        raise UnknownScorer(
            f"unknown scorer {name!r}; known scorers: {', '.join(available_scorers()) or '(none)'}"
        ) from None
