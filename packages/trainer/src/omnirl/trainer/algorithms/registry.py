"""Algorithm, advantage-estimator and loss registries.

One config key, ``algorithm: NAME``, selects an :class:`AlgorithmSpec`; the spec names
its SDE variant, its advantage estimator and its loss (looked up in their own
registries), the key under which model families register their adapters, and its default
hyper-parameters. Algorithms that differ only in a part reuse the other parts by name
(:func:`register_alias`), never by copying code.

The registries are plain dicts filled by decorators when the module that defines an
entry is imported. Nothing is imported when this module is: the built-in modules
(:data:`BUILTIN_MODULES`) and the ``omnirl.algorithms`` entry points of third-party
packages are imported on the first lookup.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from types import MappingProxyType
from typing import Any, Generic, TypeVar

BUILTIN_MODULES: tuple[str, ...] = (
    "omnirl.trainer.algorithms.advantages",
    "omnirl.trainer.algorithms.flow_grpo",
    "omnirl.trainer.algorithms.windows",
    "omnirl.trainer.algorithms.dance_grpo",
    "omnirl.trainer.algorithms.grpo_guard",
    "omnirl.trainer.algorithms.flow_dppo",
    "omnirl.trainer.algorithms.diffusion_nft",
    "omnirl.trainer.algorithms.diffusion_dpo",
)
ENTRY_POINT_GROUP = "omnirl.algorithms"

SDE_TYPES = ("sde", "cps", "dance_sde", "ode")

T = TypeVar("T")


class UnknownNameError(LookupError):
    """A registry lookup for a name nobody registered; the message lists the known names."""

    def __init__(self, kind: str, name: str, known: Iterable[str], plural: str = "") -> None:
        self.kind, self.name, self.known = kind, name, sorted(known)
        listed = ", ".join(self.known) or "(none)"
        super().__init__(f"unknown {kind} {name!r}; known {plural or kind + 's'}: {listed}")


class DuplicateNameError(ValueError):
    """Two different entries registered under one name."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AlgorithmSpec:
    """Everything one ``algorithm`` key selects.

    Attributes:
        name: the config key.
        sde_type: SDE step variant of the scheduler (``"sde"``, ``"cps"``, ``"dance_sde"``).
        advantage: name in the advantage registry.
        loss: name in the loss registry.
        adapter_algorithm: the algorithm key model families register their
            (architecture, algorithm) adapters under; aliases usually share their base's.
        needs_log_probs: whether rollout must record per-step latents and log-probs.
        defaults: trainer hyper-parameters (field names of ``TrainStep.Config``).
        sampling_defaults: sampling parameters (field names of ``SamplingParams``).
        alias_of: the algorithm this one was derived from, if any.
        description: one line for people; say where it comes from.
        window_policy: name of the SDE window policy the lease builder asks for each
            lease's ``sde_window`` (:mod:`omnirl.trainer.algorithms.windows`); ``None``:
            every step stochastic unless the config sets a window.
    """

    name: str
    sde_type: str
    advantage: str
    loss: str
    adapter_algorithm: str
    needs_log_probs: bool = True
    defaults: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    sampling_defaults: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    alias_of: str | None = None
    description: str = ""
    window_policy: str | None = None

    def __post_init__(self) -> None:
        if self.sde_type not in SDE_TYPES:
            raise ValueError(
                f"algorithm {self.name!r}: sde_type {self.sde_type!r} is not one of {SDE_TYPES}"
            )
        # Freeze the mappings so that a spec cannot be edited after registration.
        object.__setattr__(self, "defaults", MappingProxyType(dict(self.defaults)))
        object.__setattr__(
            self, "sampling_defaults", MappingProxyType(dict(self.sampling_defaults))
        )


class _Registry(Generic[T]):
    """A name -> entry dict that loads the built-ins before its first lookup."""

    def __init__(self, kind: str, plural: str = "") -> None:
        self.kind = kind
        self.plural = plural or kind + "s"
        self.entries: dict[str, T] = {}

    def add(self, name: str, entry: T) -> T:
        existing = self.entries.get(name)
        if existing is not None and not _same_entry(existing, entry):
            raise DuplicateNameError(f"{self.kind} {name!r} is already registered as {existing!r}")
        self.entries[name] = entry
        return entry

    def get(self, name: str) -> T:
        _load_builtins()
        try:
            return self.entries[name]
        except KeyError:
            raise UnknownNameError(self.kind, name, self.entries, self.plural) from None

    def names(self) -> list[str]:
        _load_builtins()
        return sorted(self.entries)


def _same_entry(a: Any, b: Any) -> bool:
    """Equal specs, or the same function / class defined again (a module re-imported)."""
    if a is b or (isinstance(a, AlgorithmSpec) and a == b):
        return True
    if not (isinstance(a, type) or callable(a)) or isinstance(a, AlgorithmSpec):
        return False
    key_a = (getattr(a, "__module__", None), getattr(a, "__qualname__", None))
    key_b = (getattr(b, "__module__", None), getattr(b, "__qualname__", None))
    return None not in key_a and key_a == key_b


_ALGORITHMS: _Registry[AlgorithmSpec] = _Registry("algorithm")
_ADVANTAGES: _Registry[Callable[..., Any]] = _Registry("advantage estimator")
_LOSSES: _Registry[type] = _Registry("loss", "losses")
_LOADED: dict[str, bool] = {"builtins": False}


def _load_builtins() -> None:
    if _LOADED["builtins"]:
        return
    # Set first: the modules imported below register through this module.
    _LOADED["builtins"] = True
    for module in BUILTIN_MODULES:
        importlib.import_module(module)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        ep.load()


# ---------------------------------------------------------------------------- registration


def register_algorithm(spec: AlgorithmSpec) -> AlgorithmSpec:
    """Register ``spec`` under ``spec.name`` and return it."""
    return _ALGORITHMS.add(spec.name, spec)


def register_alias(name: str, *, of: str, description: str = "", **overrides: Any) -> AlgorithmSpec:
    """Register algorithm ``name`` as ``of`` with some parts replaced.

    ``defaults`` and ``sampling_defaults`` given here are merged over the base's; every other
    override replaces the base's field. The base must be registered already.
    """
    base = _ALGORITHMS.entries.get(of)
    if base is None:
        raise UnknownNameError("algorithm", of, _ALGORITHMS.entries)
    fields = {f.name for f in dataclasses.fields(AlgorithmSpec)}
    bad = sorted(set(overrides) - fields)
    if bad:
        raise TypeError(f"register_alias({name!r}): unknown AlgorithmSpec fields {bad}")
    overrides["defaults"] = {**base.defaults, **overrides.get("defaults", {})}
    overrides["sampling_defaults"] = {
        **base.sampling_defaults,
        **overrides.get("sampling_defaults", {}),
    }
    spec = dataclasses.replace(
        base, name=name, alias_of=of, description=description or base.description, **overrides
    )
    return register_algorithm(spec)


def register_advantage(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register an advantage estimator ``fn(rewards, **hparams) -> AdvantageResult``."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        return _ADVANTAGES.add(name, fn)

    return deco


def register_loss(name: str) -> Callable[[type], type]:
    """Decorator: register a loss class (with a nested ``Config``, ``needs()``, ``__call__``)."""

    def deco(cls: type) -> type:
        return _LOSSES.add(name, cls)

    return deco


# --------------------------------------------------------------------------------- lookup


def get_algorithm(name: str) -> AlgorithmSpec:
    """The spec registered as ``name``; :class:`UnknownNameError` lists the known ones."""
    return _ALGORITHMS.get(name)


def get_advantage(name: str) -> Callable[..., Any]:
    return _ADVANTAGES.get(name)


def get_loss(name: str) -> type:
    return _LOSSES.get(name)


def build_loss(spec: AlgorithmSpec, config: Any) -> Any:
    """``spec``'s registered loss; its ``Config`` takes the fields it declares from
    ``config`` (a resolved ``TrainStep.Config``: DPPO's has no clip range, for example)."""
    loss_cls = get_loss(spec.loss)
    declared = {f.name for f in dataclasses.fields(loss_cls.Config)}
    return loss_cls(
        loss_cls.Config(**{n: getattr(config, n) for n in declared if hasattr(config, n)})
    )


def needs_reference_pass(spec: AlgorithmSpec, loss: Any) -> bool:
    """Whether ``loss`` (``spec``'s, from :func:`build_loss`) has a KL term to the reference
    model, i.e. whether a step runs the reference pass. Needs no model, so a config can be
    checked before one loads."""
    if not spec.needs_log_probs:  # forward-process losses (omnirl.trainer.forward_step)
        return loss.needs_reference()
    from omnirl.trainer.algorithms.flow_grpo import REF_PREV_SAMPLE_MEAN

    return REF_PREV_SAMPLE_MEAN in loss.needs()


def known_algorithms() -> list[str]:
    return _ALGORITHMS.names()


def known_advantages() -> list[str]:
    return _ADVANTAGES.names()


def known_losses() -> list[str]:
    return _LOSSES.names()
