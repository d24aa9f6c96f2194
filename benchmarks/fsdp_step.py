"""Data-parallel ``TrainStep`` on the tiny SD3, under ``torchrun`` (FSDP2 or DDP) or alone.

Every rank trains the same scored groups (sampled once by rank 0 and broadcast); the script
writes the global metrics of each step and the final LoRA tensors (rank 0) to ``--out``, so
runs at different world sizes can be compared (``tests/trainer/test_distributed_step.py``
does: one process against two, on the CPU with gloo).

    python benchmarks/fsdp_step.py --out one.pt                      # world size 1, no group
    torchrun --nproc-per-node 2 benchmarks/fsdp_step.py --mode fsdp --out two.pt
    torchrun --nproc-per-node 1 benchmarks/fsdp_step.py --mode fsdp --device cuda --out g.pt

The batch is two groups of 3 and 2 samples, 3 steps with an SDE window of 2, LoRA r 4,
KL to the reference on, ``--micro-batch 1``: on two ranks a share runs out before the
other (one zero-weight pass), which is the case that must still line up FSDP2's collectives.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist

from omnirl.models.sd3 import SD3RolloutAdapter, SD3TrainingAdapter
from omnirl.models.sd3.tiny import make_tiny_sd3
from omnirl.protocol.messages import PromptSpec, Rewards, SamplingParams
from omnirl.trainer.distributed import DataParallel, init_distributed
from omnirl.trainer.step import TrainStep

LORA = {"r": 4, "lora_alpha": 4}
REWARDS = ((0.0, 1.0, 3.0), (2.0, 0.5))


def sample_groups(path: Path, device: str) -> list:
    """The two scored groups (sizes 3 and 2) every rank trains on."""
    rollout = SD3RolloutAdapter.from_pretrained(path, device=device, max_sequence_length=16)
    out = []
    for i, rewards in enumerate(REWARDS):
        sampling = SamplingParams(
            group_size=len(rewards), num_steps=3, height=32, width=32, sde_window=(1, 3), seed=5
        )
        prompt = PromptSpec(group_id=f"g{i}", text=f"a photo of thing {i}")
        (group,) = rollout.sample([prompt], sampling, lease_id="l", worker_id="w", policy_version=0)
        out.append(
            msgspec.structs.replace(
                group, rewards=Rewards(group_id=group.group_id, total=list(rewards))
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="auto", choices=["auto", "none", "ddp", "fsdp"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--kl-beta", type=float, default=0.1)
    parser.add_argument("--model", default="", help="tiny SD3 folder (default: built in a tmp dir)")
    parser.add_argument("--out", default="", help="torch.save of metrics and LoRA (rank 0)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    info = init_distributed(args.device)
    tmp = tempfile.TemporaryDirectory()
    path = Path(args.model) if args.model else Path(tmp.name) / "tiny"
    if info.is_main and not (path / "model_index.json").is_file():
        make_tiny_sd3(path, seed=0)
    groups = sample_groups(path, str(info.device)) if info.is_main else None
    if dist.is_initialized():  # rank 0's folder and groups
        box = [groups, str(path)]
        dist.broadcast_object_list(box, src=0)
        groups, path = box[0], Path(box[1])

    torch.manual_seed(0)  # the same LoRA initialisation on every rank
    adapter = SD3TrainingAdapter.from_pretrained(
        path, device=info.device, dtype=getattr(torch, args.dtype), lora=LORA
    )
    parallel = DataParallel(info, adapter.transformer, mode=args.mode)
    config = TrainStep.Config(lr=1e-2, kl_beta=args.kl_beta, micro_batch_size=args.micro_batch)
    step = TrainStep(adapter, "flow_grpo", config, parallel=parallel)
    history = []
    for version in range(args.steps):
        start = time.perf_counter()
        metrics = step.step(groups, policy_version=version)
        metrics["wall_s"] = time.perf_counter() - start
        history.append(metrics)
    weights = adapter.export_weights()  # every rank: FSDP2 gathers the shards
    summary = {
        "mode": parallel.mode,
        "world_size": info.world_size,
        "device": str(info.device),
        "losses": [m["loss"] for m in history],
        "grad_norms": [m["grad_norm"] for m in history],
        "parity_max": [m["behav_prox_logp_absdiff_max"] for m in history],
        "wall_s": [round(m["wall_s"], 3) for m in history],
    }
    if info.is_main:
        print(json.dumps(summary), flush=True)
        if args.out:
            torch.save({"summary": summary, "metrics": history, "weights": weights}, args.out)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
