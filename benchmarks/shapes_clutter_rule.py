"""Would another clutter or object rule make the detector colour-fair?

    uv run python benchmarks/shapes_clutter_rule.py [CHECKPOINT] [--limit 300] [--seeds 4]

The detector counts every speck (a component below ``min_area``) as clutter, and more than
1 % of the image in clutter fails strict. Through noise, an object's edge pixels fall off
their colour line as specks, more for some colours than others
(``python -m omnirl.reward.shapes.measure --by-colour``). The prototype rule here counts
only specks with no pixel within one pixel of an object. Printed per palette colour, old
and prototype rule (partial / strict): renders in that colour at noise sigma 15 scored
against the prompt naming no colour; and, with a checkpoint, the model's images of the
training prompts that name no colour, grouped by the colour of most of their objects.
The third column, ``merged parts``, is the detector's ``merge_parts`` option: a component
of no palette colour that touches an object of a palette colour becomes part of that object
(a drawn shape whose shade leaves the palette line part of the way, which the detector
otherwise cuts in two: an object and an extra). The edge-speck rule is a prototype the
reward does not have (``docs/shapes_eval.md``).

With a checkpoint it also counts, per dominant colour, the model's images with objects the
prompt did not ask for, and whether each such extra touches another object (bounding
boxes within a pixel: one drawn shape split in two, typically a palette part and a part of
no palette colour) or stands apart.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

import omnirl.reward.shapes.detector as detector
from omnirl.reward.shapes.measure import CONDITIONS, colour_rates
from omnirl.reward.shapes.world import COLOURS, COUNTS, SHAPES, ShapeSpec

Scorer = Callable[[np.ndarray, ShapeSpec], list[detector.ShapeScore]]


def score_batch_edge_specks(images: np.ndarray, spec: ShapeSpec) -> list[detector.ShapeScore]:
    """``detector.score_batch`` with specks touching an object left out of the clutter."""
    images = detector._as_images(images)
    g, h, w, _ = images.shape
    min_area = max(4, round(detector.MIN_AREA_FRACTION * h * w))
    min_shape = max(min_area, round(detector.MIN_SHAPE_FRACTION * h * w))
    background = detector.estimate_background(images)
    classes, bg_distance, alpha = detector.classify_pixels(images, background)
    labels = detector.label_components(classes)
    out = []
    for i in range(g):
        objects, object_labels, _ = detector._objects(
            labels[i], classes[i], alpha[i], min_area, min_shape
        )
        on_objects = np.isin(labels[i], object_labels)
        open_background = detector._open_background(on_objects)
        specks = (labels[i] >= 0) & ~on_objects
        touching = np.unique(labels[i][specks & ~open_background])
        clutter = float((specks & ~np.isin(labels[i], touching)).sum()) / (h * w)
        far = bg_distance[i][open_background]
        roughness = float(np.sqrt(np.mean(far**2))) if far.size else detector.ROUGHNESS_MAX
        out.append(detector._score_one(objects, clutter, roughness, background[i], spec))
    return out


RULES: dict[str, Scorer] = {
    "old": detector.score_batch,
    "edge specks": score_batch_edge_specks,
    "merged parts": functools.partial(detector.score_batch, merge_parts=True),
}


def renders(seeds: int, condition: str = "noise15") -> dict[str, dict[str, tuple]]:
    """Per rule and colour: (partial, strict, n) of noisy renders, prompts naming no colour."""
    n = len(SHAPES) * (1 + len(COUNTS)) * seeds
    return {
        rule: {
            c: (*rates, n)
            for c, rates in colour_rates(32, CONDITIONS[condition], seeds, scorer).items()
        }
        for rule, scorer in RULES.items()
    }


def model_images(checkpoint: str, limit: int, seeds: int) -> tuple[dict, dict]:
    """Per rule and dominant colour: (partial, strict) of the model's images; and per
    dominant colour the extras' counts (:func:`extras`)."""
    from omnirl.tools.eval_shapes import evaluate, load_prompt_file
    from omnirl.tools.policy_loading import load_adapter

    specs = load_prompt_file(Path("examples/prompts/shapes_train.jsonl"))
    specs = [s for s in specs if all(o.colour is None for o in s.objects)][:limit]
    run = evaluate(load_adapter(checkpoint), specs, seeds=seeds)
    dominant, seen = run.colours.argmax(-1), run.colours.sum(-1) > 0
    rows: dict[str, dict[str, list]] = {r: {c: [] for c in COLOURS} for r in RULES}
    split = {c: {"images": 0, "with extras": 0, "touching": 0, "apart": 0} for c in COLOURS}
    for i, spec in enumerate(specs):
        for rule, scorer in RULES.items():
            for k, s in enumerate(scorer(run.images[i], spec)):
                if not seen[i, k]:
                    continue
                colour = COLOURS[dominant[i, k]]
                rows[rule][colour].append((s.partial, s.strict))
                if rule == "old":
                    touching, apart = extras(s)
                    counts = split[colour]
                    counts["images"] += 1
                    counts["with extras"] += int(touching + apart > 0)
                    counts["touching"] += touching
                    counts["apart"] += apart
    return {r: {c: _means(v) for c, v in by.items()} for r, by in rows.items()}, split


def extras(result: detector.ShapeScore) -> tuple[int, int]:
    """(extras touching another detected object, extras apart from every other one)."""
    objects = result.details["objects"]
    touching = apart = 0
    for e in result.details["extras"]:
        ex0, ey0, ex1, ey1 = objects[e]["bbox"]
        near = any(
            ex0 <= o["bbox"][2] + 1
            and o["bbox"][0] <= ex1 + 1
            and ey0 <= o["bbox"][3] + 1
            and o["bbox"][1] <= ey1 + 1
            for j, o in enumerate(objects)
            if j != e
        )
        touching, apart = touching + near, apart + (not near)
    return touching, apart


def _means(pairs: list[tuple[float, bool]]) -> tuple[float, float, int]:
    if not pairs:
        return float("nan"), float("nan"), 0
    partial, strict = zip(*pairs, strict=True)
    return float(np.mean(partial)), float(np.mean(strict)), len(pairs)


def _print(title: str, table: dict[str, dict[str, tuple]]) -> None:
    print(title)
    print(f"{'colour':<8} " + " ".join(f"{r:>22}" for r in RULES))
    for c in COLOURS:
        cells = " ".join(
            f"{table[r][c][0]:>10.3f} / {table[r][c][1]:.3f} ({table[r][c][2]})" for r in RULES
        )
        print(f"{c:<8} {cells}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", nargs="?", default=None)
    parser.add_argument("--limit", type=int, default=300, help="prompts naming no colour")
    parser.add_argument("--seeds", type=int, default=4, help="images per prompt")
    parser.add_argument("--render-seeds", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    _print("renders, noise sigma 15: partial / strict (n)", renders(args.render_seeds))
    if args.checkpoint:
        table, split = model_images(args.checkpoint, args.limit, args.seeds)
        _print(f"{args.checkpoint}: the model's images by dominant colour", table)
        print("extras (objects not asked for): images with any; extras touching / apart")
        for c, n in split.items():
            share = n["with extras"] / max(1, n["images"])
            print(f"{c:<8} {share:>6.2f} of {n['images']:>4}   {n['touching']:>4} / {n['apart']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
