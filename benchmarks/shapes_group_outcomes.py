"""How much a GRPO group of ShapesEval samples disagrees with itself, per sampling mode.

A group-relative advantage is zero where every sample of a group scores the same, so a skill
can be learned only from groups whose samples differ in it. For the first ``--prompts``
prompts of one category in a prompt file (``--category all``: a seeded draw from every
category), this samples groups of ``--group`` images of a base model in each of ``--modes``
(by default the SDE window with one initial noise per group, the same window with a fresh
initial noise per sample, and the ODE; ``cps`` is the coefficients-preserving step on the
window with one initial noise per group) and prints, averaged over prompts: strict
accuracy, the within-group std of the partial reward, the fraction of samples whose
relation holds (position), the fraction of groups with mixed outcomes, the mean partial
reward, and the number of different colours a group draws (each image counted under the
colour of most of its detected objects). ``--category unnamed``: the prompts that name no
colour.

    uv run python benchmarks/shapes_group_outcomes.py MODEL_DIR \
        [--prompts-file examples/prompts/shapes_train.jsonl] [--category position] \
        [--prompts 48] [--group 16] [--threads 2] [--window 0 3] [--modes sde,sde_fresh,ode]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

# key -> (row label, sampling fields; the SDE window comes from --window, noise levels are
# the algorithms' defaults: flow_grpo 0.7, flow_grpo_cps 0.8)
MODES = {
    "sde": (
        "sde, one x_T per group",
        dict(sde_type="sde", noise_level=0.7, same_initial_noise=True),
    ),
    "sde_fresh": (
        "sde, fresh x_T",
        dict(sde_type="sde", noise_level=0.7, same_initial_noise=False),
    ),
    "ode": ("ode, fresh x_T", dict(sde_type="ode", same_initial_noise=False)),
    "cps": (
        "cps, one x_T per group",
        dict(sde_type="cps", noise_level=0.8, same_initial_noise=True),
    ),
}


def group_stats(scores) -> tuple[float, float, float, float, float, float, float]:
    """(strict, partial std, relation holds, relation mixed, strict mixed, partial mean,
    distinct dominant colours) of one group."""
    from omnirl.reward.shapes.detector import dominant_colour

    dominant = {dominant_colour(s) for s in scores} - {None}
    strict = np.array([s.strict for s in scores], dtype=np.float64)
    partial = np.array([s.partial for s in scores])
    relation = np.array([bool(s.details.get("relation_ok")) for s in scores], dtype=np.float64)
    return (
        strict.mean(),
        partial.std(),
        relation.mean(),
        float(0 < relation.mean() < 1),
        float(0 < strict.mean() < 1),
        partial.mean(),
        float(len(dominant)),
    )


def main(argv: list[str] | None = None) -> int:
    from omnirl.protocol.messages import SamplingParams
    from omnirl.reward.shapes import score_batch
    from omnirl.tools.eval_shapes import load_prompt_file, sample_specs
    from omnirl.tools.policy_loading import load_adapter

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="a ShapesT2I folder")
    parser.add_argument(
        "--prompts-file", type=Path, default=Path("examples/prompts/shapes_train.jsonl")
    )
    parser.add_argument(
        "--category", default="position", help="a category, all, or unnamed (no colour named)"
    )
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--window",
        type=int,
        nargs=2,
        default=(0, 3),
        metavar=("START", "END"),
        help="the stochastic steps [START, END) of the SDE modes",
    )
    parser.add_argument("--modes", default="sde,sde_fresh,ode", help=f"of {', '.join(MODES)}")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    if unknown := [m for m in modes if m not in MODES]:
        parser.error(f"unknown mode(s) {unknown}; known: {', '.join(MODES)}")
    torch.set_num_threads(args.threads)
    specs = load_prompt_file(args.prompts_file)
    if args.category == "all":
        order = np.random.default_rng(0).permutation(len(specs))
        specs = [specs[i] for i in order]
    elif args.category == "unnamed":
        specs = [s for s in specs if all(o.colour is None for o in s.objects)]
    else:
        specs = [s for s in specs if s.category == args.category]
    specs = specs[: args.prompts]
    if not specs:
        parser.error(f"no {args.category!r} prompts in {args.prompts_file}")
    adapter = load_adapter(args.model)
    print(f"{len(specs)} {args.category} prompts x {args.group} samples, {args.model}")
    print(
        "| mode | strict | partial std in a group | relation holds | groups mixed in relation "
        "| groups mixed in strict | partial | colours in a group |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, mode in (MODES[m] for m in modes):
        window = {} if mode["sde_type"] == "ode" else {"sde_window": tuple(args.window)}
        sampling = SamplingParams(
            group_size=args.group,
            seed=1,
            num_steps=10,
            guidance_scale=3.0,
            height=32,
            width=32,
            record_latents=False,
            record_images=True,
            **window,
            **mode,
        )
        groups = sample_specs(adapter, specs, sampling, batch_prompts=16, tag="g")
        rows = [group_stats(score_batch(g.images.numpy(), spec)) for g, spec in groups]
        mean = np.array(rows).mean(axis=0)
        print(f"| {name} | " + " | ".join(f"{v:.3f}" for v in mean) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
