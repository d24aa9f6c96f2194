"""Write ShapesEval prompt files: ``OUT_DIR/train.jsonl`` and ``OUT_DIR/heldout.jsonl``.

Each line is one prompt, ``{"prompt": ..., "metadata": ...}`` (the fields of
``omnirl.protocol.messages.PromptSpec`` other than ``group_id``; the metadata is what the
ShapesEval detector reads). Prompts are balanced over the six categories and deterministic
in ``--seed``.

    uv run python -m omnirl.tools.shapes_prompts OUT_DIR --n-train 6000 --n-heldout 600
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

from omnirl.reward.shapes.world import CATEGORIES, ShapeSpec, generate_prompts


def write_prompts(path: Path, specs: list[ShapeSpec]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for spec in specs:
            f.write(json.dumps({"prompt": spec.text, "metadata": spec.to_metadata()}) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m omnirl.tools.shapes_prompts", description=__doc__.split("\n")[0]
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--n-train", type=int, default=6000)
    parser.add_argument("--n-heldout", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--categories",
        default=",".join(CATEGORIES),
        help=f"comma-separated subset of {','.join(CATEGORIES)}",
    )
    args = parser.parse_args(argv)
    categories = tuple(c for c in args.categories.split(",") if c)
    unknown = [c for c in categories if c not in CATEGORIES]
    if unknown or not categories:
        parser.error(f"unknown categories {unknown}; known: {','.join(CATEGORIES)}")
    if args.n_train < 0 or args.n_heldout < 0:
        parser.error("--n-train and --n-heldout must be >= 0")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", args.n_train), ("heldout", args.n_heldout)):
        specs = generate_prompts(n, split, seed=args.seed, categories=categories)
        path = args.out_dir / f"{split}.jsonl"
        write_prompts(path, specs)
        per_category = collections.Counter(s.category for s in specs)
        print(f"{path}: {len(specs)} prompts {dict(sorted(per_category.items()))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
