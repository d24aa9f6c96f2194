"""Prompts drawn per stratum, away from strata whose groups stopped teaching anything.

A GRPO-style group whose samples all score the same has zero advantage: its rollout time is
spent and nothing is learned from it (the step skips it). Late in a run that is mostly the
easy strata (on ShapesEval, single objects and colours, whose groups of 16 all pass). With
``data.balance_by`` set to a metadata key (``category``), :class:`BalancedPromptSource`
splits the prompts into strata by that key's value and draws each prompt from stratum ``c``
with probability proportional to

    n_c * (floor + (1 - floor) * spread_c)

``n_c`` its number of prompts (so at the start, or when every group has a spread, the draw is
the dataset's own mix), ``spread_c`` the share of its last ``balance_memory`` reported groups
whose rewards were not all equal (1 before any is reported) and ``floor`` =
``data.balance_floor``, the share a stratum keeps when all its groups tie: it stays sampled,
so a stratum that starts failing again is seen. Inside a stratum prompts come in a seeded
permutation per epoch, as :class:`~omnirl.trainer.data.PromptSource` walks the whole file.

The trainer reports each group it accepts (rewards set) through :meth:`observe`. ``state_dict()`` holds the
strata's positions, their recent outcomes and the draw's generator, so a resumed run draws
the same prompts next.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from omnirl.protocol.messages import PromptSpec
from omnirl.trainer.data import DataError, EpochSampler, read_prompt_records


class _Stratum:
    """The prompts of one stratum: dataset indices, walked by an :class:`EpochSampler` (a
    seeded permutation per epoch), and whether its recent groups had a reward spread."""

    def __init__(self, indices: list[int], seed: int, memory: int):
        self.indices = indices
        self.sampler = EpochSampler(len(indices), shuffle=True, seed=seed)
        self.outcomes: deque[bool] = deque(maxlen=memory)  # True: the group had a spread

    def spread(self) -> float:
        return sum(self.outcomes) / len(self.outcomes) if self.outcomes else 1.0

    def next_index(self) -> tuple[int, int]:
        """``(epoch, dataset index)`` of the stratum's next prompt."""
        epoch, i = next(self.sampler)
        return epoch, self.indices[i]


class BalancedPromptSource:
    """``next()`` -> :class:`PromptSpec`, strata weighted by their recent reward spread."""

    def __init__(
        self,
        records: list[dict[str, Any]],
        *,
        key: str,
        floor: float = 0.2,
        memory: int = 32,
        seed: int = 0,
    ):
        if not 0.0 < floor <= 1.0:
            raise ValueError(f"balance floor must be in (0, 1], got {floor}")
        if memory < 1:
            raise ValueError(f"balance memory must be >= 1, got {memory}")
        self.records, self.key, self.floor = records, key, floor
        members: dict[str, list[int]] = {}
        for i, rec in enumerate(records):
            if key not in rec["metadata"]:
                raise DataError(
                    f"data.balance_by={key!r}: prompt {i} ({rec['prompt']!r}) has no "
                    f"metadata {key!r}"
                )
            members.setdefault(str(rec["metadata"][key]), []).append(i)
        self.names = sorted(members)
        self.strata = {
            name: _Stratum(members[name], seed * 7919 + j, memory)
            for j, name in enumerate(self.names)
        }
        self.generator = torch.Generator().manual_seed(seed)

    @classmethod
    def from_config(cls, data_cfg: Any) -> BalancedPromptSource:
        return cls(
            read_prompt_records(data_cfg.prompts),
            key=data_cfg.balance_by,
            floor=data_cfg.balance_floor,
            memory=data_cfg.balance_memory,
            seed=data_cfg.seed,
        )

    def __len__(self) -> int:
        return len(self.records)

    def weights(self) -> dict[str, float]:
        """Each stratum's probability of the next draw."""
        raw = {
            name: len(s.indices) * (self.floor + (1.0 - self.floor) * s.spread())
            for name, s in self.strata.items()
        }
        total = sum(raw.values())
        return {name: w / total for name, w in raw.items()}

    def next(self) -> PromptSpec:
        weights = self.weights()
        probs = torch.tensor([weights[n] for n in self.names], dtype=torch.float64)
        name = self.names[int(torch.multinomial(probs, 1, generator=self.generator))]
        epoch, index = self.strata[name].next_index()
        rec = self.records[index]
        return PromptSpec(
            group_id=f"e{epoch}:i{index}", text=rec["prompt"], metadata=dict(rec["metadata"])
        )

    def take(self, n: int) -> list[PromptSpec]:
        return [self.next() for _ in range(n)]

    def observe(self, prompt: PromptSpec, rewards: list[float]) -> None:
        """Record whether an accepted group of ``prompt`` had a reward spread."""
        stratum = self.strata.get(str(prompt.metadata.get(self.key)))
        if stratum is not None and rewards:
            stratum.outcomes.append(max(rewards) > min(rewards))

    def state_dict(self) -> dict[str, Any]:
        return {
            "generator": self.generator.get_state(),
            "strata": {
                name: {**s.sampler.state_dict(), "outcomes": list(s.outcomes)}
                for name, s in self.strata.items()
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "strata" not in state or set(state["strata"]) != set(self.strata):
            raise DataError(
                "the checkpoint's prompt state does not match data.balance_by="
                f"{self.key!r} over this prompt file (strata {self.names})"
            )
        self.generator.set_state(state["generator"])
        for name, s in self.strata.items():
            saved = state["strata"][name]
            s.sampler.load_state_dict(saved)  # the sampler's own keys, beside "outcomes"
            s.outcomes.clear()
            s.outcomes.extend(bool(x) for x in saved["outcomes"])
