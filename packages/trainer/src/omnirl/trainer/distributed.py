"""Data-parallel training over processes started by ``torchrun``: FSDP2 or gradient all-reduce.

Every rank runs the same code and calls ``TrainStep.step`` with the same groups (advantages
need every reward of the batch); each trains its share of the samples::

    info = init_distributed("cuda")                 # torchrun's env; world size 1 without it
    adapter = SD3TrainingAdapter.from_pretrained(path, device=info.device, dtype=..., lora=...)
    parallel = DataParallel(info, adapter.transformer, mode="auto")
    step = TrainStep(adapter, "flow_grpo", config, parallel=parallel)
    metrics = step.step(groups, policy_version=v)   # global metrics, the same on every rank
    weights = adapter.export_weights()              # every rank calls it (FSDP2 gathers)

Modes:

- ``"fsdp"``: FSDP2 (``torch.distributed.fsdp.fully_shard``) on each repeated transformer
  block, then on the root: parameters become DTensors sharded over the ranks, gathered
  block by block in forward and backward, gradients reduce-scattered. What full fine-tuning
  needs once the weights and AdamW state outgrow one GPU.
- ``"ddp"``: parameters replicated, the trainable gradients all-reduced in one flat buffer
  after the backward passes. For LoRA (megabytes of gradients) the simple choice.
- ``"auto"``: ``"fsdp"`` for full fine-tuning, ``"ddp"`` for LoRA, nothing at world size 1.

How samples are split (:meth:`DataParallel.split`): in each (window bucket, trained step)
batch, the update's rows are cut into ``world_size`` near-equal shares and each share into
the same number of micro-batches on every rank (FSDP2's collectives must line up); a rank
whose share ran out makes a zero-weight pass. Loss weights use the whole update's row
count, so the summed gradient is the global mean, whatever the split.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from omnirl.trainer.algorithms.update_metrics import MetricsAccumulator

MODES = ("auto", "none", "ddp", "fsdp")


@dataclass(frozen=True, slots=True)
class DistInfo:
    """Where this process sits: ``rank`` of ``world_size``, its ``device``."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(
    device: str = "cpu", *, backend: str | None = None, timeout: Any = None
) -> DistInfo:
    """Join the process group ``torchrun`` describes (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``); without those, a world of one and no process group.

    ``device`` ``"cuda"`` becomes ``cuda:LOCAL_RANK``. ``backend``: default ``nccl`` on
    CUDA, ``gloo`` on the CPU. ``timeout`` (a ``datetime.timedelta``): how long a collective
    may wait for the other ranks (torch's default when ``None``).
    """
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", local if dev.index is None else dev.index)
        torch.cuda.set_device(dev)
    if "RANK" in os.environ and not dist.is_initialized():
        kwargs = {} if timeout is None else {"timeout": timeout}
        dist.init_process_group(backend or ("nccl" if dev.type == "cuda" else "gloo"), **kwargs)
    return DistInfo(rank=rank, world_size=world, local_rank=local, device=dev)


def resolve_mode(mode: str, *, world_size: int, lora: bool) -> str:
    """``"auto"`` -> ``"none"`` at world size 1, else ``"ddp"`` (LoRA) / ``"fsdp"`` (full)."""
    if mode not in MODES:
        raise ValueError(f"unknown data-parallel mode {mode!r}; known: {', '.join(MODES)}")
    if mode != "auto":
        return mode
    if world_size == 1:
        return "none"
    return "ddp" if lora else "fsdp"


def shard_fsdp(module: torch.nn.Module, info: DistInfo) -> int:
    """FSDP2 ``fully_shard`` on every repeated block of ``module``, then on ``module``;
    returns the number of blocks sharded. Mixed dtypes are fine (bf16 frozen base weights,
    float32 LoRA tensors): FSDP2 asks only that the trainable ones of a block share one."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from omnirl.models.compile import repeated_blocks

    mesh = init_device_mesh(info.device.type, (info.world_size,))
    blocks = repeated_blocks(module)
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return len(blocks)


def split_rows(rows: torch.Tensor, chunk: int, *, rank: int, world_size: int) -> list[torch.Tensor]:
    """Rank ``rank``'s micro-batches of ``rows`` (int64 ``[R]``, an update's rows of one
    batch): ``world_size`` near-equal shares, each cut into the same number of micro-batches
    on every rank, of at most ``chunk`` rows; some may be empty (a zero-weight pass)."""
    share = rows.tensor_split(world_size)[rank]
    count = max(1, math.ceil(math.ceil(len(rows) / world_size) / chunk))
    return list(share.tensor_split(count))


class DataParallel:
    """What :class:`~omnirl.trainer.step.TrainStep` asks of the process group.

    Build it after the training adapter (and before the ``TrainStep``, whose optimiser must
    hold the sharded parameters): under ``"fsdp"`` it shards ``module`` in place.
    """

    def __init__(self, info: DistInfo, module: torch.nn.Module, *, mode: str = "auto"):
        lora = any("lora_" in n for n, p in module.named_parameters() if p.requires_grad)
        self.info = info
        self.mode = resolve_mode(mode, world_size=info.world_size, lora=lora)
        if self.mode != "none" and not dist.is_initialized():
            raise RuntimeError(
                f"data-parallel mode {self.mode!r} needs a process group: start under "
                "torchrun and call init_distributed() first"
            )
        self.module = module
        if self.mode == "fsdp":
            shard_fsdp(module, info)

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def grad_scale(self) -> float:
        """FSDP2 averages gradients over ranks; the loss weights want their sum."""
        return float(self.world_size) if self.mode == "fsdp" else 1.0

    def split(self, rows: torch.Tensor, chunk: int) -> list[torch.Tensor]:
        """This rank's micro-batches of ``rows`` (see :func:`split_rows`)."""
        return split_rows(rows, chunk, rank=self.rank, world_size=self.world_size)

    def before_backward(self, *, last: bool) -> None:
        """FSDP2: reduce-scatter gradients only after the update's last micro-batch."""
        if self.mode == "fsdp":
            self.module.set_requires_gradient_sync(last)

    def reduce_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """``"ddp"``: sum the trainable gradients over ranks, one flat all-reduce."""
        if self.mode != "ddp" or self.world_size == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1).to(torch.float32) for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for p, g in zip(params, grads, strict=True):
            n = g.numel()
            p.grad = flat[offset : offset + n].view_as(g).to(g.dtype)
            offset += n

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` summed over ranks (a copy; unchanged at world size 1)."""
        if self.world_size == 1 or not dist.is_initialized():
            return values
        out = values.clone()
        dist.all_reduce(out)
        return out

    def gather_metrics(self, acc: MetricsAccumulator) -> MetricsAccumulator:
        """Every rank's per-sample vectors, so that each rank's summary is the global one."""
        acc.to_cpu()
        if self.world_size == 1 or not dist.is_initialized():
            return acc
        gathered: list[MetricsAccumulator | None] = [None] * self.world_size
        dist.all_gather_object(gathered, acc)
        others = [a for i, a in enumerate(gathered) if i != self.rank and a is not None]
        return acc.merge(others)
