"""What ShapesEval checkpoints draw for one category: the detector's shape multisets.

    uv run python benchmarks/shapes_detected_modes.py CHECKPOINT [CHECKPOINT ...] \
        [--category two_object] [--seeds 2] [--limit 100] [--top 6] [--out FILE.json]

For every checkpoint (a model folder or a trainer checkpoint, as ``eval_shapes`` takes), the
category's prompts of the held-out file and of the training file (the first ``--limit`` of
each) are sampled as ``eval_shapes`` samples them (ODE, 10 steps, CFG 3, ``--seeds`` images a
prompt) and scored by the detector; printed per checkpoint and file: the compositions the
prompts ask for, strict accuracy, and the most frequent multisets of detected shapes (an
image of two circles for "a circle and a triangle" is ``circle+circle``). It tells a
failure mode (a shape replaced by another, an extra object) from a near miss.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import torch

from omnirl.reward.shapes.detector import score_batch
from omnirl.tools.eval_shapes import eval_sampling, load_prompt_file, sample_specs
from omnirl.tools.policy_loading import load_adapter

PROMPT_FILES = {
    "heldout": Path("examples/prompts/shapes_heldout.jsonl"),
    "train": Path("examples/prompts/shapes_train.jsonl"),
}


def detected_modes(adapter, specs, *, seeds: int, top: int) -> dict:
    """Strict accuracy and the ``top`` most frequent detected shape multisets of ``specs``."""
    sampling = eval_sampling(seeds)  # as evaluate samples by default: what shapes_curve scores
    modes: collections.Counter[str] = collections.Counter()
    passed = images = 0
    for group, spec in sample_specs(adapter, specs, sampling, tag="eval"):
        for result in score_batch(group.images.numpy(), spec):
            shapes = sorted(o["shape"] for o in result.details["objects"])
            modes["+".join(shapes) or "nothing"] += 1
            passed += result.strict
            images += 1
    asked = sorted({"+".join(sorted(o.shape for o in s.objects)) for s in specs})
    return {
        "asked": asked,
        "images": images,
        "strict": passed / images,
        "modes": [[mode, count] for mode, count in modes.most_common(top)],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--category", default="two_object")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--limit", type=int, default=100, help="prompts of each file")
    parser.add_argument("--top", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    files = {}
    for name, path in PROMPT_FILES.items():
        specs = [s for s in load_prompt_file(path) if s.category == args.category]
        if not specs:
            raise SystemExit(f"{path}: no {args.category!r} prompts")
        files[name] = specs[: args.limit]
    rows = []
    for checkpoint in args.checkpoints:
        adapter = load_adapter(checkpoint)
        for name, specs in files.items():
            row = {"checkpoint": checkpoint, "prompts": name, "category": args.category}
            row.update(detected_modes(adapter, specs, seeds=args.seeds, top=args.top))
            rows.append(row)
            modes = ", ".join(f"{mode} {count}" for mode, count in row["modes"])
            print(
                f"{checkpoint} | {name} ({' / '.join(row['asked'])}) | strict "
                f"{row['strict']:.3f} | {modes}",
                flush=True,
            )
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
