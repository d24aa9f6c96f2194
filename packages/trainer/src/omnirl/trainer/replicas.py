"""The trainer across ``torchrun`` ranks: rank 0 leads the run, the other ranks follow.

Rank 0 runs the :class:`~omnirl.trainer.server.TrainerServer` as in a single process (the
sockets, the ledger, the weight publisher, checkpoints) over a :class:`LeaderBackend`; every
other rank runs :func:`follow` with its own :class:`~omnirl.trainer.backend.AdapterBackend`
and no sockets. Whatever rank 0's backend does that involves the process group is announced
first, with one ``broadcast_object_list`` carrying the command:

- ``("step", groups, version)``: every rank trains the same groups (advantages need every
  reward), each its share of the rows (``DataParallel``); gradients are all-reduced;
- ``("export",)``: every rank exports its weights (collective-free for DDP replicas; kept
  so that a sharded mode can gather);
- ``("resume", path)``: every rank loads the same checkpoint;
- ``("stop",)``: followers leave, logging a digest of their replica (the one rollout
  workers log for the version they applied).

So every collective runs on every rank in the same order. Rank 0's server calls the backend
from its step thread and from its main thread, one call at a time. A step that refuses its
groups (``TrainStepInputError``, before any collective) is refused on every rank and the run
goes on; any other failure on a follower ends it (exit 1: torchrun stops the other ranks,
rather than leaving rank 0 waiting in a collective), and one on rank 0 stops the run
(:class:`~omnirl.trainer.step_snapshot.StepNotUndone`: the followers may have applied it).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from omnirl.trainer.step import TrainStepInputError
from omnirl.trainer.step_snapshot import StepNotUndone

log = logging.getLogger("omnirl.trainer")


def weights_digest(weights: dict[str, torch.Tensor], chunk_bytes: int) -> str:
    """The digest a rollout worker logs for these weights ("applied weights ... digest="):
    the first 16 hex digits of the update checksum the publisher would send, chunked by
    ``runtime.weight_chunk_bytes``; so a replica can be compared with what workers hold."""
    from omnirl.protocol.weights import split_update

    cpu = {n: t.detach().to("cpu", copy=True).contiguous() for n, t in weights.items()}
    (first, *_) = split_update(0, "full", cpu, chunk_bytes=chunk_bytes)
    return first.update_checksum[:16]


def _receive() -> tuple:
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class LeaderBackend:
    """Rank 0's backend: announces each collective call to the followers, then makes it."""

    def __init__(self, backend: Any, *, chunk_bytes: int):
        self.backend = backend
        self.info = backend.dist_info
        self.chunk_bytes = chunk_bytes
        self._closed = False

    def __getattr__(self, name: str) -> Any:  # architecture, adapter, train_step, ...
        return getattr(self.backend, name)

    def _announce(self, command: tuple) -> None:
        if self.info.device.type == "cuda":  # the step thread's current device
            torch.cuda.set_device(self.info.device)
        dist.broadcast_object_list([command], src=0)

    def step(
        self, groups: list[Any], *, policy_version: int, lr_scale: float = 1.0
    ) -> dict[str, float]:
        self._announce(("step", list(groups), policy_version, lr_scale))
        try:
            return self.backend.step(groups, policy_version=policy_version, lr_scale=lr_scale)
        except TrainStepInputError:
            raise  # refused on every rank before any collective: the ranks agree
        except Exception as err:
            # the followers may have applied the step, or wait in one of its collectives:
            # the replicas cannot be rewound together
            raise StepNotUndone(
                f"the step failed on rank 0 of {self.info.world_size}: {err!r}"
            ) from err

    def export_weights(self) -> dict[str, torch.Tensor]:
        self._announce(("export",))
        return self.backend.export_weights()

    def load_checkpoint(self, path: Any) -> Any:
        self._announce(("resume", str(path)))
        return self.backend.load_checkpoint(path)

    def close(self) -> None:
        """Tell the followers to leave (once); log this replica's digest as they do."""
        if self._closed:
            return
        self._closed = True
        self._announce(("stop",))
        log.info(
            "rank 0 of %d: replica digest %s",
            self.info.world_size,
            weights_digest(self.backend.export_weights(), self.chunk_bytes),
        )


def follow(backend: Any, *, chunk_bytes: int) -> int:
    """A follower rank's loop: run rank 0's announced calls until it says stop."""
    info = backend.dist_info
    steps = 0
    while True:
        command = _receive()
        kind = command[0]
        if kind == "step":
            try:
                backend.step(command[1], policy_version=command[2], lr_scale=command[3])
                steps += 1
            except TrainStepInputError as err:
                # raised by every rank alike before any collective (rank 0's server logs it
                # and issues the groups again): the ranks stay in step
                log.warning("rank %d: step refused its groups: %s", info.rank, err)
        elif kind == "export":
            backend.export_weights()
        elif kind == "resume":
            backend.load_checkpoint(Path(command[1]))
        elif kind == "stop":
            log.info(
                "rank %d of %d: %d steps; replica digest %s",
                info.rank,
                info.world_size,
                steps,
                weights_digest(backend.export_weights(), chunk_bytes),
            )
            return 0
        else:
            raise RuntimeError(f"rank {info.rank}: unknown command from rank 0: {kind!r}")
