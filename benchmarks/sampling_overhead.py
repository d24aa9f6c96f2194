"""Sampling with log-prob recording vs plain diffusers sampling, same model, one run.

For each model (the tiny SD3 and the ~10 M-parameter preset, both built offline) this times
``SD3RolloutAdapter.sample`` (SDE steps with per-sample seeded noise, log-probs, latents
recorded at every step, VAE decode to uint8) against ``StableDiffusion3Pipeline.__call__``
(its own Euler loop, VAE decode to numpy) on the same loaded pipeline, with the same
prompts, steps, batch, guidance and image size. Runs alternate (plain, recorded, plain, ...)
after a warm-up, so load from other processes on the machine hits both sides alike; the
table reports medians.

    uv run python benchmarks/sampling_overhead.py [--repeats 15] [--threads 1] [--sizes tiny 10m]
        [--device cpu|cuda] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from omnirl.models.device import synchronize
from omnirl.models.sd3 import SD3RolloutAdapter
from omnirl.models.sd3.tiny import make_tiny_sd3
from omnirl.protocol.messages import PromptSpec, SamplingParams

SETTINGS = {  # size -> (image side, prompts, group size)
    "tiny": (32, 2, 4),
    "10m": (32, 1, 4),
}


def bench(
    size: str, root: Path, *, repeats: int, steps: int, guidance: float, device: str, dtype
) -> dict:
    side, n_prompts, group = SETTINGS[size]
    path = make_tiny_sd3(root / size, size=size)
    adapter = SD3RolloutAdapter.from_pretrained(
        path, device=device, dtype=dtype, max_sequence_length=16
    )
    pipe = adapter.pipeline
    texts = [f"a photo of object {i}" for i in range(n_prompts)]
    prompts = [PromptSpec(group_id=f"g{i}", text=t) for i, t in enumerate(texts)]
    sampling = SamplingParams(
        group_size=group,
        num_steps=steps,
        guidance_scale=guidance,
        height=side,
        width=side,
        sde_type="sde",
        sde_window=None,  # every step stochastic and recorded: the most work
    )

    def plain() -> None:
        gens = [torch.Generator(device).manual_seed(i) for i in range(n_prompts * group)]
        pipe(
            texts,
            height=side,
            width=side,
            num_inference_steps=steps,
            guidance_scale=guidance,
            num_images_per_prompt=group,
            generator=gens,
            max_sequence_length=16,
            output_type="np",
        )

    def recorded() -> None:
        adapter.sample(prompts, sampling, lease_id="bench", worker_id="bench", policy_version=0)

    times: dict[str, list[float]] = {"plain": [], "recorded": []}
    with torch.no_grad():
        for _ in range(2):  # warm-up
            plain(), recorded()
        for _ in range(repeats):
            for name, fn in (("plain", plain), ("recorded", recorded)):
                synchronize(device)
                t0 = time.perf_counter()
                fn()
                synchronize(device)
                times[name].append(time.perf_counter() - t0)
    n_params = sum(p.numel() for p in pipe.transformer.parameters())
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "size": size,
        "params": n_params,
        "batch": f"{n_prompts}x{group} @ {side}px, {steps} steps, CFG {guidance}",
        "plain_s": med["plain"],
        "recorded_s": med["recorded"],
        "overhead": med["recorded"] / med["plain"] - 1.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--guidance", type=float, default=4.5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "10m"], choices=sorted(SETTINGS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            rows.append(
                bench(
                    size,
                    Path(tmp),
                    repeats=args.repeats,
                    steps=args.steps,
                    guidance=args.guidance,
                    device=args.device,
                    dtype=getattr(torch, args.dtype),
                )
            )
    print(
        f"device {args.device}, {args.dtype}, torch threads {args.threads}, {args.repeats} repeats"
    )
    print(
        "| model | transformer params | batch | plain diffusers (median s) | with log-probs (median s) | overhead |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['size']} | {r['params'] / 1e6:.2f} M | {r['batch']} | {r['plain_s']:.4f} "
            f"| {r['recorded_s']:.4f} | {100 * r['overhead']:+.1f} % |"
        )


if __name__ == "__main__":
    main()
