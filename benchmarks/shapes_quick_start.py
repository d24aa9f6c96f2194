"""What the CPU benchmarks of the quick start share: its LoRA config
(``examples/shapes_flow_grpo_lora.yaml``, the quick start with a LoRA instead of every
weight), leases of its training prompts, and a random LoRA update for its model.

Imported by ``rollout_lora_mode.py`` and ``cpu_precision.py`` (not run on its own).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from omnirl.models.weights import lora_state
from omnirl.protocol.messages import PromptSpec

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "shapes_flow_grpo_lora.yaml"
PROMPTS = ROOT / "examples" / "prompts" / "shapes_train.jsonl"


def training_leases(limit: int = 64) -> Callable[[int], list[PromptSpec]]:
    """``lease(i)``: one prompt group, the ``i``-th of the first ``limit`` training prompts
    (cycled), as the prompts of a lease."""
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()[:limit]]

    def lease(i: int) -> list[PromptSpec]:
        row = rows[i % len(rows)]
        return [PromptSpec(group_id=f"g{i}", text=row["prompt"], metadata=row["metadata"])]

    return lease


def random_lora_update(transformer: torch.nn.Module, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors (std 0.02) for every LoRA tensor of ``transformer``, by PEFT key: a
    trained-looking adapter, so a merge or a branch has a delta to carry."""
    gen = torch.Generator().manual_seed(seed)
    return {
        k: torch.randn(v.shape, generator=gen) * 0.02 for k, v in lora_state(transformer).items()
    }
