"""Score a text-to-image checkpoint on ShapesEval prompts: strict accuracy per category.

    uv run python -m omnirl.tools.eval_shapes CHECKPOINT --prompts FILE --seeds 2 \
        [--cfg 3] [--steps 10] [--sde-type ode] [--lora DIR] [--out DIR] [--limit N] [--ema]

``CHECKPOINT`` is a model folder or a trainer checkpoint: ``checkpoints/step_N``, the
``checkpoints/latest`` pointer or the run's output folder (its latest checkpoint), sampled as
the base model its ``config.yaml`` names with the checkpoint's policy applied (``--ema``: its
EMA weights, ``policy_ema/``).

Each prompt is sampled ``--seeds`` times with the checkpoint's registered rollout adapter
(the same code path as RL rollouts; ``--sde-type ode`` is deterministic, the SDE types are
deterministic in ``--seed``) and scored by the ShapesEval detector. Prints strict accuracy
per category and overall with a 95 % bootstrap confidence interval over prompts (each
prompt's mean over its seeds is one observation, so seeds of one prompt are not counted as
independent), and writes ``OUT/eval.json`` and ``OUT/grid.png`` (first prompts x seeds).

The ``distinct`` column counts the different prompts among a category's lines. A prompt file
may repeat a prompt (ShapesEval's held-out file has 100 lines of two-object prompts, all of
one composition); the interval then measures the sampling noise of this checkpoint on this
file, and says nothing of how another run would fare on that composition.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from omnirl.reward.shapes import CATEGORIES, ShapeSpec, score_batch
from omnirl.reward.shapes.detector import MERGE_PARTS_HELP
from omnirl.reward.shapes.world import COLOURS
from omnirl.tools.policy_loading import load_adapter

BOOTSTRAP_RESAMPLES = 2000


@dataclasses.dataclass(slots=True)
class EvalRun:
    """Per-sample results of one evaluation: ``P`` prompts x ``S`` seeds."""

    specs: list[ShapeSpec]
    strict: np.ndarray  # bool [P, S]
    partial: np.ndarray  # float64 [P, S]
    images: np.ndarray  # uint8 [P, S, H, W, 3]
    seconds: float
    # detected objects of each palette colour (``COLOURS`` order; objects of no palette colour
    # are not counted) per image, int64 [P, S, C]; None where the run kept no detections
    colours: np.ndarray | None = None


def load_prompt_file(path: str | Path) -> list[ShapeSpec]:
    """Specs from a JSONL prompt file (``{"prompt", "metadata"}`` per line, the trainer's
    prompt format, as written by
    ``omnirl.tools.shapes_prompts``); lines without metadata are parsed from their text."""
    specs = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON: {e}") from e
        meta = row.get("metadata")
        specs.append(ShapeSpec.from_metadata(meta) if meta else ShapeSpec.from_text(row["prompt"]))
    if not specs:
        raise ValueError(f"{path}: no prompts")
    return specs


def evaluate(
    adapter,
    specs: list[ShapeSpec],
    *,
    seeds: int = 2,
    batch_prompts: int = 32,
    merge_parts: bool = False,
    **sampling_options: Any,
) -> EvalRun:
    """Sample ``seeds`` images of every spec with a rollout adapter and score them (the
    detector's ``merge_parts`` as given); ``sampling_options`` are :func:`eval_sampling`'s
    (guidance scale, steps, SDE type, image size, seed)."""
    sampling = eval_sampling(seeds, **sampling_options)
    t0 = time.perf_counter()
    images = np.zeros((len(specs), seeds, sampling.height, sampling.width, 3), dtype=np.uint8)
    groups = sample_specs(adapter, specs, sampling, batch_prompts=batch_prompts, tag="eval")
    for i, (group, _) in enumerate(groups):
        images[i] = group.images.numpy()
    run = score_images(images, specs, merge_parts=merge_parts)
    run.seconds = time.perf_counter() - t0
    return run


def score_images(
    images: np.ndarray, specs: list[ShapeSpec], *, merge_parts: bool = False
) -> EvalRun:
    """Score ``images`` uint8 ``[P, S, H, W, 3]`` (``S`` images of ``specs[p]`` each) with the
    ShapesEval detector (``merge_parts``: its option): strict, partial and the detected
    objects' colours."""
    p, s = images.shape[:2]
    if p != len(specs):
        raise ValueError(f"{p} rows of images for {len(specs)} prompts")
    strict = np.zeros((p, s), dtype=bool)
    partial = np.zeros((p, s), dtype=np.float64)
    colours = np.zeros((p, s, len(COLOURS)), dtype=np.int64)
    for i, spec in enumerate(specs):
        for k, sc in enumerate(score_batch(images[i], spec, merge_parts=merge_parts)):
            strict[i, k] = sc.strict
            partial[i, k] = sc.partial
            for o in sc.details.get("objects", ()):
                if o["colour"] in COLOURS:  # not "unknown"
                    colours[i, k, COLOURS.index(o["colour"])] += 1
    return EvalRun(specs, strict, partial, images, 0.0, colours)


def eval_sampling(
    seeds: int,
    *,
    guidance_scale: float = 3.0,
    num_steps: int = 10,
    sde_type: str = "ode",
    image_size: int = 32,
    seed: int = 0,
):
    """The :class:`SamplingParams` of an evaluation (its defaults are every ShapesEval
    score's): ``seeds`` images a prompt, images returned, no latents recorded."""
    from omnirl.protocol.messages import SamplingParams

    return SamplingParams(
        group_size=seeds,
        seed=seed,
        num_steps=num_steps,
        guidance_scale=guidance_scale,
        height=image_size,
        width=image_size,
        sde_type=sde_type,
        record_latents=False,
        record_images=True,
    )


def sample_specs(
    adapter, specs: list[ShapeSpec], sampling, *, batch_prompts: int = 32, tag: str = "eval"
) -> Iterator[tuple[Any, ShapeSpec]]:
    """``(group, spec)`` for every spec in order: one group of ``sampling.group_size`` images
    each, sampled by the rollout adapter ``batch_prompts`` prompts at a time. Group ids are
    ``f"{tag}-{index}"`` (the per-sample noise seeds follow from them)."""
    from omnirl.protocol.messages import PromptSpec

    for start in range(0, len(specs), batch_prompts):
        chunk = specs[start : start + batch_prompts]
        prompts = [
            PromptSpec(group_id=f"{tag}-{start + j}", text=s.text, metadata=s.to_metadata())
            for j, s in enumerate(chunk)
        ]
        groups = adapter.sample(prompts, sampling, lease_id=tag, worker_id=tag, policy_version=0)
        yield from zip(groups, chunk, strict=True)


def bootstrap_ci(values: np.ndarray, *, seed: int = 0) -> tuple[float, float]:
    """95 % percentile bootstrap interval of the mean of ``values`` ``[P]`` (one per prompt
    line, each resampled on its own)."""
    return cluster_bootstrap_ci(values, list(range(len(values))), seed=seed)


def cluster_bootstrap_ci(
    values: np.ndarray, clusters: list[Any], *, seed: int = 0
) -> tuple[float, float]:
    """95 % percentile bootstrap interval of the mean of ``values`` ``[P]`` resampling whole
    clusters (``clusters[i]``: line ``i``'s distinct prompt; its lines move together): the
    interval for other prompts of this kind, where :func:`bootstrap_ci`'s is for these lines.
    With a handful of distinct prompts it is as rough as that handful."""
    if len(values) == 0:
        return (float("nan"), float("nan"))
    ids: dict[Any, int] = {}
    inverse = np.array([ids.setdefault(c, len(ids)) for c in clusters])
    sums = np.bincount(inverse, weights=values, minlength=len(ids))
    counts = np.bincount(inverse, minlength=len(ids))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(ids), size=(BOOTSTRAP_RESAMPLES, len(ids)))
    means = sums[idx].sum(axis=1) / counts[idx].sum(axis=1)
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def summarise(run: EvalRun) -> dict[str, Any]:
    """``{"overall": {...}, "categories": {cat: {...}}}``; each entry holds ``strict``,
    ``ci95`` (bootstrap over prompts), ``partial``, ``prompts`` (lines), ``distinct`` (different
    prompts among them) and ``samples``."""
    cats = np.array([s.category for s in run.specs])

    def entry(mask: np.ndarray) -> dict[str, Any]:
        per_prompt = run.strict[mask].mean(axis=1)
        lo, hi = bootstrap_ci(per_prompt)
        return {
            "strict": float(per_prompt.mean()) if mask.any() else float("nan"),
            "ci95": [lo, hi],
            "partial": float(run.partial[mask].mean()) if mask.any() else float("nan"),
            "prompts": int(mask.sum()),
            "distinct": len({run.specs[i] for i in np.flatnonzero(mask)}),
            "samples": int(run.strict[mask].size),
        }

    summary = {
        "overall": entry(np.ones(len(run.specs), dtype=bool)),
        "categories": {c: entry(cats == c) for c in CATEGORIES if (cats == c).any()},
        "seconds": run.seconds,
    }
    if run.colours is not None:
        summary["unnamed_colours"] = unnamed_colours(run)
    return summary


def unnamed_colours(run: EvalRun) -> dict[str, Any]:
    """The colours a checkpoint draws where the prompt leaves the colour free.

    Over the images of prompts that name no colour (which the reward scores the same in any
    palette colour): ``images``, ``objects`` (detected objects), ``shares`` (each colour's
    share of those objects), ``top`` (the most frequent colour) and ``entropy`` (of the
    shares, divided by log of the palette size: 1 for every colour equally often, 0 for one
    colour only). A policy that collapses onto one colour shows ``entropy`` near 0, which no
    strict accuracy reveals. Pooled over prompts: it does not see a policy that draws each
    prompt in a fixed colour of its own."""
    free = np.array([all(o.colour is None for o in s.objects) for s in run.specs], dtype=bool)
    counts = run.colours[free].reshape(-1, len(COLOURS)).sum(axis=0) if free.any() else None
    objects = int(counts.sum()) if counts is not None else 0
    if objects == 0:
        return {
            "images": int(run.strict[free].size),
            "objects": 0,
            "shares": {},
            "top": None,
            "entropy": float("nan"),
        }
    shares = counts / objects
    nonzero = shares[shares > 0]
    entropy = max(0.0, float(-(nonzero * np.log(nonzero)).sum() / np.log(len(COLOURS))))
    return {
        "images": int(run.strict[free].size),
        "objects": objects,
        "shares": {c: float(x) for c, x in zip(COLOURS, shares, strict=True)},
        "top": COLOURS[int(shares.argmax())],
        "entropy": entropy,
    }


def format_table(summary: dict[str, Any]) -> str:
    lines = [
        f"{'category':<14} {'strict':>7} {'95% CI':>15} {'partial':>8} {'prompts':>8} "
        f"{'distinct':>8}"
    ]
    rows = [*summary["categories"].items(), ("overall", summary["overall"])]
    for name, e in rows:
        lo, hi = e["ci95"]
        lines.append(
            f"{name:<14} {e['strict']:>7.3f} {f'[{lo:.3f}, {hi:.3f}]':>15} "
            f"{e['partial']:>8.3f} {e['prompts']:>8d} {e['distinct']:>8d}"
        )
    free = summary.get("unnamed_colours")
    if free and free["objects"]:
        ranked = sorted(free["shares"].items(), key=lambda item: -item[1])
        shares = ", ".join(f"{c} {x:.2f}" for c, x in ranked)
        lines.append(
            f"colours where the prompt names none ({free['images']} images, {free['objects']} "
            f"objects): {shares}; entropy {free['entropy']:.2f} of 1"
        )
    return "\n".join(lines)


def write_grid(run: EvalRun, path: str | Path, *, rows: int = 12, scale: int = 3) -> Path:
    """PNG of the first ``rows`` prompts (one row each, seeds across), upscaled ``scale``x;
    a green or red bar under each image marks strict pass or fail."""
    from PIL import Image

    p = min(rows, len(run.specs))
    _, s, h, w, _ = run.images.shape
    bar = 2
    grid = np.full((p * (h + bar + 1), s * (w + 1), 3), 255, dtype=np.uint8)
    for i in range(p):
        for k in range(s):
            y, x = i * (h + bar + 1), k * (w + 1)
            grid[y : y + h, x : x + w] = run.images[i, k]
            grid[y + h : y + h + bar, x : x + w] = (
                (40, 170, 60) if run.strict[i, k] else (210, 40, 40)
            )
    img = Image.fromarray(grid).resize(
        (grid.shape[1] * scale, grid.shape[0] * scale), Image.NEAREST
    )
    path = Path(path)
    img.save(path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m omnirl.tools.eval_shapes", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "checkpoint",
        type=Path,
        help="model folder, or a trainer checkpoint (step_N, checkpoints/latest, a run folder)",
    )
    parser.add_argument("--prompts", type=Path, required=True, help="JSONL prompt file")
    parser.add_argument("--seeds", type=int, default=2, help="samples per prompt")
    parser.add_argument("--cfg", type=float, default=3.0, help="guidance scale")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--sde-type", default="ode", choices=("ode", "sde", "cps", "dance_sde"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lora", type=Path, default=None, help="LoRA folder (trainer-saved)")
    parser.add_argument("--lora-alpha", type=float, default=None, help="default: its rank")
    parser.add_argument(
        "--ema", action="store_true", help="a trainer checkpoint's EMA weights (policy_ema/)"
    )
    parser.add_argument(
        "--merge-parts",
        action="store_true",
        help=MERGE_PARTS_HELP,
    )
    parser.add_argument("--limit", type=int, default=None, help="first N prompts only")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--out", type=Path, default=None, help="default: runs/eval_shapes/<time>")
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.steps < 1:
        parser.error("--seeds and --steps must be >= 1")

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    specs = load_prompt_file(args.prompts)[: args.limit]
    adapter = load_adapter(
        args.checkpoint,
        device=args.device,
        lora=args.lora,
        lora_alpha=args.lora_alpha,
        ema=args.ema,
    )
    run = evaluate(
        adapter,
        specs,
        seeds=args.seeds,
        guidance_scale=args.cfg,
        num_steps=args.steps,
        sde_type=args.sde_type,
        seed=args.seed,
        merge_parts=args.merge_parts,
    )
    summary = summarise(run)
    summary["config"] = {
        "checkpoint": str(args.checkpoint),
        "prompts": str(args.prompts),
        "seeds": args.seeds,
        "cfg": args.cfg,
        "steps": args.steps,
        "sde_type": args.sde_type,
        "seed": args.seed,
        "lora": str(args.lora) if args.lora else None,
        "ema": args.ema,
        "merge_parts": args.merge_parts,
    }
    out = args.out or Path("runs/eval_shapes") / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_grid(run, out / "grid.png")
    print(format_table(summary))
    print(f"{len(specs)} prompts x {args.seeds} seeds in {run.seconds:.1f} s; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
