"""SDE window policies: which steps of a lease's trajectories are stochastic and trained.

A :class:`WindowPolicy` turns ``(seed, optimisation step, num_steps)`` into one window
``(start, end)`` (half-open step indices, the convention of ``SamplingParams.sde_window``).
The lease builder calls it once per lease with the lease's seed, so every sample of every
prompt of the lease shares one window: per-sample windows inside a group inflate reward
variance (verl-omni measured about 4x) and collapse training.

Schedules:

- ``"random"`` (Flow-GRPO-Fast, flow_grpo ``scripts/train_sd3_fast.py``): the start is drawn
  uniformly from ``[lo, hi - size]`` of ``window_range`` by the seed alone
  (:func:`~omnirl.models.schedulers.window.random_window`); defaults size 2, range (0, 5).
- ``"progressive"`` (MixGRPO, Li et al. 2025, ``fastvideo/utils/grpo_states.py``): the
  window starts at ``lo`` and slides right by ``stride`` steps every ``shift_interval``
  optimisation steps; past the end of the range it stays at the last position
  (``roll_back=False``) or starts again at ``lo`` (``roll_back=True``). MixGRPO's script:
  size 4, every 25 iterations, stride 1, roll back. Unlike MixGRPO's, our window keeps its
  size at the end of the range (every lease records the same number of steps).

Policies are registered by name (:func:`register_window_policy`) and an algorithm names
its policy in ``AlgorithmSpec.window_policy``; :func:`lease_window` is what the lease
builder calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from omnirl.protocol.messages import DiffusionTrajectoryGroup, SamplingParams

SCHEDULES = ("random", "progressive")


def check_window(num_steps: int, window: tuple[int, int] | list[int] | None) -> tuple[int, int]:
    """``window`` as ``(start, end)`` with ``0 <= start < end <= num_steps`` (``None``: all).

    The same rule as :func:`omnirl.models.schedulers.window.check_window`, kept here so that
    building a lease does not import the model stack (diffusers).
    """
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive int, got {num_steps!r}")
    if window is None:
        return 0, num_steps
    try:
        start, end = (int(v) for v in window)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"sde_window must be (start, end), got {window!r}") from exc
    if not 0 <= start < end <= num_steps:
        raise ValueError(
            f"sde_window {window!r} must satisfy 0 <= start < end <= num_steps ({num_steps})"
        )
    return start, end


@dataclass(frozen=True, kw_only=True, slots=True)
class WindowPolicy:
    """How an algorithm places its SDE window.

    Attributes:
        name: registry key.
        size: window length in steps.
        schedule: ``"random"`` or ``"progressive"`` (see the module docstring).
        window_range: ``(lo, hi)`` the window must stay inside; ``None`` = all steps.
        shift_interval: progressive only: optimisation steps per move.
        stride: progressive only: steps moved each time.
        roll_back: progressive only: restart at ``lo`` after the end of the range.
    """

    name: str
    size: int
    schedule: str
    window_range: tuple[int, int] | None = None
    shift_interval: int = 25
    stride: int = 1
    roll_back: bool = False

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"window policy {self.name!r}: schedule must be one of {SCHEDULES}")
        if not (isinstance(self.size, int) and self.size >= 1):
            raise ValueError(f"window policy {self.name!r}: size must be an int >= 1")
        if self.shift_interval < 1 or self.stride < 1:
            raise ValueError(f"window policy {self.name!r}: shift_interval and stride must be >= 1")

    def window(self, *, seed: int, step: int, num_steps: int) -> tuple[int, int]:
        """The window of a lease with ``seed`` issued at optimisation step ``step``."""
        rng = self.window_range
        if rng is not None:  # a range written for more steps than this schedule has
            rng = (min(rng[0], num_steps - 1), min(rng[1], num_steps))
        lo, hi = check_window(num_steps, rng)
        size = min(self.size, hi - lo)
        if self.schedule == "random":
            from omnirl.models.schedulers.window import random_window  # one seeded draw

            return random_window(seed, num_steps, size, (lo, hi))
        if step < 0:
            raise ValueError(f"optimisation step must be >= 0, got {step}")
        positions = (hi - lo - size) // self.stride + 1  # distinct starts inside the range
        move = step // self.shift_interval
        move = move % positions if self.roll_back else min(move, positions - 1)
        start = lo + move * self.stride
        return start, start + size


_POLICIES: dict[str, WindowPolicy] = {}


def register_window_policy(policy: WindowPolicy) -> WindowPolicy:
    existing = _POLICIES.get(policy.name)
    if existing is not None and existing != policy:
        raise ValueError(f"window policy {policy.name!r} is already registered as {existing!r}")
    _POLICIES[policy.name] = policy
    return policy


def get_window_policy(name: str) -> WindowPolicy:
    try:
        return _POLICIES[name]
    except KeyError:
        raise LookupError(
            f"unknown window policy {name!r}; known: {', '.join(sorted(_POLICIES)) or '(none)'}"
        ) from None


def lease_window(
    policy: str | None,
    *,
    seed: int,
    step: int,
    num_steps: int,
    configured: tuple[int, int] | list[int] | None = None,
) -> tuple[int, int] | None:
    """The ``sde_window`` a lease carries.

    A window set in the config (``sampling.sde_window``) wins; otherwise the algorithm's
    policy (``AlgorithmSpec.window_policy``, a registered name) places it; an algorithm
    without a policy samples every step stochastically (``None``).
    """
    if configured is not None:
        return tuple(check_window(num_steps, tuple(configured)))
    if policy is None:
        return None
    return get_window_policy(policy).window(seed=seed, step=step, num_steps=num_steps)


register_window_policy(
    WindowPolicy(name="flow_grpo_fast", size=2, schedule="random", window_range=(0, 5))
)
register_window_policy(
    WindowPolicy(
        name="mix_grpo", size=4, schedule="progressive", shift_interval=25, stride=1, roll_back=True
    )
)


def _register_algorithms() -> None:
    # Imported here, not at the top: the policies above need no algorithm registry.
    from omnirl.trainer.algorithms import flow_grpo  # noqa: F401  (registers the base)
    from omnirl.trainer.algorithms.registry import register_alias

    # flow_grpo scripts/train_sd3_fast.py: FlowGRPO's estimator and loss; the window's steps
    # are the only stochastic, recorded and trained ones (timestep_fraction 1 of them).
    register_alias(
        "flow_grpo_fast",
        of="flow_grpo",
        window_policy="flow_grpo_fast",
        description="Flow-GRPO-Fast (flow_grpo train_sd3_fast.py): random SDE window per lease",
    )
    # MixGRPO (Li et al. 2025, arXiv 2507.21802): FlowGRPO's estimator (DESIGN.md) on a
    # progressive sliding window.
    register_alias(
        "mix_grpo",
        of="flow_grpo",
        window_policy="mix_grpo",
        description="MixGRPO (arXiv 2507.21802): progressive sliding SDE window, ODE elsewhere",
    )


_register_algorithms()


def window_buckets(groups: Sequence[DiffusionTrajectoryGroup]) -> list[list[int]]:
    """Indices of ``groups`` bucketed by their recorded window, first-seen order.

    Groups of different windows may be trained in one optimisation step (leases get their own
    windows; stale groups keep theirs); a model call batches only rows of one schedule step, so
    the trainer collates each bucket on its own. Raises ``ValueError`` when two groups of one
    ``num_steps`` disagree on the sigma of a step index: their recorded windows cannot both be
    right.
    """
    sigma_at: dict[tuple[int, int], float] = {}
    buckets: dict[tuple[int, ...], list[int]] = {}
    for i, g in enumerate(groups):
        if g.step_indices is None or g.sigmas is None:  # collation names what is missing
            buckets.setdefault((g.sampling.num_steps,), []).append(i)
            continue
        steps = [int(s) for s in g.step_indices.tolist()]
        sigmas = [float(s) for s in g.sigmas.tolist()]
        for step, sigma in zip(steps, sigmas, strict=True):
            seen = sigma_at.setdefault((g.sampling.num_steps, step), sigma)
            if abs(seen - sigma) > 1e-6:
                raise ValueError(
                    f"group {g.group_id!r} records sigma {sigma} at step {step}, another group "
                    f"{seen}: the groups' recorded SDE windows / schedules disagree"
                )
        buckets.setdefault((g.sampling.num_steps, *steps), []).append(i)
    return list(buckets.values())


def lease_sampling_params(cfg: Any, *, seed: int, step: int = 0) -> SamplingParams:
    """The ``SamplingParams`` of a lease the trainer of config ``cfg`` issues with ``seed``
    at optimisation step ``step``: the config's group size, schedule, guidance and size, and
    (:func:`lease_sampling`) the SDE variant, noise level, window and shared initial noise,
    the config's where set, else the algorithm's."""
    s = cfg.sampling
    return SamplingParams(
        group_size=cfg.data.group_size,
        seed=seed,
        num_steps=s.num_steps,
        guidance_scale=s.guidance_scale,
        height=s.height,
        width=s.width,
        negative_prompt=s.negative_prompt,
        record_images=s.record_images,
        **lease_sampling(
            cfg.algorithm.name,
            seed=seed,
            step=step,
            num_steps=s.num_steps,
            sde_type=s.sde_type,
            noise_level=s.noise_level,
            sde_window=s.sde_window,
            same_initial_noise=s.same_initial_noise,
        ),
    )


def lease_sampling(
    algorithm: str,
    *,
    seed: int,
    step: int,
    num_steps: int,
    sde_type: str | None = None,
    noise_level: float | None = None,
    sde_window: tuple[int, int] | list[int] | None = None,
    same_initial_noise: bool | None = None,
) -> dict[str, object]:
    """The algorithm-dependent ``SamplingParams`` fields of one lease.

    The config's values (``sampling.sde_type``, ``noise_level``, ``sde_window``,
    ``same_initial_noise``) win where set;
    otherwise the algorithm's: its SDE variant and noise level (``sampling_defaults``), its
    window policy at optimisation step ``step`` seeded by the lease ``seed``, and its
    ``same_initial_noise``. Returns keyword arguments for ``SamplingParams``.
    """
    from omnirl.trainer.algorithms.registry import get_algorithm

    spec = get_algorithm(algorithm)
    defaults = spec.sampling_defaults
    return {
        "sde_type": sde_type or spec.sde_type,
        "noise_level": float(
            noise_level if noise_level is not None else defaults.get("noise_level", 0.7)
        ),
        "sde_window": lease_window(
            spec.window_policy, seed=seed, step=step, num_steps=num_steps, configured=sde_window
        ),
        "same_initial_noise": bool(
            same_initial_noise
            if same_initial_noise is not None
            else defaults.get("same_initial_noise", False)
        ),
    }
