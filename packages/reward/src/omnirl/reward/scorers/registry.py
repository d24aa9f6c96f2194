"""The reward registry: reward functions by name, each declaring what it reads.

A **reward** is an object with

- ``components``: the names of the values it returns (``("strict", "partial")``); the first
  is its *primary* component, the one a bare ``name:weight`` in a spec weights;
- ``reads``: a subset of ``{"images", "prompt", "metadata"}``: the only inputs it is handed;
- ``batchable``: it may be called with samples of several groups at once (all rewards here
  are; a reward whose value depends on the group as a whole sets it False);
- ``thread_safe``: it may be called from several threads at once (a worker pool then
  scores chunks of a batch concurrently);
- ``__call__(batch: ScoreBatch) -> dict[str, Sequence[float]]``: one value per sample for
  every component.

Rewards are registered as *factories* ``factory(**options) -> reward`` with
:func:`register_reward`, so that a model-based reward is built (weights loaded) only when a
config names it, with its options (``model=/path``). :func:`register_scorer` keeps the
older, simpler form: a plain function ``fn(images, prompts) -> list[float]`` with one
component named like the scorer.

A reward of another package registers itself the same way in a module that the package
names in the entry-point group ``omnirl.rewards`` (``[project.entry-points."omnirl.rewards"]
my_reward = "my_package.rewards"``): the first lookup by name imports those modules, so a
spec can name it with no edit to omnirl.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Protocol

import numpy as np

log = logging.getLogger(__name__)

READABLE = frozenset({"images", "prompt", "metadata"})


@dataclass(frozen=True, slots=True)
class ScoreBatch:
    """The inputs of ``n`` samples, possibly from several groups.

    ``images``: uint8 ``[n, H, W, 3]`` (None when the reward does not read images);
    ``prompts``: n prompt texts (each group's prompt repeated for its samples);
    ``metadata``: n prompt-metadata dicts (shared, do not mutate).
    """

    images: np.ndarray | None
    prompts: list[str]
    metadata: list[Mapping[str, Any]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.prompts)

    def slice(self, start: int, stop: int) -> ScoreBatch:
        images = None if self.images is None else self.images[start:stop]
        return ScoreBatch(images, self.prompts[start:stop], self.metadata[start:stop])


class Reward(Protocol):
    components: tuple[str, ...]
    reads: frozenset[str]
    batchable: bool
    thread_safe: bool

    def __call__(self, batch: ScoreBatch) -> Mapping[str, Sequence[float]]: ...


RewardFactory = Callable[..., Reward]
Scorer = Callable[[Any, "list[str] | None"], list[float]]  # the plain-function form

ENTRY_POINT_GROUP = "omnirl.rewards"

_FACTORIES: dict[str, RewardFactory] = {}
_FUNCTIONS: dict[str, Scorer] = {}
_discovered: set[str] = set()  # entry points already imported


class UnknownScorer(KeyError):
    """No reward of that name; the message lists the names there are."""

    def __str__(self) -> str:
        return str(self.args[0])


class RewardOptionError(ValueError):
    """A reward was built with options it does not take, or with bad values."""


@dataclass(slots=True)
class FunctionReward:
    """A plain ``fn(images, prompts) -> list[float]`` as a one-component reward."""

    name: str
    fn: Scorer
    reads: frozenset[str] = frozenset({"images", "prompt"})
    batchable: bool = True
    thread_safe: bool = True
    components: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.components = (self.name,)

    def __call__(self, batch: ScoreBatch) -> dict[str, Sequence[float]]:
        return {self.name: self.fn(batch.images, batch.prompts)}


def register_reward(name: str) -> Callable[[RewardFactory], RewardFactory]:
    """Decorator: register a factory ``(**options) -> Reward`` (a class works) as ``name``."""

    def decorate(factory: RewardFactory) -> RewardFactory:
        _check_free(name, factory)
        _FACTORIES[name] = factory
        return factory

    return decorate


def register_scorer(name: str) -> Callable[[Scorer], Scorer]:
    """Decorator: register a plain ``fn(images, prompts) -> list[float]`` as ``name``."""

    def decorate(fn: Scorer) -> Scorer:
        _check_free(name, fn)
        _FUNCTIONS[name] = fn
        return fn

    return decorate


def _check_free(name: str, obj: object) -> None:
    known = _FACTORIES.get(name) or _FUNCTIONS.get(name)
    if known is not None and known is not obj:
        raise ValueError(f"reward {name!r} is already registered")


def discover() -> None:
    """Import every not-yet-imported module of the entry-point group ``omnirl.rewards``.

    A module that fails to import is logged and skipped: one broken package does not take
    the other rewards down, and its names then show up as unknown."""
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _discovered:
            continue
        _discovered.add(ep.name)
        try:
            ep.load()
        except Exception:
            log.exception("omnirl.rewards entry point %r (%s) failed to import", ep.name, ep.value)


def available_scorers() -> list[str]:
    discover()
    return sorted({*_FACTORIES, *_FUNCTIONS})


def _unknown(name: str) -> UnknownScorer:
    return UnknownScorer(
        f"unknown scorer {name!r}; known scorers: {', '.join(available_scorers()) or '(none)'}"
    )


def get_scorer(name: str) -> Scorer:
    """The plain function registered as ``name`` (rewards with options: :func:`build_reward`)."""
    discover()
    try:
        return _FUNCTIONS[name]
    except KeyError:
        raise _unknown(name) from None


def build_reward(name: str, **options: Any) -> Reward:
    """Build the reward registered as ``name`` with ``options``; validates what it declares."""
    discover()
    if name in _FUNCTIONS:
        if options:
            raise RewardOptionError(f"scorer {name!r} takes no options, got {sorted(options)}")
        return FunctionReward(name, _FUNCTIONS[name])
    if name not in _FACTORIES:
        raise _unknown(name)
    try:
        reward = _FACTORIES[name](**options)
    except TypeError as exc:
        raise RewardOptionError(f"reward {name!r}: bad options {sorted(options)}: {exc}") from exc
    unknown_reads = set(reward.reads) - READABLE
    if unknown_reads or not reward.components:
        raise RewardOptionError(
            f"reward {name!r} declares reads {sorted(reward.reads)} (known: {sorted(READABLE)}) "
            f"and components {list(reward.components)}; both must be valid and non-empty"
        )
    return reward
