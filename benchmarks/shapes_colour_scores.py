"""How the ShapesEval reward scores each colour where the prompt names none.

    uv run python benchmarks/shapes_colour_scores.py CHECKPOINT [--prompts FILE] [--limit 300] \
        [--seeds 4] [--threads 2] [--out FILE.json]

The prompts of ``--prompts`` (default: the training file) that name no colour (single object,
two objects, counting), the first ``--limit``, are sampled as ``eval_shapes`` samples them
(``--seeds`` images each) and scored by the detector; each image is put under the colour of
most of its detected objects, and the table gives, per colour: images, strict and mean
partial (the training reward). Beside it, the same prompts rendered by the deterministic
renderer in each colour, clean and with noise (sigma 18) after a [1, 2, 1] / 4 blur: the
detector's own preference between colours, without the model. A reward that scores some
colours higher on the model's images pushes a policy toward them while no prompt asks for a
colour.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np
import torch

from omnirl.reward.shapes.detector import score_batch
from omnirl.reward.shapes.render import render
from omnirl.reward.shapes.world import COLOURS, ShapeSpec
from omnirl.tools.eval_shapes import evaluate, load_prompt_file
from omnirl.tools.policy_loading import load_adapter


def unnamed(specs: list[ShapeSpec]) -> list[ShapeSpec]:
    return [s for s in specs if all(o.colour is None for o in s.objects)]


def by_dominant_colour(run) -> dict[str, dict[str, float]]:
    """Per colour: images whose detected objects are mostly of it, their strict and partial."""
    counts = run.colours  # [P, S, C]
    dominant = counts.argmax(axis=-1)
    seen = counts.sum(axis=-1) > 0
    rows = {}
    for c, name in enumerate(COLOURS):
        mask = seen & (dominant == c)
        rows[name] = {
            "images": int(mask.sum()),
            "strict": float(run.strict[mask].mean()) if mask.any() else float("nan"),
            "partial": float(run.partial[mask].mean()) if mask.any() else float("nan"),
        }
    return rows


def _blur(images: np.ndarray) -> np.ndarray:
    """[1, 2, 1] / 4 along both image axes of ``images`` float [N, H, W, 3], edges repeated."""
    for axis in (1, 2):
        padded = np.concatenate(
            [np.take(images, [0], axis=axis), images, np.take(images, [-1], axis=axis)], axis=axis
        )
        n = images.shape[axis]
        images = (
            np.take(padded, range(0, n), axis=axis)
            + 2 * np.take(padded, range(1, n + 1), axis=axis)
            + np.take(padded, range(2, n + 2), axis=axis)
        ) / 4
    return images


def rendered_in_each_colour(specs: list[ShapeSpec], *, seeds: int, noise: float) -> dict:
    """Per colour: the renderer's images of ``specs`` in that colour, scored against the
    colourless spec; ``noise`` > 0 blurs them and adds Gaussian noise of that sigma."""
    rng = np.random.default_rng(0)
    rows = {}
    for colour in COLOURS:
        strict, partial = [], []
        for spec in specs:
            objects = tuple(dataclasses.replace(o, colour=colour) for o in spec.objects)
            coloured = dataclasses.replace(spec, objects=objects)
            images = np.stack([render(coloured, 32, seed=k) for k in range(seeds)])
            if noise > 0:
                images = _blur(images.astype(np.float64)) + rng.normal(0, noise, images.shape)
                images = np.clip(np.rint(images), 0, 255).astype(np.uint8)
            for sc in score_batch(images, spec):
                strict.append(sc.strict)
                partial.append(sc.partial)
        rows[colour] = {"strict": float(np.mean(strict)), "partial": float(np.mean(partial))}
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--prompts", type=Path, default=Path("examples/prompts/shapes_train.jsonl"))
    parser.add_argument("--limit", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    specs = unnamed(load_prompt_file(args.prompts))[: args.limit]
    if not specs:
        raise SystemExit(f"{args.prompts}: no prompt names no colour")
    run = evaluate(load_adapter(args.checkpoint), specs, seeds=args.seeds)
    result = {
        "checkpoint": args.checkpoint,
        "prompts": str(args.prompts),
        "n_prompts": len(specs),
        "seeds": args.seeds,
        "model": by_dominant_colour(run),
        "rendered_clean": rendered_in_each_colour(specs, seeds=args.seeds, noise=0.0),
        "rendered_noisy": rendered_in_each_colour(specs, seeds=args.seeds, noise=18.0),
    }
    print(f"{args.checkpoint}: {len(specs)} prompts naming no colour x {args.seeds} seeds")
    print(
        f"{'colour':<8} {'images':>6} {'strict':>7} {'partial':>8}   rendered clean / noisy: strict, partial"
    )
    for c in COLOURS:
        m, clean, noisy = (result[k][c] for k in ("model", "rendered_clean", "rendered_noisy"))
        print(
            f"{c:<8} {m['images']:>6d} {m['strict']:>7.3f} {m['partial']:>8.3f}   "
            f"{clean['strict']:.3f}, {clean['partial']:.3f} / {noisy['strict']:.3f}, "
            f"{noisy['partial']:.3f}"
        )
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
