"""What the recording tests share besides fixtures: the example config made tiny.

A module of its own, not ``conftest.py``: several test folders have a ``conftest.py``, and
``from conftest import ...`` would find whichever pytest imported first.
"""

from __future__ import annotations

from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_sd3_jpeg.yaml"
PROMPTS = Path(__file__).resolve().parents[2] / "examples" / "prompts" / "animals.jsonl"
GROUPS = 4  # two steps of two groups


def trainer_overrides(model: Path, out: Path) -> list[str]:
    """The example config made tiny; it must sample what :func:`recorded_groups` sampled."""
    items = {
        "model.path": model,
        "run.output_dir": out,
        "data.prompts": PROMPTS,
        "data.group_size": 2,
        "sampling.num_steps": 3,
        "train.groups_per_step": 2,
        "train.max_staleness": 1,  # step 2 trains on groups sampled at version 0
        "runtime.control_port": 0,
        "runtime.shutdown_grace_s": 0,
        "logging.progress_bar": "false",
        "logging.tensorboard": "false",
        "checkpoint.every": 0,
        "max_steps": 2,
    }
    return [f"{k}={v}" for k, v in items.items()]
