"""The rollout's LoRA as a branch against merged into the base weights, same model, one run.

Loads the committed ShapesEval base model twice with the quick start's adapter (r 32, alpha
64, attention and feed-forward), gives both the same random LoRA update, and times
``ShapesT2IRolloutAdapter.sample`` on the quick start's leases (one group of 16, 10 steps, CFG
3, SDE on steps 0-2) with the adapter as a branch and merged (``rollout --lora-mode``). Runs
alternate (branch, merged, branch, ...) after a warm-up, so load from other processes hits
both sides alike; the table reports medians. Also checks that both sample the same latents.

    uv run python benchmarks/rollout_lora_mode.py [--repeats 15] [--threads 1] [--write]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_report import replace_section  # noqa: E402

from omnirl.models.shapes_t2i.rollout_adapter import ShapesT2IRolloutAdapter  # noqa: E402
from omnirl.models.weights import lora_state  # noqa: E402
from omnirl.protocol.messages import PromptSpec, SamplingParams  # noqa: E402

MODEL = ROOT / "examples" / "checkpoints" / "shapes_t2i"
PROMPTS = ROOT / "examples" / "prompts" / "shapes_train.jsonl"
LORA = {
    "r": 32,
    "lora_alpha": 64,
    "target_modules": [
        "attn.to_q",
        "attn.to_k",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_q_proj",
        "attn.add_k_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "ff.net.0.proj",
        "ff.net.2",
    ],
}


def build(merged: bool, update: dict[str, torch.Tensor] | None) -> ShapesT2IRolloutAdapter:
    adapter = ShapesT2IRolloutAdapter.from_pretrained(MODEL, lora=LORA)
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
    gen = torch.Generator().manual_seed(0)
    template = ShapesT2IRolloutAdapter.from_pretrained(MODEL, lora=LORA)
    update = {
        k: torch.randn(v.shape, generator=gen) * 0.02
        for k, v in lora_state(template.transformer).items()
    }
    sides = {"branch": build(False, update), "merged": build(True, update)}
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()[:64]]
    sampling = SamplingParams(
        group_size=16,
        num_steps=10,
        guidance_scale=3.0,
        height=32,
        width=32,
        sde_window=(0, 3),
        same_initial_noise=True,
        seed=1,
    )

    def lease(i: int) -> list[PromptSpec]:
        row = rows[i % len(rows)]
        return [PromptSpec(group_id=f"g{i}", text=row["prompt"], metadata=row["metadata"])]

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
    rate = {k: 16 / statistics.median(v) for k, v in times.items()}
    text = "\n".join(
        [
            f"Measured {time.strftime('%Y-%m-%d')}: `uv run python benchmarks/rollout_lora_mode.py "
            f"--repeats {args.repeats} --threads {args.threads}` (torch {torch.__version__}, "
            f"{args.threads} thread(s)); leases of one group of 16, 10 steps, CFG 3.",
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
