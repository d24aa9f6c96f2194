"""How much a GRPO group of ShapesEval samples disagrees with itself, per sampling mode.

A group-relative advantage is zero where every sample of a group scores the same, so a skill
can be learned only from groups whose samples differ in it. For the first ``--prompts``
prompts of one category in a prompt file, this samples groups of ``--group`` images of a
base model in three modes (the quick start's SDE window with one initial noise per group,
the same window with a fresh initial noise per sample, and the ODE) and prints, averaged
over prompts: strict accuracy, the within-group std of the partial reward, the fraction of
samples whose relation holds (position), and the fraction of groups with mixed outcomes.

    uv run python benchmarks/shapes_group_outcomes.py MODEL_DIR \
        [--prompts-file examples/prompts/shapes_train.jsonl] [--category position] \
        [--prompts 48] [--group 16] [--threads 2]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

MODES = {
    "sde, one x_T per group": dict(sde_type="sde", sde_window=(0, 3), same_initial_noise=True),
    "sde, fresh x_T": dict(sde_type="sde", sde_window=(0, 3), same_initial_noise=False),
    "ode, fresh x_T": dict(sde_type="ode", same_initial_noise=False),
}


def group_stats(scores) -> tuple[float, float, float, float, float]:
    """(strict, partial std, relation holds, relation mixed, strict mixed) of one group."""
    strict = np.array([s.strict for s in scores], dtype=np.float64)
    partial = np.array([s.partial for s in scores])
    relation = np.array([bool(s.details.get("relation_ok")) for s in scores], dtype=np.float64)
    return (
        strict.mean(),
        partial.std(),
        relation.mean(),
        float(0 < relation.mean() < 1),
        float(0 < strict.mean() < 1),
    )


def main(argv: list[str] | None = None) -> int:
    from omnirl.protocol.messages import SamplingParams
    from omnirl.reward.shapes import score_batch
    from omnirl.tools.eval_shapes import load_adapter, load_prompt_file, sample_specs

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="a ShapesT2I folder")
    parser.add_argument(
        "--prompts-file", type=Path, default=Path("examples/prompts/shapes_train.jsonl")
    )
    parser.add_argument("--category", default="position")
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    specs = [s for s in load_prompt_file(args.prompts_file) if s.category == args.category]
    specs = specs[: args.prompts]
    if not specs:
        parser.error(f"no {args.category!r} prompts in {args.prompts_file}")
    adapter = load_adapter(args.model)
    print(f"{len(specs)} {args.category} prompts x {args.group} samples, {args.model}")
    print(
        "| mode | strict | partial std in a group | relation holds | groups mixed in relation | groups mixed in strict |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, mode in MODES.items():
        sampling = SamplingParams(
            group_size=args.group,
            seed=1,
            num_steps=10,
            guidance_scale=3.0,
            height=32,
            width=32,
            record_latents=False,
            record_images=True,
            **mode,
        )
        groups = sample_specs(adapter, specs, sampling, batch_prompts=16, tag="g")
        rows = [group_stats(score_batch(g.images.numpy(), spec)) for g, spec in groups]
        mean = np.array(rows).mean(axis=0)
        print(f"| {name} | " + " | ".join(f"{v:.3f}" for v in mean) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
