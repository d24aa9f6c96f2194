"""Score one trajectory group: read its images, build its named :class:`Rewards`.

Pure functions, no sockets: :mod:`omnirl.reward.worker` calls them on decoded groups.
A scorer that raises or returns a non-finite or wrongly-sized result makes
:func:`score_group` raise :class:`ScoringError` with the reason; the worker turns that
into a ``Refusal`` on the intake, never a silent 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from omnirl.protocol.messages import DiffusionTrajectoryGroup, Rewards
from omnirl.reward.scorers import Scorer, get_scorer


class ScoringError(ValueError):
    """A group could not be scored; the message says why (and names the group)."""


class ScorerSpecError(ValueError):
    """A ``--scorer`` specification that cannot be parsed."""


@dataclass(frozen=True, slots=True)
class WeightedScorer:
    name: str
    weight: float
    fn: Scorer


def parse_scorer_spec(spec: str) -> list[WeightedScorer]:
    """``"jpeg_compressibility"`` or ``"a:1.0,b:0.5"`` -> scorers with weights (default 1)."""
    scorers = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        name, _, weight_text = part.partition(":")
        try:
            weight = float(weight_text) if weight_text else 1.0
        except ValueError:
            raise ScorerSpecError(
                f"scorer {part!r}: weight {weight_text!r} is not a number"
            ) from None
        if not math.isfinite(weight):
            raise ScorerSpecError(f"scorer {part!r}: weight must be finite")
        scorers.append(WeightedScorer(name, weight, get_scorer(name)))
    if not scorers:
        raise ScorerSpecError(f"no scorer named in {spec!r}")
    if len({s.name for s in scorers}) != len(scorers):
        raise ScorerSpecError(f"a scorer is named twice in {spec!r}")
    return scorers


def score_group(
    group: DiffusionTrajectoryGroup, scorers: list[WeightedScorer], *, scorer_id: str
) -> Rewards:
    """Rewards of ``group`` from its ``images`` (uint8 ``[G, H, W, 3]``) only.

    ``total[i] = sum_k weight_k * component_k[i]``. Raises :class:`ScoringError`.
    """
    if group.images is None:
        raise ScoringError(f"group {group.group_id}: no images to score")
    num = int(group.images.shape[0])
    prompts = [group.prompt.text] * num
    components: dict[str, list[float]] = {}
    for scorer in scorers:
        try:
            values = [float(v) for v in scorer.fn(group.images, prompts)]
        except Exception as exc:  # a scorer bug must not take the worker down
            raise ScoringError(
                f"group {group.group_id}: scorer {scorer.name} failed: {type(exc).__name__}: {exc}"
            ) from exc
        if len(values) != num:
            raise ScoringError(
                f"group {group.group_id}: scorer {scorer.name} returned {len(values)} "
                f"values for {num} images"
            )
        bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
        if bad:
            raise ScoringError(
                f"group {group.group_id}: scorer {scorer.name} returned non-finite rewards "
                f"for samples {bad}"
            )
        components[scorer.name] = values
    weights = {s.name: s.weight for s in scorers}
    total = [sum(weights[name] * components[name][i] for name in components) for i in range(num)]
    return Rewards(
        group_id=group.group_id,
        total=total,
        components=components,
        weights=weights,
        scorer=scorer_id,
    )
