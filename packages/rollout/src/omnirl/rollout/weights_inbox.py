"""Weight versions as they arrive: chunks assembled and verified, the newest kept whole.

Wraps :class:`omnirl.protocol.weights.WeightAssembler`. A corrupt chunk is logged and
dropped (the version completes if the chunk comes again, or a newer version replaces it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from omnirl.protocol.messages import WeightUpdate
from omnirl.protocol.weights import WeightAssembler, WeightIntegrityError

log = logging.getLogger("omnirl.rollout")


@dataclass(slots=True)
class ReadyUpdate:
    """One whole, verified version, not yet applied."""

    version: int
    format: str  # "lora" | "full"
    tensors: dict[str, Any]  # name -> torch.Tensor (read-only views of received frames)
    adapter_config: dict[str, Any]
    update_checksum: str

    @property
    def digest(self) -> str:
        """A short name of the exact bytes of this version (its update checksum's head)."""
        return self.update_checksum[:16]


class WeightInbox:
    def __init__(self) -> None:
        self._assembler = WeightAssembler()
        self._ready: ReadyUpdate | None = None
        self.rejected_chunks = 0

    def reset(self) -> None:
        """Forget everything (a new trainer: its versions are not comparable with the old)."""
        self._assembler = WeightAssembler()
        self._ready = None

    def add(self, chunk: WeightUpdate) -> ReadyUpdate | None:
        """Feed one chunk; returns the version it completed, if it completed one."""
        try:
            done = self._assembler.add(chunk)
        except WeightIntegrityError as exc:
            self.rejected_chunks += 1
            log.warning("weight chunk rejected: %s", exc)
            return None
        if done is None:
            return None
        self._ready = ReadyUpdate(
            version=done.version,
            format=done.format,
            tensors=done.tensors,
            adapter_config=done.adapter_config,
            update_checksum=done.update_checksum,
        )
        return self._ready

    def newest_above(self, version: int) -> ReadyUpdate | None:
        ready = self._ready
        return ready if ready is not None and ready.version > version else None

    def discard_through(self, version: int) -> None:
        if self._ready is not None and self._ready.version <= version:
            self._ready = None
