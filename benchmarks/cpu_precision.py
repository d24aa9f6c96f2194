"""float32 against bf16 on a CPU, eager and compiled: the quick start's rollout and training work.

The quick start's model and LoRA (``examples/shapes_flow_grpo_lora.yaml``), on this machine's CPU:

- **rollout**: ``ShapesT2IRolloutAdapter.sample`` on leases of one group shaped by the
  config (``data.group_size``, ``sampling``): float32 with the LoRA merged (the rollout's
  ``auto`` in float32) and bf16 with the LoRA as a branch (``auto`` in bf16), each eager and
  compiled (``rollout --compile``);
- **training**: the trainer's work per micro-batch of the config's ``micro_batch_size``
  samples at one trained step: ``SD3TrainingAdapter.transition`` forward and backward of the
  summed log-probs, plus the LoRA-disabled reference pass (``kl_beta`` > 0), on transitions
  the rollout recorded; float32 and bf16, eager and compiled (``train.compile``);
- **attention kernel**: SDPA forward + backward at the model's attention shape, bf16 against
  float32 inputs: why a bf16 model on a CPU runs its attention in float32
  (``omnirl.models.device.Float32Attention``).

Sides alternate after warm-up (compilation included there and reported), so load from other
processes hits all alike; medians are reported, as ratios to the float32 eager side.

    uv run python benchmarks/cpu_precision.py [--repeats 6] [--threads 1] [--write]

``--group-size`` and ``--micro`` shrink the work below the config's and ``--compile-backend
aot_eager`` traces without generating kernels (a smoke test of the script); the numbers in
``docs/benchmarks.md`` are the config's sizes under inductor.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_report import replace_section
from shapes_quick_start import (
    CONFIG,
    ROOT,
    random_lora_update,
    training_leases,
)

from omnirl.models.compile import CompileConfig
from omnirl.models.shapes_t2i.rollout_adapter import ShapesT2IRolloutAdapter
from omnirl.models.shapes_t2i.training_adapter import ShapesT2ITrainingAdapter
from omnirl.models.transitions import collate_transitions
from omnirl.models.weights import lora_targets
from omnirl.trainer.algorithms.windows import lease_sampling_params
from omnirl.trainer.config import LoraConfig, load_config

SIDES = ("float32 eager", "bf16 eager", "float32 compiled", "bf16 compiled")


def build_sides(
    build: Callable[[torch.dtype], object], compile_config: CompileConfig
) -> dict[str, object]:
    """One adapter per side of :data:`SIDES`: ``build(dtype)``, compiled where the side is."""
    sides = {}
    for name in SIDES:
        adapter = build(torch.bfloat16 if name.startswith("bf16") else torch.float32)
        if "compiled" in name:
            adapter.compile(compile_config)
        sides[name] = adapter
    return sides


def rollout_adapter(cfg, update: dict[str, torch.Tensor], dtype) -> ShapesT2IRolloutAdapter:
    """The rollout's adapter as ``rollout --lora-mode auto`` runs it: merged in float32, a
    branch in bf16, holding ``update``."""
    lora = LoraConfig.peft_kwargs(cfg.model.lora)
    adapter = ShapesT2IRolloutAdapter.from_pretrained(ROOT / cfg.model.path, dtype=dtype, lora=lora)
    if dtype == torch.float32:
        adapter.merge_lora()
    adapter.load_weights("lora", update)
    return adapter


def training_adapter(cfg, update: dict[str, torch.Tensor], dtype) -> ShapesT2ITrainingAdapter:
    """The trainer's adapter with its (float32) LoRA parameters set to ``update``."""
    lora = LoraConfig.peft_kwargs(cfg.model.lora)
    adapter = ShapesT2ITrainingAdapter.from_pretrained(
        ROOT / cfg.model.path, dtype=dtype, lora=lora
    )
    with torch.no_grad():
        targets = lora_targets(adapter.transformer)
        for key, value in update.items():
            targets[key].copy_(value)
    return adapter


def time_alternating(
    work: dict[str, Callable[[], None]], repeats: int
) -> tuple[dict[str, float], dict[str, float]]:
    """(median seconds per call, seconds of the first two calls) for each side."""
    first = {}
    for name, fn in work.items():
        start = time.perf_counter()
        fn()
        fn()
        first[name] = time.perf_counter() - start
    times: dict[str, list[float]] = {name: [] for name in work}
    for _ in range(repeats):
        for name, fn in work.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}, first


def attention_kernel(batch: int, heads: int, tokens: int, head_dim: int, repeats: int):
    """Median seconds of SDPA forward + backward in bf16 and in float32, same values."""
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(batch, heads, tokens, head_dim, generator=gen) for _ in range(3)]

    def run(dtype):
        q, k, v = (t.to(dtype).requires_grad_() for t in base)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        out.float().square().sum().backward()

    med, _ = time_alternating(
        {"bf16": lambda: run(torch.bfloat16), "float32": lambda: run(torch.float32)}, repeats
    )
    return med


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--group-size", type=int, default=None, help="default: the config's")
    p.add_argument("--micro", type=int, default=None, help="default: the config's")
    p.add_argument("--compile-backend", default="inductor", help="aot_eager: no kernels")
    p.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = p.parse_args(argv)
    if args.write and (args.group_size or args.micro or args.compile_backend != "inductor"):
        p.error(
            "--write records the config's sizes under inductor: drop --group-size, "
            "--micro and --compile-backend"
        )
    compile_config = CompileConfig(backend=args.compile_backend)
    torch.set_num_threads(args.threads)
    cfg = load_config(CONFIG)
    sampling = lease_sampling_params(cfg, seed=1)  # what the trainer leases
    if args.group_size:
        sampling = msgspec.structs.replace(sampling, group_size=args.group_size)
    lease = training_leases()
    lora = LoraConfig.peft_kwargs(cfg.model.lora)
    probe = ShapesT2IRolloutAdapter.from_pretrained(ROOT / cfg.model.path, lora=lora)
    update = random_lora_update(probe.transformer)
    probe.load_weights("lora", update)

    # rollout
    roll = build_sides(lambda dtype: rollout_adapter(cfg, update, dtype), compile_config)
    counter = iter(range(10**9))

    def sample(adapter) -> None:
        adapter.sample(
            lease(next(counter)), sampling, lease_id="l", worker_id="w", policy_version=0
        )

    roll_med, roll_first = time_alternating(
        {name: (lambda a=a: sample(a)) for name, a in roll.items()}, args.repeats
    )
    del roll

    # training: transitions recorded by the float32 rollout, one micro-batch at the first
    # trained step; the loss is the summed log-prob (its backward is the trainer's)
    micro = args.micro or int(cfg.algorithm.overrides.get("micro_batch_size", 64))
    groups = []
    while sum(int(g.latents.shape[0]) for g in groups) < micro:
        groups += probe.sample(
            lease(len(groups)), sampling, lease_id="l", worker_id="w", policy_version=0
        )
    batch = collate_transitions(groups, 0).select(torch.arange(micro))
    sde_type = sampling.sde_type
    train = build_sides(lambda dtype: training_adapter(cfg, update, dtype), compile_config)

    def step(adapter):
        out = adapter.transition(batch, sde_type=sde_type)
        out.log_prob.sum().backward()
        with torch.no_grad(), adapter.reference():
            adapter.transition(batch, sde_type=sde_type)

    train_med, train_first = time_alternating(
        {name: (lambda a=a: step(a)) for name, a in train.items()}, args.repeats
    )
    tcfg = probe.transformer.config
    h, w = groups[0].latents.shape[-2:]
    tokens = (int(h) // tcfg.patch_size) * (int(w) // tcfg.patch_size)
    tokens += int(groups[0].prompt_embeds.shape[-2])  # joint attention: image + text tokens
    kernel = attention_kernel(
        2 * micro, tcfg.num_attention_heads, tokens, tcfg.attention_head_dim, args.repeats
    )

    g = sampling.group_size
    lines = [
        f"Measured {time.strftime('%Y-%m-%d')}: `uv run python benchmarks/cpu_precision.py "
        f"--repeats {args.repeats} --threads {args.threads}` (torch {torch.__version__}, "
        f"{args.threads} thread(s)). Rollout: leases of one group of {g}, {sampling.num_steps} "
        f"steps, CFG {sampling.guidance_scale:g}; training: a micro-batch of {micro} samples at "
        "one trained step, forward + backward + the reference pass (`"
        f"{CONFIG.relative_to(ROOT)}`).",
        "",
        "| side | rollout s/group | vs float32 eager | training s/micro-batch | vs float32 eager "
        "| first two calls (rollout / training, s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in SIDES:
        lines.append(
            f"| {name} | {roll_med[name]:.3f} | {roll_med[SIDES[0]] / roll_med[name]:.2f}x | "
            f"{train_med[name]:.3f} | {train_med[SIDES[0]] / train_med[name]:.2f}x | "
            f"{roll_first[name]:.1f} / {train_first[name]:.1f} |"
        )
    lines += [
        "",
        f"SDPA forward + backward alone at the model's attention shape ({2 * micro} rows, "
        f"{tcfg.num_attention_heads} heads, {tokens} tokens, head dim "
        f"{tcfg.attention_head_dim}): bf16 {kernel['bf16'] * 1e3:.1f} ms, float32 "
        f"{kernel['float32'] * 1e3:.1f} ms ({kernel['bf16'] / kernel['float32']:.1f}x): the "
        "reason a bf16 model's attention runs in float32 on a CPU.",
    ]
    text = "\n".join(lines)
    print(text)
    if args.write:
        replace_section(ROOT / "docs" / "benchmarks.md", "cpu_precision", text, "## bf16 on a CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
