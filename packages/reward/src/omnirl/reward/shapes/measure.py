"""Measure the ShapesEval detector on renders: accuracy per category, robustness, speed.

    uv run python -m omnirl.reward.shapes.measure --per-category 100 --sizes 32,64

For every category, ``per-category`` prompts (half train, half held-out) are rendered
with ``group`` seeds each and scored clean, with Gaussian noise and with a slight blur;
the table is the strict pass rate. Then render and score throughput on this machine.

``--by-colour``: the same conditions per palette colour instead, for prompts that name no
colour (single object and counting, every shape and count): is the detector as robust to
noise and blur for every colour? A colour it reads more reliably is a colour that a policy
trained on it is paid to draw.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import numpy as np

from omnirl.reward.shapes.detector import MERGE_PARTS_HELP, score_batch
from omnirl.reward.shapes.render import render
from omnirl.reward.shapes.world import (
    CATEGORIES,
    COLOURS,
    COUNTS,
    SHAPES,
    ShapeObject,
    ShapeSpec,
    generate_prompts,
)


def gaussian_noise(image: np.ndarray, sigma: float, seed: int) -> np.ndarray:
    """``image`` plus i.i.d. Gaussian noise of ``sigma`` (uint8 units), clipped."""
    noise = np.random.default_rng(seed).normal(0.0, sigma, image.shape)
    return np.clip(np.rint(image + noise), 0, 255).astype(np.uint8)


def blur(image: np.ndarray) -> np.ndarray:
    """Separable ``[1, 2, 1] / 4`` blur (about a Gaussian of sigma 0.7 px), edges replicated."""
    f = image.astype(np.float32)
    p = np.pad(f, ((1, 1), (0, 0), (0, 0)), mode="edge")
    f = 0.25 * p[:-2] + 0.5 * p[1:-1] + 0.25 * p[2:]
    p = np.pad(f, ((0, 0), (1, 1), (0, 0)), mode="edge")
    f = 0.25 * p[:, :-2] + 0.5 * p[:, 1:-1] + 0.25 * p[:, 2:]
    return np.clip(np.rint(f), 0, 255).astype(np.uint8)


Transform = Callable[[np.ndarray, int], np.ndarray]
CONDITIONS: dict[str, Transform] = {
    "clean": lambda image, seed: image,
    "noise4": lambda image, seed: gaussian_noise(image, 4.0, seed),
    "noise8": lambda image, seed: gaussian_noise(image, 8.0, seed),
    "noise15": lambda image, seed: gaussian_noise(image, 15.0, seed),
    "blur": lambda image, seed: blur(image),
    "noise30": lambda image, seed: gaussian_noise(image, 30.0, seed),
    "blur_noise15": lambda image, seed: gaussian_noise(blur(image), 15.0, seed),
}
DEFAULT_CONDITIONS = ("clean", "noise4", "noise8", "noise15", "blur")


def balanced_specs(per_category: int, seed: int) -> list[ShapeSpec]:
    """``per_category`` prompts per category, half from each split."""
    out: list[ShapeSpec] = []
    for category in CATEGORIES:
        for split, n in (
            ("train", per_category // 2),
            ("heldout", per_category - per_category // 2),
        ):
            out += generate_prompts(n, split, seed=seed, categories=(category,))
    return out


def strict_rates(
    specs: list[ShapeSpec],
    size: int,
    transform: Transform,
    group: int,
    scorer: Callable = score_batch,
) -> tuple[dict[str, float], float]:
    """Strict pass rate per category and the mean partial score (``scorer``: as in
    :func:`colour_rates`)."""
    passed: dict[str, list[bool]] = {}
    partial: list[float] = []
    for i, spec in enumerate(specs):
        seeds = [group * i + k for k in range(group)]
        images = np.stack([transform(render(spec, size, s), s) for s in seeds])
        for result in scorer(images, spec):
            passed.setdefault(spec.category, []).append(result.strict)
            partial.append(result.partial)
    return {c: float(np.mean(v)) for c, v in passed.items()}, float(np.mean(partial))


def colour_rates(
    size: int, transform: Transform, seeds: int, scorer: Callable = score_batch
) -> dict[str, tuple[float, float]]:
    """Per palette colour: (mean partial, strict rate) of renders in that colour scored
    against the same prompt with no colour named (``"a photo of three circles"``).

    ``scorer``: ``score_batch``, or a variant with its signature to compare rules."""
    out: dict[str, tuple[float, float]] = {}
    for colour in COLOURS:
        partial: list[float] = []
        strict: list[bool] = []
        for shape in SHAPES:
            for count in (1, *COUNTS):
                category = "single_object" if count == 1 else "counting"
                drawn = ShapeSpec(category, (ShapeObject(count, colour, shape),))
                asked = ShapeSpec(category, (ShapeObject(count, None, shape),))
                images = np.stack([transform(render(drawn, size, k), k) for k in range(seeds)])
                for result in scorer(images, asked):
                    partial.append(result.partial)
                    strict.append(result.strict)
        out[colour] = (float(np.mean(partial)), float(np.mean(strict)))
    return out


def throughput(
    specs: list[ShapeSpec], size: int, group: int, scorer: Callable = score_batch
) -> tuple[float, float]:
    """Rendered and scored (groups of ``group``) images per CPU-second of this process.

    CPU time, not wall time, so that other jobs on a shared machine do not skew it; the
    work is single-threaded numpy, so it is also the rate of one free core.
    """
    start = time.process_time()
    groups = [
        np.stack([render(s, size, group * i + k) for k in range(group)])
        for i, s in enumerate(specs)
    ]
    render_rate = len(specs) * group / (time.process_time() - start)
    start = time.process_time()
    for spec, images in zip(specs, groups, strict=True):
        scorer(images, spec)
    return render_rate, len(specs) * group / (time.process_time() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omnirl.reward.shapes.measure")
    parser.add_argument("--per-category", type=int, default=100)
    parser.add_argument("--group", type=int, default=2, help="seeds per prompt")
    parser.add_argument("--sizes", default="32,64")
    parser.add_argument(
        "--conditions", default=",".join(DEFAULT_CONDITIONS), help=f"of {', '.join(CONDITIONS)}"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--by-colour",
        action="store_true",
        help="per palette colour, prompts naming no colour (--group seeds per prompt)",
    )
    parser.add_argument(
        "--merge-parts",
        action="store_true",
        help=MERGE_PARTS_HELP,
    )
    args = parser.parse_args(argv)
    args.scorer = functools.partial(score_batch, merge_parts=args.merge_parts)
    if args.by_colour:
        return _print_by_colour(args)
    specs = balanced_specs(args.per_category, args.seed)
    header = " ".join(f"{c:>13}" for c in CATEGORIES)
    for size in (int(s) for s in args.sizes.split(",")):
        print(f"size {size}: {len(specs)} prompts x {args.group} seeds; strict pass rate")
        print(f"{'condition':>9} {header} {'all':>6} {'partial':>8}")
        for name in args.conditions.split(","):
            rates, partial = strict_rates(specs, size, CONDITIONS[name], args.group, args.scorer)
            overall = float(np.mean(list(rates.values())))
            row = " ".join(f"{rates[c]:>13.3f}" for c in CATEGORIES)
            print(f"{name:>9} {row} {overall:>6.3f} {partial:>8.3f}")
        sample = specs[:: max(1, len(specs) // 120)]
        render_rate, score_rate = throughput(sample, size, 16, args.scorer)
        print(f"render {render_rate:,.0f} images/CPU-s, score {score_rate:,.0f} images/CPU-s")
    return 0


def _print_by_colour(args: argparse.Namespace) -> int:
    conditions = args.conditions.split(",")
    for size in (int(s) for s in args.sizes.split(",")):
        n = len(SHAPES) * (1 + len(COUNTS)) * args.group
        print(f"size {size}: {n} renders per colour, prompts naming no colour; partial / strict")
        print(f"{'colour':>8} " + " ".join(f"{c:>15}" for c in conditions))
        table = {c: colour_rates(size, CONDITIONS[c], args.group, args.scorer) for c in conditions}
        for colour in COLOURS:
            cells = " ".join(
                f"{table[c][colour][0]:>8.3f} / {table[c][colour][1]:.2f}" for c in conditions
            )
            print(f"{colour:>8} {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
