"""Write a preference file for offline Diffusion-DPO from ShapesEval prompts.

    uv run python -m omnirl.tools.shapes_preferences OUT_DIR [--prompts FILE] [--n 512]
        [--mode render|sample] [--size 32] [--seed 0]
        sample mode: --model DIR [--lora DIR] [--group 8] [--cfg 3] [--steps 10] [--threads N]

Modes (the prompt's spec is read from its metadata):

- ``render``: chosen = the renderer's image of the prompt (it passes the detector's strict
  check); rejected = a render of a *wrong* spec, one change away (an object's shape, colour
  or count, or the relation reversed), kept only if the detector scores it strictly lower
  than the chosen one on the prompt's own spec. No model needed.
- ``sample``: ``--group`` images of the prompt sampled by the model (ODE, one seed per
  sample) and scored by the detector (``partial``); chosen = the best, rejected = the worst,
  ties broken as online Diffusion-DPO breaks them (lowest index); a prompt whose samples
  all tie is skipped.

Writes ``OUT_DIR/preferences.jsonl`` (a header with how it was made, then one
``{"prompt", "chosen", "rejected", "metadata", "scores"}`` row per pair, image paths relative
to the file) and ``OUT_DIR/images/NNNNNN_{chosen,rejected}.png``; the format is
``omnirl.trainer.preferences``'s (docs/algorithms.md, "Diffusion-DPO (offline)").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from omnirl.reward.shapes import ShapeSpec, ShapeSpecError, render, score_batch
from omnirl.reward.shapes.world import COLOURS, COUNTS, RELATIONS, SHAPES

OPPOSITE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
ATTEMPTS = 8


def wrong_specs(spec: ShapeSpec) -> list[ShapeSpec]:
    """Every valid spec one change away from ``spec``: one object's shape, colour or count
    (counting), or the relation reversed; in a fixed order."""
    out = []
    used = {o.shape for o in spec.objects}
    for i, obj in enumerate(spec.objects):
        changes = [dataclasses.replace(obj, shape=s) for s in SHAPES if s not in used]
        if obj.colour is not None:
            changes += [dataclasses.replace(obj, colour=c) for c in COLOURS if c != obj.colour]
        if spec.category == "counting":
            changes += [dataclasses.replace(obj, count=n) for n in COUNTS if n != obj.count]
        for new in changes:
            objects = (*spec.objects[:i], new, *spec.objects[i + 1 :])
            out.append((objects, spec.relation))
    if spec.relation in RELATIONS:
        out.append((spec.objects, OPPOSITE[spec.relation]))
    specs = []
    for objects, relation in out:
        try:
            specs.append(ShapeSpec(spec.category, tuple(objects), relation))
        except ShapeSpecError:
            continue
    return specs


def rendered_pair(
    spec: ShapeSpec, *, size: int, seed: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, tuple[float, float]] | None:
    """(chosen, rejected, (their partial scores)) for ``spec`` by rendering, or None when no
    try gave a strict chosen image and a strictly worse rejected one."""
    candidates = wrong_specs(spec)
    for attempt in range(ATTEMPTS):
        chosen = render(spec, size, seed * ATTEMPTS + attempt)
        wrong = candidates[int(rng.integers(len(candidates)))]
        rejected = render(wrong, size, seed * ATTEMPTS + attempt + 10**6)
        good, bad = score_batch(np.stack([chosen, rejected]), spec)
        if good.strict and bad.partial < good.partial:
            return chosen, rejected, (good.partial, bad.partial)
    return None


def sampled_pairs(adapter, specs: list[ShapeSpec], args: argparse.Namespace) -> list[Any]:
    """Per spec, (chosen, rejected, scores) from ``args.group`` model samples, or None on a tie."""
    from omnirl.protocol.messages import SamplingParams
    from omnirl.tools.eval_shapes import sample_specs
    from omnirl.trainer.algorithms.diffusion_dpo import preference_pair

    sampling = SamplingParams(
        group_size=args.group,
        seed=args.seed,
        num_steps=args.steps,
        guidance_scale=args.cfg,
        height=args.size,
        width=args.size,
        sde_type="ode",
        noise_level=0.0,
        record_latents=False,
    )
    out = []
    groups = sample_specs(adapter, specs, sampling, batch_prompts=args.batch_prompts, tag="pref")
    for i, (group, spec) in enumerate(groups):
        images = group.images.numpy()
        partial = [s.partial for s in score_batch(images, spec)]
        pair = preference_pair(partial)
        if pair is None:
            out.append(None)
        else:
            w, lose = pair
            out.append((images[w], images[lose], (partial[w], partial[lose])))
        if (i + 1) % args.batch_prompts == 0 or i + 1 == len(specs):
            print(f"sampled {i + 1}/{len(specs)} prompts", flush=True)
    return out


def write_preferences(
    out_dir: Path, specs: list[ShapeSpec], pairs: list[Any], header: dict[str, Any]
) -> Path:
    """``OUT_DIR/preferences.jsonl`` and its images; ``pairs[i]`` is None for a skipped spec."""
    from PIL import Image

    images_dir = out_dir / "images"
    images_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, (spec, pair) in enumerate(zip(specs, pairs, strict=True)):
        if pair is None:
            continue
        chosen, rejected, (s_w, s_l) = pair
        names = {}
        for key, image in (("chosen", chosen), ("rejected", rejected)):
            name = f"images/{i:06d}_{key}.png"
            Image.fromarray(np.ascontiguousarray(image)).save(out_dir / name)
            names[key] = name
        rows.append(
            {
                "prompt": spec.text,
                **names,
                "metadata": spec.to_metadata(),
                "scores": {"chosen": round(float(s_w), 4), "rejected": round(float(s_l), 4)},
            }
        )
    scores = np.array([[r["scores"]["chosen"], r["scores"]["rejected"]] for r in rows] or [[0, 0]])
    header = {
        **header,
        "pairs": len(rows),
        "skipped": len(specs) - len(rows),
        "chosen_partial_mean": round(float(scores[:, 0].mean()), 4),
        "rejected_partial_mean": round(float(scores[:, 1].mean()), 4),
    }
    path = out_dir / "preferences.jsonl"
    with path.open("w", encoding="utf-8") as fh:
        fh.write(json.dumps({"format": "omnirl.preferences", "version": 1, "metadata": header}))
        fh.write("\n")
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    return path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m omnirl.tools.shapes_preferences", description=__doc__.split("\n")[0]
    )
    p.add_argument("out_dir", type=Path)
    p.add_argument("--prompts", type=Path, default=Path("examples/prompts/shapes_train.jsonl"))
    p.add_argument("--n", type=int, default=512, help="prompts (the file's first N, cycled)")
    p.add_argument("--mode", choices=("render", "sample"), default="render")
    p.add_argument("--size", type=int, default=32, help="image size (the run's sampling size)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", type=Path, default=None, help="sample mode: the model folder")
    p.add_argument("--lora", type=Path, default=None, help="sample mode: a trainer LoRA folder")
    p.add_argument("--group", type=int, default=8, help="sample mode: samples per prompt")
    p.add_argument("--cfg", type=float, default=3.0, help="sample mode: guidance scale")
    p.add_argument("--steps", type=int, default=10, help="sample mode: ODE steps")
    p.add_argument("--batch-prompts", type=int, default=16, help="sample mode: prompts a batch")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from omnirl.tools.eval_shapes import load_prompt_file
    from omnirl.tools.policy_loading import load_adapter

    if args.n < 1:
        print("shapes_preferences: --n must be >= 1", file=sys.stderr)
        return 2
    if args.mode == "sample" and (args.model is None or args.group < 2):
        print("shapes_preferences: --mode sample needs --model and --group >= 2", file=sys.stderr)
        return 2
    pool = load_prompt_file(args.prompts)
    specs = [pool[i % len(pool)] for i in range(args.n)]
    header: dict[str, Any] = {
        "source": "shapes_eval",
        "mode": args.mode,
        "prompts": str(args.prompts),
        "size": args.size,
        "seed": args.seed,
        "score": "partial",
    }
    if args.mode == "render":
        rng = np.random.default_rng(args.seed)
        pairs = [
            rendered_pair(s, size=args.size, seed=args.seed * len(specs) + i, rng=rng)
            for i, s in enumerate(specs)
        ]
    else:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        header.update(model=str(args.model), lora=str(args.lora) if args.lora else None,
                      group=args.group, cfg=args.cfg, steps=args.steps)  # fmt: skip
        adapter = load_adapter(args.model, lora=args.lora)
        pairs = sampled_pairs(adapter, specs, args)
    path = write_preferences(args.out_dir, specs, pairs, header)
    meta = json.loads(path.read_text().splitlines()[0])["metadata"]
    print(
        f"wrote {path}: {meta['pairs']} pairs ({meta['skipped']} prompts skipped); mean partial "
        f"chosen {meta['chosen_partial_mean']:.3f}, rejected {meta['rejected_partial_mean']:.3f}"
    )
    return 0 if meta["pairs"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
