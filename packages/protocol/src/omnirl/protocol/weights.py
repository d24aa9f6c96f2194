"""Weight updates on the wire: splitting a state dict into checksummed
:class:`~omnirl.protocol.messages.WeightUpdate` chunks, and putting them back together.

Both sides use this module: the trainer's publisher calls :func:`split_update`; a rollout
worker feeds every chunk it receives to a :class:`WeightAssembler`, which returns the whole
``dict[name, Tensor]`` once every chunk of one version has arrived intact.

Checksums (see ``WeightUpdate``): a chunk's ``checksum`` is the hex sha256 over the raw
bytes of its tensors, in order (C-contiguous, native little-endian byte layout);
``update_checksum`` is the hex sha256 over the concatenated hex chunk checksums, in chunk
order. Tensors are packed greedily into chunks of at most ``chunk_bytes``; a tensor bigger
than ``chunk_bytes`` travels alone in its own chunk (tensors are never split).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omnirl.protocol.errors import ProtocolError
from omnirl.protocol.messages import WeightFormat, WeightUpdate

if TYPE_CHECKING:
    import torch


class WeightIntegrityError(ProtocolError):
    """A weight update chunk is inconsistent: bad checksum, wrong count, or mixed headers."""

    code = "weight_integrity"


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    import torch

    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("tensor_bytes needs a contiguous CPU tensor")
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def chunk_checksum(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(tensor_bytes(t))
    return h.hexdigest()


def combine_checksums(checksums: list[str]) -> str:
    return hashlib.sha256("".join(checksums).encode("ascii")).hexdigest()


def split_update(
    version: int,
    format: WeightFormat,
    tensors: dict[str, torch.Tensor],
    *,
    chunk_bytes: int,
    adapter_config: dict[str, Any] | None = None,
) -> list[WeightUpdate]:
    """``tensors`` as ``WeightUpdate`` chunks of at most ``chunk_bytes`` each.

    The tensors must be contiguous CPU tensors that nobody will write to while the chunks
    are being sent (the chunks reference them, they are not copied).
    """
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    groups: list[list[tuple[str, torch.Tensor]]] = []
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if not groups or (size + nbytes > chunk_bytes and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append((name, t))
        size += nbytes
    if not groups:
        groups = [[]]  # an empty update is still one (empty) chunk
    checksums = [chunk_checksum([t for _, t in g]) for g in groups]
    total = combine_checksums(checksums)
    total_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return [
        WeightUpdate(
            version=version,
            format=format,
            chunk=i,
            num_chunks=len(groups),
            names=[n for n, _ in g],
            tensors=[t for _, t in g],
            checksum=checksums[i],
            update_checksum=total,
            total_bytes=total_bytes,
            adapter_config=dict(adapter_config or {}),
        )
        for i, g in enumerate(groups)
    ]


@dataclass
class AssembledWeights:
    """One whole, verified version."""

    version: int
    format: WeightFormat
    tensors: dict[str, Any]  # name -> torch.Tensor (read-only views of the received frames)
    adapter_config: dict[str, Any] = field(default_factory=dict)
    update_checksum: str = ""


class WeightAssembler:
    """Collects the chunks of the newest version seen; returns it when whole.

    ``add(chunk)`` returns an :class:`AssembledWeights` when ``chunk`` completes a version,
    else None. Chunks of a version older than the one being assembled (or already
    assembled) are ignored; a chunk of a newer version discards the partial older one.
    A chunk whose checksum does not match its tensors raises :class:`WeightIntegrityError`
    and is not kept (the version can still complete if the chunk is sent again).
    """

    def __init__(self) -> None:
        self.version = -1  # the version being assembled
        self.completed = -1  # the newest version returned whole
        self._chunks: dict[int, WeightUpdate] = {}
        self._num_chunks = 0
        self._update_checksum = ""

    def reset(self) -> None:
        self._chunks.clear()
        self.version = -1

    @property
    def missing(self) -> list[int]:
        """Chunk indices of the version being assembled not received yet."""
        return [i for i in range(self._num_chunks) if i not in self._chunks]

    def add(self, chunk: WeightUpdate) -> AssembledWeights | None:
        if chunk.version <= self.completed or chunk.version < self.version:
            return None
        if not 0 <= chunk.chunk < chunk.num_chunks:
            raise WeightIntegrityError(
                f"weight update v{chunk.version}: chunk index {chunk.chunk} out of "
                f"range for {chunk.num_chunks} chunks"
            )
        if len(chunk.names) != len(chunk.tensors):
            raise WeightIntegrityError(
                f"weight update v{chunk.version} chunk {chunk.chunk}: "
                f"{len(chunk.names)} names for {len(chunk.tensors)} tensors"
            )
        actual = chunk_checksum([t.contiguous() for t in chunk.tensors])
        if actual != chunk.checksum:
            raise WeightIntegrityError(
                f"weight update v{chunk.version} chunk {chunk.chunk}: checksum mismatch "
                f"(header {chunk.checksum[:12]}..., data {actual[:12]}...)"
            )
        if chunk.version > self.version:
            self._chunks.clear()
            self.version = chunk.version
            self._num_chunks = chunk.num_chunks
            self._update_checksum = chunk.update_checksum
        elif (chunk.num_chunks, chunk.update_checksum) != (
            self._num_chunks,
            self._update_checksum,
        ):
            raise WeightIntegrityError(
                f"weight update v{chunk.version} chunk {chunk.chunk}: num_chunks / "
                "update_checksum disagree with the version's earlier chunks"
            )
        self._chunks[chunk.chunk] = chunk
        if len(self._chunks) < self._num_chunks:
            return None
        ordered = [self._chunks[i] for i in range(self._num_chunks)]
        combined = combine_checksums([c.checksum for c in ordered])
        if combined != self._update_checksum:
            self.reset()
            raise WeightIntegrityError(
                f"weight update v{chunk.version}: update checksum mismatch over "
                f"{self._num_chunks} chunks"
            )
        tensors: dict[str, Any] = {}
        for c in ordered:
            for name, t in zip(c.names, c.tensors, strict=True):
                if name in tensors:
                    self.reset()
                    raise WeightIntegrityError(
                        f"weight update v{chunk.version}: tensor {name!r} appears twice"
                    )
                tensors[name] = t
        done = AssembledWeights(
            version=chunk.version,
            format=chunk.format,
            tensors=tensors,
            adapter_config=dict(ordered[0].adapter_config),
            update_checksum=self._update_checksum,
        )
        self.completed = chunk.version
        self._chunks.clear()
        self._num_chunks = 0
        return done
