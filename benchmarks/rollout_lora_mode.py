"""The rollout's LoRA as a branch against merged into the base weights, same model, one run.

Loads the quick start's model twice with its LoRA (``examples/shapes_flow_grpo_lora.yaml``:
``model.path``, ``model.lora``), gives both the same random LoRA update, and times
``ShapesT2IRolloutAdapter.sample`` on leases of one group shaped by the same config
(``data.group_size``, ``sampling``) with the adapter as a branch and merged
(``rollout --lora-mode``). Runs
alternate (branch, merged, branch, ...) after a warm-up, so load from other processes hits
both sides alike; the table reports medians. Also checks that both sample the same latents.

    uv run python benchmarks/rollout_lora_mode.py [--repeats 15] [--threads 1] [--write]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_report import replace_section
from shapes_quick_start import (
    CONFIG,
    ROOT,
    random_lora_update,
    training_leases,
)

from omnirl.models.shapes_t2i.rollout_adapter import ShapesT2IRolloutAdapter
from omnirl.trainer.algorithms.windows import lease_sampling_params
from omnirl.trainer.config import LoraConfig, load_config


def build(cfg, merged: bool, update: dict[str, torch.Tensor] | None) -> ShapesT2IRolloutAdapter:
    lora = LoraConfig.peft_kwargs(cfg.model.lora)
    adapter = ShapesT2IRolloutAdapter.from_pretrained(ROOT / cfg.model.path, lora=lora)
    if merged:
        adapter.merge_lora()
    if update is not None:
        adapter.load_weights("lora", update)
    return adapter


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = load_config(CONFIG)
    update = random_lora_update(build(cfg, False, None).transformer)
    sides = {"branch": build(cfg, False, update), "merged": build(cfg, True, update)}
    sampling = lease_sampling_params(cfg, seed=1)  # what the trainer leases
    g = sampling.group_size
    lease = training_leases()

    def sample(adapter, i):
        start = time.perf_counter()
        groups = adapter.sample(lease(i), sampling, lease_id="l", worker_id="w", policy_version=0)
        return time.perf_counter() - start, groups[0]

    _, a = sample(sides["branch"], 0)  # warm-up, and the same-latents check
    _, b = sample(sides["merged"], 0)
    rel = float((a.final_latents - b.final_latents).norm() / a.final_latents.norm())
    times: dict[str, list[float]] = {"branch": [], "merged": []}
    for i in range(1, args.repeats + 1):
        for name, adapter in sides.items():
            times[name].append(sample(adapter, i)[0])
    rate = {k: g / statistics.median(v) for k, v in times.items()}
    text = "\n".join(
        [
            f"Measured {time.strftime('%Y-%m-%d')}: `uv run python benchmarks/rollout_lora_mode.py "
            f"--repeats {args.repeats} --threads {args.threads}` (torch {torch.__version__}, "
            f"{args.threads} thread(s)); leases of one group of {g}, {sampling.num_steps} steps, "
            f"CFG {sampling.guidance_scale:g} (`{CONFIG.relative_to(ROOT)}`).",
            "",
            "| LoRA in the rollout | samples/s (median) | vs branch |",
            "|---|---:|---:|",
            f"| branch (`--lora-mode adapter`) | {rate['branch']:.1f} | 1.00x |",
            f"| merged (`--lora-mode merged`, `auto` in float32) | {rate['merged']:.1f} | "
            f"{rate['merged'] / rate['branch']:.2f}x |",
            "",
            f"Final latents, merged against branch: relative difference {rel:.1e} "
            "(float32 rounding).",
        ]
    )
    print(text)
    if args.write:
        replace_section(
            ROOT / "docs" / "benchmarks.md", "rollout_lora_mode", text, "## Rollout LoRA: merged"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
