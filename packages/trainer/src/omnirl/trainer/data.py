"""The resumable prompt dataset.

Records are ``{"prompt": str, "metadata": {...}}`` rows of a ``.jsonl`` or ``.parquet``
file. :class:`PromptSource` walks them epoch after epoch, in an order fixed by
``(seed, epoch)``, through a torchdata ``StatefulDataLoader``; every prompt comes out as a
:class:`~omnirl.protocol.messages.PromptSpec` whose ``group_id`` is its dataset position
``f"e{epoch}:i{index}"``, so a reissued prompt keeps its name.

``state_dict()`` / ``load_state_dict()`` restore the position exactly: a resumed run
continues with the same data order.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler
from torchdata.stateful_dataloader import StatefulDataLoader

from omnirl.protocol.messages import PromptSpec


class DataError(ValueError):
    """A prompt file is missing, empty or malformed; the message names file and row."""


def read_prompt_records(path: str | Path) -> list[dict[str, Any]]:
    """Read ``{"prompt", "metadata"}`` rows from ``.jsonl`` or ``.parquet``."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"prompt file not found: {path}")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    elif path.suffix in (".jsonl", ".json"):
        rows = []
        with path.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise DataError(f"{path}:{lineno}: not JSON: {err.msg}") from None
    else:
        raise DataError(f"{path}: unknown prompt file type {path.suffix!r} (.jsonl or .parquet)")
    records = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise DataError(f"{path}: row {i} has no string 'prompt' field")
        metadata = row.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise DataError(f"{path}: row {i}: 'metadata' is not an object")
        records.append({"prompt": row["prompt"], "metadata": metadata})
    if not records:
        raise DataError(f"{path}: no prompts")
    return records


class PromptDataset(Dataset):
    """Map-style dataset indexed by ``(epoch, index)`` pairs; returns a :class:`PromptSpec`."""

    def __init__(self, records: list[dict[str, Any]]):
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, key: tuple[int, int]) -> PromptSpec:
        epoch, index = key
        rec = self.records[index]
        return PromptSpec(
            group_id=f"e{epoch}:i{index}", text=rec["prompt"], metadata=dict(rec["metadata"])
        )


class EpochSampler(Sampler):
    """Endless ``(epoch, index)`` stream; epoch ``e`` is a permutation seeded by ``(seed, e)``.

    The sampler is its own iterator and is Stateful (``{"epoch", "position"}``), which is
    what lets ``StatefulDataLoader`` restore it without fast-forwarding.
    """

    def __init__(self, size: int, *, shuffle: bool, seed: int):
        self.size = size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order: list[int] | None = None

    def _epoch_order(self) -> list[int]:
        if self._order is None:
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
                self._order = torch.randperm(self.size, generator=gen).tolist()
            else:
                self._order = list(range(self.size))
        return self._order

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return self

    def __next__(self) -> tuple[int, int]:
        if self.position >= self.size:
            self.epoch += 1
            self.position = 0
            self._order = None
        index = self._epoch_order()[self.position]
        self.position += 1
        return (self.epoch, index)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        # a resumed run keeps the permutation it started with, whatever seed the config now
        # gives (states saved before the seed was kept have none)
        self.seed = int(state.get("seed", self.seed))
        self._order = None


def _as_is(item: PromptSpec) -> PromptSpec:
    return item


class PromptSource:
    """The trainer's supply of fresh prompts: ``next()`` -> :class:`PromptSpec`, forever."""

    def __init__(self, records: list[dict[str, Any]], *, shuffle: bool = True, seed: int = 0):
        self.dataset = PromptDataset(records)
        self.sampler = EpochSampler(len(records), shuffle=shuffle, seed=seed)
        with warnings.catch_warnings():  # torchdata calls a deprecated torch API here
            warnings.filterwarnings("ignore", message=".*set_vital.*")
            self.loader = StatefulDataLoader(
                self.dataset, sampler=self.sampler, batch_size=None, collate_fn=_as_is
            )
        self._it: Iterator[PromptSpec] | None = None

    @classmethod
    def from_config(cls, data_cfg: Any) -> PromptSource:
        """Build from the ``data`` section of :class:`omnirl.trainer.config.TrainerConfig`."""
        return cls(
            read_prompt_records(data_cfg.prompts), shuffle=data_cfg.shuffle, seed=data_cfg.seed
        )

    def __len__(self) -> int:
        return len(self.dataset)

    def _iter(self) -> Iterator[PromptSpec]:
        with warnings.catch_warnings():  # torchdata calls a deprecated torch API here
            warnings.filterwarnings("ignore", message=".*set_vital.*")
            return iter(self.loader)

    def next(self) -> PromptSpec:
        if self._it is None:
            self._it = self._iter()
        return next(self._it)

    def take(self, n: int) -> list[PromptSpec]:
        return [self.next() for _ in range(n)]

    def state_dict(self) -> dict[str, Any]:
        if self._it is None:
            self._it = self._iter()
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)
        self._it = self._iter()
