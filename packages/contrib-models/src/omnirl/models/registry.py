"""Model adapter registries keyed by (architecture, algorithm), and entry-point discovery.

Adapters register themselves with decorators::

    @register_rollout_adapter("StableDiffusion3Pipeline")            # every algorithm
    class SD3RolloutAdapter(DiffusionRolloutAdapter): ...

    @register_training_adapter("StableDiffusion3Pipeline", algorithms=("diffusion_dpo",))
    class SD3DPOTrainingAdapter(DiffusionTrainingAdapter): ...

A lookup tries the exact ``(architecture, algorithm)`` pair first, then
``(architecture, "*")``. The first lookup imports every module named in the entry-point
group ``omnirl.models`` (this package's own ``sd3`` included), so a third-party model family
is a package that declares such an entry point; importing :mod:`omnirl.models` itself
imports nothing and registers nothing.

``architecture_of(path)`` reads the dispatch key of a model folder: diffusers
``model_index.json``'s ``_class_name``, else transformers ``config.json``'s
``architectures[0]``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, TypeVar

ENTRY_POINT_GROUP = "omnirl.models"
ANY_ALGORITHM = "*"

log = logging.getLogger(__name__)

T = TypeVar("T", bound=type)

# (architecture, algorithm) -> adapter class. Filled only by the decorators below.
_TRAINING: dict[tuple[str, str], type] = {}
_ROLLOUT: dict[tuple[str, str], type] = {}
_discovered: set[str] = set()  # entry-point names already imported


class UnknownAdapter(KeyError):
    """No adapter is registered for an (architecture, algorithm) pair."""

    def __init__(self, kind: str, architecture: str, algorithm: str, known: list[tuple[str, str]]):
        self.kind = kind
        self.architecture = architecture
        self.algorithm = algorithm
        self.known = known
        listing = ", ".join(f"{a}/{g}" for a, g in known) or "none"
        super().__init__(
            f"no {kind} adapter for architecture {architecture!r} and algorithm {algorithm!r}; "
            f"known (architecture/algorithm): {listing}"
        )

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class ArchitectureNotFound(FileNotFoundError):
    """A model folder has neither a usable ``model_index.json`` nor ``config.json``."""


class DuplicateAdapter(ValueError):
    """Two different classes registered for the same (architecture, algorithm) pair."""


def _register(table: dict[tuple[str, str], type], kind: str, architecture: str, algorithms):
    if isinstance(algorithms, str):
        algorithms = (algorithms,)

    def decorator(cls: T) -> T:
        for algorithm in algorithms:
            key = (architecture, algorithm)
            old = table.get(key)
            # Re-importing the same module (e.g. importlib.reload) re-registers the same name.
            if old is not None and old.__qualname__ != cls.__qualname__:
                raise DuplicateAdapter(
                    f"{kind} adapter for {architecture}/{algorithm} already registered: "
                    f"{old.__module__}.{old.__qualname__}"
                )
            table[key] = cls
        return cls

    return decorator


def register_training_adapter(
    architecture: str, algorithms: tuple[str, ...] | str = (ANY_ALGORITHM,)
) -> Callable[[T], T]:
    """Class decorator: register a training adapter for ``architecture`` and ``algorithms``."""
    return _register(_TRAINING, "training", architecture, algorithms)


def register_rollout_adapter(
    architecture: str, algorithms: tuple[str, ...] | str = (ANY_ALGORITHM,)
) -> Callable[[T], T]:
    """Class decorator: register a rollout adapter for ``architecture`` and ``algorithms``."""
    return _register(_ROLLOUT, "rollout", architecture, algorithms)


def discover() -> None:
    """Import every not-yet-imported module of the entry-point group ``omnirl.models``.

    A module that fails to import is logged and skipped, so one broken third-party family
    does not take the others down; its architectures then show up as unknown.
    """
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _discovered:
            continue
        _discovered.add(ep.name)
        try:
            ep.load()
        except Exception:
            log.exception("omnirl.models entry point %r (%s) failed to import", ep.name, ep.value)


def _lookup(table, kind: str, architecture: str, algorithm: str) -> type:
    discover()
    for key in ((architecture, algorithm), (architecture, ANY_ALGORITHM)):
        if key in table:
            return table[key]
    raise UnknownAdapter(kind, architecture, algorithm, sorted(table))


def get_training_adapter(architecture: str, algorithm: str = ANY_ALGORITHM) -> type:
    """The training adapter class for ``(architecture, algorithm)``, else ``(architecture, "*")``.

    Raises :class:`UnknownAdapter` (a ``KeyError``) listing the registered keys.
    """
    return _lookup(_TRAINING, "training", architecture, algorithm)


def get_rollout_adapter(architecture: str, algorithm: str = ANY_ALGORITHM) -> type:
    """The rollout adapter class for ``(architecture, algorithm)``, else ``(architecture, "*")``.

    Raises :class:`UnknownAdapter` (a ``KeyError``) listing the registered keys.
    """
    return _lookup(_ROLLOUT, "rollout", architecture, algorithm)


def known_adapters() -> dict[str, list[tuple[str, str]]]:
    """Registered keys after discovery: ``{"training": [...], "rollout": [...]}``."""
    discover()
    return {"training": sorted(_TRAINING), "rollout": sorted(_ROLLOUT)}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ArchitectureNotFound(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ArchitectureNotFound(f"{path} does not hold a JSON object")
    return data


def architecture_of(path: str | Path) -> str:
    """The registry key of the model folder at ``path``.

    diffusers pipelines: ``model_index.json``'s ``_class_name``; transformers models:
    ``config.json``'s ``architectures[0]``. Raises :class:`ArchitectureNotFound` naming the
    files it looked for when neither gives a key.
    """
    root = Path(path)
    if not root.is_dir():
        raise ArchitectureNotFound(f"model path {str(root)!r} is not a directory")
    index = root / "model_index.json"
    if index.is_file():
        name = _read_json(index).get("_class_name")
        if not isinstance(name, str) or not name:
            raise ArchitectureNotFound(f"{index} has no string '_class_name'")
        return name
    config = root / "config.json"
    if config.is_file():
        archs = _read_json(config).get("architectures")
        if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
            raise ArchitectureNotFound(f"{config} has no non-empty 'architectures' list")
        return archs[0]
    raise ArchitectureNotFound(
        f"{str(root)!r} has neither model_index.json (diffusers) nor config.json (transformers)"
    )
