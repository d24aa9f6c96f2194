"""How far a LoRA run moves the inputs of the float8-convertible linear layers.

A static float8 rollout (``rollout --float8 static``) fixes one input scale per layer at
calibration, ``margin x`` the largest input then seen; as the adapter trains, the inputs
move, and one that outgrows the margin saturates. This samples the same held-out prompts
and seeds with the base model and with each trained checkpoint (ODE, the run's sampling
settings from ``eval_shapes``) and prints, per checkpoint, the ratio of each layer's largest
input under the trained policy to the base model's: its maximum, median, and how many layers
are beyond 1.5 and 2 (the default margin). ``--stand-in TEXT`` instead compares the base
model's inputs over the prompts with those of one lease of ``TEXT`` (a compiled worker's
warm-up prompt), as ratios real / stand-in.

    uv run python benchmarks/float8_amax_growth.py outputs/run54/checkpoints/step_00000269 ...
    uv run python benchmarks/float8_amax_growth.py --stand-in warm-up \
        --prompts examples/prompts/shapes_train.jsonl
"""

from __future__ import annotations

import argparse
import statistics

import torch

from omnirl.models.compile import repeated_blocks
from omnirl.models.float8 import convertible_linears
from omnirl.protocol.messages import PromptSpec, SamplingParams
from omnirl.tools.eval_shapes import load_prompt_file
from omnirl.tools.policy_loading import load_adapter


def input_amax(adapter, texts: list[str], *, group: int, seed: int) -> dict[str, float]:
    """The largest ``|x|`` entering each convertible block linear layer over one ODE lease of
    ``texts`` (``group`` samples each); keys ``<block>.<layer>`` (PEFT's ``base_layer`` level
    folded, so a base model and a LoRA model share them)."""
    amax: dict[str, float] = {}
    hooks = []
    for index, block in enumerate(repeated_blocks(adapter.transformer)):
        for name, module in convertible_linears(block):
            key = f"{index}.{name}".replace(".base_layer", "")

            def record(_module, args, key=key):
                amax[key] = max(amax.get(key, 0.0), float(args[0].detach().abs().max()))

            hooks.append(module.register_forward_pre_hook(record))
    prompts = [PromptSpec(group_id=f"p{i}", text=t) for i, t in enumerate(texts)]
    sampling = SamplingParams(
        group_size=group,
        num_steps=10,
        guidance_scale=3.0,
        height=32,
        width=32,
        sde_type="ode",
        seed=seed,
    )
    try:
        adapter.sample(prompts, sampling, lease_id="amax", worker_id="amax", policy_version=0)
    finally:
        for hook in hooks:
            hook.remove()
    return amax


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoints", nargs="*", help="trainer checkpoints (or run folders)")
    p.add_argument("--stand-in", default=None, help="compare real prompts with this one")
    p.add_argument("--base", default="examples/checkpoints/shapes_t2i")
    p.add_argument("--prompts", default="examples/prompts/shapes_heldout.jsonl")
    p.add_argument("--limit", type=int, default=64, help="prompts sampled")
    p.add_argument("--group", type=int, default=2, help="samples per prompt")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    texts = [spec.text for spec in load_prompt_file(args.prompts)[: args.limit]]
    base_model = load_adapter(args.base)
    base = input_amax(base_model, texts, group=args.group, seed=args.seed)
    print(f"{len(base)} layers, {len(texts)} prompts x {args.group}")
    print("| against | max ratio | layer | median | layers > 1.5x | layers > 2x |")
    print("|---|---:|---|---:|---:|---:|")
    if args.stand_in is not None:
        group = len(texts) * args.group  # the same number of samples
        stand_in = input_amax(base_model, [args.stand_in], group=group, seed=args.seed)
        _row(f"base: real prompts / {args.stand_in!r}", base, stand_in)
    for checkpoint in args.checkpoints:
        trained = input_amax(load_adapter(checkpoint), texts, group=args.group, seed=args.seed)
        _row(f"`{checkpoint}` / base", trained, base)
    return 0


def _row(label: str, amax: dict[str, float], reference: dict[str, float]) -> None:
    ratios = {k: amax[k] / reference[k] for k in reference}
    top = max(ratios, key=ratios.get)
    values = list(ratios.values())
    print(
        f"| {label} | {ratios[top]:.2f} | {top} | {statistics.median(values):.2f} | "
        f"{sum(v > 1.5 for v in values)} | {sum(v > 2 for v in values)} |"
    )


if __name__ == "__main__":
    raise SystemExit(main())
