"""Score trajectory groups with a weighted set of named rewards, building their :class:`Rewards`.

Pure functions, no sockets: :mod:`omnirl.reward.worker` calls them on decoded groups.

A *spec* names the rewards and their weights, comma-separated::

    NAME[.COMPONENT][(KEY=VALUE;KEY=VALUE)][:WEIGHT]
    "jpeg_compressibility"                       one reward, weight 1
    "ocr:1.0,aesthetic(model=/m/clip;head=/m/head.safetensors):0.1"
    "shapes_eval.strict:1,shapes_eval.partial:0.5"   two components of one reward

A bare ``NAME`` weights the reward's primary (first) component; components not named get
weight 0 and are still logged. Logged component keys are ``NAME`` for a reward whose single
component is named like it, else ``NAME.COMPONENT``.

Failure is per group: a reward that raises, or returns a non-finite or wrongly-sized result,
makes that group's result a :class:`ScoringError` naming the group and the reward (the worker
turns it into a ``Refusal``), never a silent 0; the other groups of the batch are unaffected.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from omnirl.protocol.messages import DiffusionTrajectoryGroup, Rewards
from omnirl.reward.scorers import build_reward
from omnirl.reward.scorers.jpeg import as_uint8_batch
from omnirl.reward.scorers.registry import Reward, ScoreBatch


class ScoringError(ValueError):
    """A group could not be scored; the message says why (and names the group)."""


class ScorerSpecError(ValueError):
    """A ``--scorer`` specification that cannot be parsed."""


@dataclass(slots=True)
class WeightedScorer:
    """One built reward of a spec and the weight of each of its logged components."""

    name: str
    reward: Reward
    weights: dict[str, float] = field(default_factory=dict)  # logged key -> weight

    @property
    def weight(self) -> float:  # the primary component's weight
        return self.weights[self.key(self.reward.components[0])]

    def key(self, component: str) -> str:
        if self.reward.components == (self.name,):
            return self.name
        return f"{self.name}.{component}"


# ---------------------------------------------------------------------------------- specs


def _split_top_level(spec: str) -> list[str]:
    parts, depth, current = [], 0, []
    for ch in spec:
        depth += ch == "("
        depth -= ch == ")"
        if depth < 0:
            raise ScorerSpecError(f"unbalanced ')' in {spec!r}")
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth:
        raise ScorerSpecError(f"unbalanced '(' in {spec!r}")
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


def _parse_value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def _parse_part(part: str) -> tuple[str, str | None, dict[str, Any], float]:
    options: dict[str, Any] = {}
    head, weight_text = part, ""
    if "(" in part:
        head, _, rest = part.partition("(")
        opts_text, _, tail = rest.rpartition(")")
        if tail and not tail.startswith(":"):
            raise ScorerSpecError(f"scorer {part!r}: unexpected {tail!r} after the options")
        weight_text = tail[1:]
        for item in (i.strip() for i in opts_text.split(";")):
            if not item:
                continue
            key, eq, value = item.partition("=")
            if not eq or not key.strip():
                raise ScorerSpecError(f"scorer {part!r}: option {item!r} is not KEY=VALUE")
            options[key.strip()] = _parse_value(value.strip())
    else:
        head, _, weight_text = part.partition(":")
    name, _, component = head.strip().partition(".")
    try:
        weight = float(weight_text) if weight_text else 1.0
    except ValueError:
        raise ScorerSpecError(f"scorer {part!r}: weight {weight_text!r} is not a number") from None
    if not math.isfinite(weight):
        raise ScorerSpecError(f"scorer {part!r}: weight must be finite")
    if not name:
        raise ScorerSpecError(f"scorer {part!r}: no name")
    return name, component or None, options, weight


def parse_scorer_spec(spec: str) -> list[WeightedScorer]:
    """Parse ``spec`` (grammar above) and build each named reward once, with its options.

    Raises :class:`ScorerSpecError`, ``UnknownScorer`` or ``RewardOptionError``.
    """
    built: dict[str, tuple[dict[str, Any], WeightedScorer]] = {}
    seen: set[str] = set()
    for part in _split_top_level(spec):
        name, component, options, weight = _parse_part(part)
        if name in built:
            known_options, scorer = built[name]
            if options and options != known_options:
                raise ScorerSpecError(f"reward {name!r} is given two different option sets")
        else:
            reward = build_reward(name, **options)
            scorer = WeightedScorer(name, reward)
            scorer.weights = {scorer.key(c): 0.0 for c in reward.components}
            built[name] = (options, scorer)
        component = component or scorer.reward.components[0]
        if component not in scorer.reward.components:
            raise ScorerSpecError(
                f"reward {name!r} has no component {component!r}; "
                f"it has {list(scorer.reward.components)}"
            )
        key = scorer.key(component)
        if key in seen:
            raise ScorerSpecError(f"a scorer is named twice in {spec!r}: {key}")
        seen.add(key)
        scorer.weights[key] = weight
    if not built:
        raise ScorerSpecError(f"no scorer named in {spec!r}")
    return [scorer for _, scorer in built.values()]


# -------------------------------------------------------------------------------- scoring


def _check(values: Mapping[str, Sequence[float]], scorer: WeightedScorer, n: int) -> dict:
    """The reward's output as ``{component: float64 [n]}``; raises ValueError naming the problem."""
    if not isinstance(values, Mapping):
        raise ValueError(f"returned {type(values).__name__}, not a mapping of components")
    out = {}
    for component in scorer.reward.components:
        if component not in values:
            raise ValueError(f"did not return its component {component!r}")
        arr = np.asarray(values[component], dtype=np.float64).reshape(-1)
        if arr.shape[0] != n:
            raise ValueError(f"returned {arr.shape[0]} values of {component!r} for {n} images")
        out[component] = arr
    return out


def _group_inputs(group: DiffusionTrajectoryGroup, needs_images: bool) -> ScoreBatch:
    if needs_images and group.images is None:
        raise ScoringError(f"group {group.group_id}: no images to score")
    images = as_uint8_batch(group.images) if group.images is not None else None
    num = int(images.shape[0]) if images is not None else int(group.seeds.shape[0])
    return ScoreBatch(images, [group.prompt.text] * num, [group.prompt.metadata] * num)


def _concat(batches: list[ScoreBatch]) -> ScoreBatch:
    if len(batches) == 1:
        return batches[0]
    images = None
    if batches[0].images is not None:
        images = np.concatenate([b.images for b in batches])
    return ScoreBatch(
        images,
        [p for b in batches for p in b.prompts],
        [m for b in batches for m in b.metadata],
    )


def _chunks(batches: list[ScoreBatch], scorer: WeightedScorer, workers: int) -> list[list[int]]:
    """Group indices scored by one call: whole groups, same image shape, <= ``workers`` calls."""
    if not scorer.reward.batchable:
        return [[i] for i in range(len(batches))]

    def shape(i: int) -> tuple | None:
        images = batches[i].images
        return None if images is None else images.shape[1:]

    runs: list[list[int]] = []
    for i in range(len(batches)):
        if runs and shape(runs[-1][0]) == shape(i):
            runs[-1].append(i)
        else:
            runs.append([i])
    if workers <= 1 or not scorer.reward.thread_safe:
        return runs
    per_call = max(1, math.ceil(len(batches) / workers))
    return [run[k : k + per_call] for run in runs for k in range(0, len(run), per_call)]


def _score_chunk(scorer: WeightedScorer, batches: list[ScoreBatch], idx: list[int]) -> dict:
    """``{group index: {component: values} | error text}`` for the groups of one call."""
    batch = _concat([batches[i] for i in idx])
    if "images" not in scorer.reward.reads:
        batch = ScoreBatch(None, batch.prompts, batch.metadata)
    try:
        values = _check(scorer.reward(batch), scorer, len(batch))
    except Exception as exc:  # a scorer bug must not take the worker down
        if len(idx) > 1:  # find which group it was: score them one by one
            out = {}
            for i in idx:
                out.update(_score_chunk(scorer, batches, [i]))
            return out
        return {idx[0]: f"scorer {scorer.name} failed: {type(exc).__name__}: {exc}"}
    out, start = {}, 0
    for i in idx:
        n = len(batches[i])
        out[i] = {c: v[start : start + n] for c, v in values.items()}
        start += n
    return out


def score_groups(
    groups: list[DiffusionTrajectoryGroup],
    scorers: list[WeightedScorer],
    *,
    scorer_id: str,
    pool: Executor | None = None,
    workers: int = 1,
) -> list[Rewards | ScoringError]:
    """Score several groups together: per group, its :class:`Rewards` or a :class:`ScoringError`.

    Each reward is called on the samples of several groups at once where it is
    ``batchable``, split into up to ``workers`` calls run on ``pool`` where it is
    ``thread_safe``. ``total[i] = sum_k weight_k * component_k[i]``.
    """
    needs_images = any("images" in s.reward.reads for s in scorers)
    results: list[Rewards | ScoringError | None] = [None] * len(groups)
    batches: list[ScoreBatch] = []
    live: list[int] = []  # indices into ``groups`` of the groups in ``batches``
    for g, group in enumerate(groups):
        try:
            batches.append(_group_inputs(group, needs_images))
            live.append(g)
        except (ScoringError, ValueError) as exc:
            results[g] = (
                exc
                if isinstance(exc, ScoringError)
                else ScoringError(f"group {group.group_id}: {exc}")
            )
    per_scorer: list[dict] = []
    for scorer in scorers:
        chunks = _chunks(batches, scorer, workers if pool is not None else 1)
        merged: dict = {}
        if pool is not None and scorer.reward.thread_safe and len(chunks) > 1:
            for part in pool.map(partial(_score_chunk, scorer, batches), chunks):
                merged.update(part)
        else:
            for idx in chunks:
                merged.update(_score_chunk(scorer, batches, idx))
        per_scorer.append(merged)
    for b, g in enumerate(live):
        results[g] = _assemble(
            groups[g], len(batches[b]), scorers, [m[b] for m in per_scorer], scorer_id
        )
    return results  # type: ignore[return-value]


def _assemble(group, num, scorers, outputs, scorer_id) -> Rewards | ScoringError:
    components: dict[str, list[float]] = {}
    weights: dict[str, float] = {}
    for scorer, values in zip(scorers, outputs, strict=True):
        if isinstance(values, str):
            return ScoringError(f"group {group.group_id}: {values}")
        for component, arr in values.items():
            bad = np.flatnonzero(~np.isfinite(arr)).tolist()
            if bad:
                return ScoringError(
                    f"group {group.group_id}: scorer {scorer.name} returned non-finite "
                    f"{component!r} rewards for samples {bad}"
                )
            key = scorer.key(component)
            components[key] = arr.tolist()
            weights[key] = scorer.weights[key]
    total = [sum(weights[k] * components[k][i] for k in components) for i in range(num)]
    return Rewards(
        group_id=group.group_id,
        total=total,
        components=components,
        weights=weights,
        scorer=scorer_id,
    )


def score_group(
    group: DiffusionTrajectoryGroup, scorers: list[WeightedScorer], *, scorer_id: str
) -> Rewards:
    """Rewards of one group (see :func:`score_groups`); raises :class:`ScoringError`."""
    result = score_groups([group], scorers, scorer_id=scorer_id)[0]
    if isinstance(result, ScoringError):
        raise result
    return result
