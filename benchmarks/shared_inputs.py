"""Shared inputs: the quick start's rollout and training with one model row per group where
a group's samples share their input, against every row run.

With ``sampling.same_initial_noise`` a group's samples start from one noise, so until their
first stochastic step they are one input: the rollout runs the transformer on one row per
group there and the trainer runs it once per group for the recorded step at that x
(``TransitionBatch.input_id``). The quick start's SDE window is ``[0, 3]``: one of the
rollout's 10 steps and one of the trainer's 3 trained steps are shared.

- **rollout**: ``ShapesT2IRolloutAdapter.sample`` of one group, the config's sampling, against
  the same with ``same_initial_noise`` off (every row through the transformer at every step:
  the same work as before sharing; only the noise values differ);
- **training**: the trainer's work for the groups of one micro-batch at every trained step:
  forward, backward of the summed log-probs and the reference pass (``kl_beta`` > 0), on the
  transitions the rollout recorded, with their ``input_id`` and with it cleared.

Float32 eager, one thread (as the launcher gives each process on 2 cores); sides alternate
after two warm-up calls, medians reported.

    uv run python benchmarks/shared_inputs.py [--repeats 6] [--write]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import msgspec
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_report import replace_section
from cpu_precision import rollout_adapter, time_alternating, training_adapter
from shapes_quick_start import CONFIG, ROOT, random_lora_update, training_leases

from omnirl.models.shapes_t2i.rollout_adapter import ShapesT2IRolloutAdapter
from omnirl.models.transitions import collate_transitions
from omnirl.trainer.algorithms.windows import lease_sampling_params
from omnirl.trainer.config import LoraConfig, load_config


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    cfg = load_config(CONFIG)
    shared = lease_sampling_params(cfg, seed=1)
    if not shared.same_initial_noise:
        raise SystemExit(f"{CONFIG.name} does not sample with same_initial_noise")
    distinct = msgspec.structs.replace(shared, same_initial_noise=False)
    lease = training_leases()
    lora = LoraConfig.peft_kwargs(cfg.model.lora)
    probe = ShapesT2IRolloutAdapter.from_pretrained(ROOT / cfg.model.path, lora=lora)
    update = random_lora_update(probe.transformer)
    roll = rollout_adapter(cfg, update, torch.float32)
    counter = iter(range(10**9))

    def sample(sampling):
        return roll.sample(
            lease(next(counter)), sampling, lease_id="l", worker_id="w", policy_version=0
        )

    roll_med, _ = time_alternating(
        {"shared": lambda: sample(shared), "every row": lambda: sample(distinct)}, args.repeats
    )

    micro = int(cfg.algorithm.overrides.get("micro_batch_size", 64))
    groups = []
    while sum(int(g.latents.shape[0]) for g in groups) < micro:
        groups += sample(shared)
    num_k = int(groups[0].latents.shape[1])
    batches = [collate_transitions(groups, k) for k in range(num_k)]
    cleared = [dataclasses.replace(b, input_id=None) for b in batches]
    train = training_adapter(cfg, update, torch.float32)
    sde_type = shared.sde_type

    def step(bs) -> None:
        for batch in bs:
            train.transition(batch, sde_type=sde_type).log_prob.sum().backward()
            with torch.no_grad(), train.reference():
                train.transition(batch, sde_type=sde_type)
        train.transformer.zero_grad(set_to_none=True)

    train_med, _ = time_alternating(
        {"shared": lambda: step(batches), "every row": lambda: step(cleared)}, args.repeats
    )
    n = sum(int(g.latents.shape[0]) for g in groups)
    lines = [
        f"Measured {time.strftime('%Y-%m-%d')}: `uv run python benchmarks/shared_inputs.py "
        f"--repeats {args.repeats}` (torch {torch.__version__}, float32 eager, 1 thread; "
        f"`{CONFIG.relative_to(ROOT)}`: groups of {shared.group_size}, {shared.num_steps} "
        f"steps, SDE window {list(shared.sde_window)}, CFG {shared.guidance_scale:g}).",
        "",
        "| work | every row, s | shared inputs, s | speed-up |",
        "|---|---:|---:|---:|",
        f"| rollout, one group | {roll_med['every row']:.3f} | {roll_med['shared']:.3f} | "
        f"{roll_med['every row'] / roll_med['shared']:.2f}x |",
        f"| training, {n} samples x {num_k} trained steps (forward, backward, reference pass) "
        f"| {train_med['every row']:.3f} | {train_med['shared']:.3f} | "
        f"{train_med['every row'] / train_med['shared']:.2f}x |",
    ]
    text = "\n".join(lines)
    print(text)
    if args.write:
        replace_section(
            ROOT / "docs" / "benchmarks.md",
            "shared_inputs",
            text,
            "## Shared inputs: one model row per group before the first stochastic step",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
