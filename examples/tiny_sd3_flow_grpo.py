"""Quick start: FlowGRPO on a tiny random SD3, in one process, on a CPU.

    uv run python examples/tiny_sd3_flow_grpo.py [--steps 4] [--out runs/tiny-sd3]

Builds a tiny random ``StableDiffusion3Pipeline`` into ``runs/tiny-sd3`` (once), then per
step: samples a group of images per prompt with the rollout adapter (SDE sampling with
log-prob recording), scores them with DDPO's JPEG compressibility, trains one FlowGRPO
LoRA step with :class:`omnirl.trainer.step.TrainStep`, and hands the new LoRA weights back
to the rollout adapter, as the trainer process does over the wire. The model is random, so
the images are noise; the point is the whole loop and its metrics in a few seconds.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from omnirl.models.registry import get_rollout_adapter, get_training_adapter
from omnirl.models.sd3.tiny import make_tiny_sd3
from omnirl.protocol.messages import PromptSpec, Rewards, SamplingParams
from omnirl.reward.scorers.jpeg import jpeg_compressibility
from omnirl.trainer.algorithms.registry import get_algorithm
from omnirl.trainer.step import TrainStep

ARCHITECTURE = "StableDiffusion3Pipeline"
PROMPTS = ["a red square", "a calm blue sea"]
SHOWN = (
    "reward_mean",
    "loss",
    "grad_norm",
    "ratio_mean",
    "clip_frac",
    "approx_kl",
    "behav_prox_logp_absdiff_max",
    "time_s",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("runs/tiny-sd3"))
    parser.add_argument("--device", default="cpu")
    # The tiny model's matrices are far too small to gain from intra-op threads; extra
    # threads only add synchronisation, which on a busy machine costs 10x.
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    if not (args.out / "model_index.json").is_file():
        make_tiny_sd3(args.out, seed=0)
    spec = get_algorithm("flow_grpo")
    lora = {"r": 4, "lora_alpha": 4}
    rollout = get_rollout_adapter(ARCHITECTURE, spec.adapter_algorithm).from_pretrained(
        args.out, device=args.device, lora=lora
    )
    train = get_training_adapter(ARCHITECTURE, spec.adapter_algorithm).from_pretrained(
        args.out, device=args.device, lora=lora
    )
    rollout.load_weights("lora", train.export_weights())  # start both from the same adapter
    step = TrainStep(train, spec, TrainStep.Config(lr=3e-3, seed=0))
    sampling = SamplingParams(
        group_size=4,
        num_steps=4,
        guidance_scale=1.0,
        height=32,
        width=32,
        sde_window=(0, 2),
        **spec.sampling_defaults,
    )

    for version in range(args.steps):
        start = time.perf_counter()
        prompts = [PromptSpec(group_id=f"s{version}-p{i}", text=t) for i, t in enumerate(PROMPTS)]
        groups = rollout.sample(
            prompts,
            sampling,
            lease_id=f"lease-{version}",
            worker_id="local",
            policy_version=version,
        )
        for g in groups:
            scores = jpeg_compressibility(g.images)
            g.rewards = Rewards(
                group_id=g.group_id,
                total=scores,
                components={"jpeg_compressibility": scores},
                weights={"jpeg_compressibility": 1.0},
            )
        metrics = step.step(groups, policy_version=version)
        rollout.load_weights("lora", train.export_weights())  # version + 1 to the "fleet"
        shown = "  ".join(f"{k}={metrics[k]:.4g}" for k in SHOWN)
        print(f"step {version}  {shown}  wall={time.perf_counter() - start:.1f}s", flush=True)


if __name__ == "__main__":
    main()
