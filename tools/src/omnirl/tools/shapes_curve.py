"""The learning curve of a ShapesEval RL run: its base model and checkpoints scored on a prompt
file, against the run's wall-clock time.

    uv run python -m omnirl.tools.shapes_curve RUN_DIR --prompts FILE [--seeds 2]
        [--every 1] [--limit N] [--threads 2] [--out DIR] [--ema]

``RUN_DIR`` is a trainer's ``run.output_dir``: its ``checkpoints/step_*`` folders (each with
``policy/`` and ``config.yaml``) and ``metrics.jsonl`` (whose ``elapsed_s`` places each
checkpoint in time). The base model (``model.path`` of the run's config) is step 0. Every
model is sampled with the run's own sampling settings (steps, guidance, size) by the ODE
sampler and scored by the ShapesEval detector, exactly as ``omnirl.tools.eval_shapes`` does.
``--steps`` / ``--cfg`` replace the run's: a run that sampled its rollouts with fewer steps
is then scored like the others (the base model's 0.333 is at 10 steps, CFG 3).

``--ema`` scores each checkpoint's ``policy_ema/`` (the trainer's EMA of the weights, written
when ``ema_decay`` is set) instead of ``policy/``.

Writes to ``OUT`` (default ``RUN_DIR/curve``, ``RUN_DIR/curve_ema`` with ``--ema``): ``curve.json`` (per checkpoint: step, minutes,
overall and per-category strict accuracy with 95 % bootstrap intervals), ``curve.png``
(strict accuracy against minutes, overall with its interval and each category), and
``before_after.png`` (the same prompts and seeds from the base model and the last checkpoint).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from omnirl.reward.shapes.detector import MERGE_PARTS_HELP
from omnirl.tools.eval_shapes import (
    EvalRun,
    bootstrap_ci,
    cluster_bootstrap_ci,
    evaluate,
    format_table,
    load_prompt_file,
    summarise,
)
from omnirl.tools.policy_loading import apply_policy, load_adapter


def checkpoint_minutes(run_dir: Path) -> dict[int, float]:
    """Step -> minutes since the trainer started (``elapsed_s`` of ``metrics.jsonl``)."""
    out = {}
    path = run_dir / "metrics.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if "elapsed_s" in row:
                out[int(row["step"])] = row["elapsed_s"] / 60
    return out


def paired_gain(before: EvalRun, after: EvalRun) -> dict[str, Any]:
    """Strict accuracy of ``after`` minus ``before`` on the same prompts and seeds, with a
    95 % bootstrap interval over prompts of the per-prompt differences (paired), overall and
    per category: ``ci95`` resamples the lines (this file's prompts), ``ci95_distinct`` the
    distinct prompts (lines repeating one prompt together: the gain on other prompts of
    these kinds)."""
    diff = after.strict.mean(axis=1) - before.strict.mean(axis=1)  # [P]
    cats = np.array([s.category for s in before.specs])

    def entry(mask: np.ndarray) -> dict[str, Any]:
        lo, hi = bootstrap_ci(diff[mask])
        specs = [before.specs[i] for i in np.flatnonzero(mask)]
        return {
            "gain": float(diff[mask].mean()),
            "ci95": [lo, hi],
            "ci95_distinct": list(cluster_bootstrap_ci(diff[mask], specs)),
            "prompts": int(mask.sum()),
            "distinct": len(set(specs)),
        }

    return {
        "overall": entry(np.ones(len(diff), dtype=bool)),
        "categories": {c: entry(cats == c) for c in dict.fromkeys(cats)},
    }


def before_after_grid(before: EvalRun, after: EvalRun, path: Path, *, rows: int = 16) -> Path:
    """PNG: per row one prompt, its seeds from ``before`` | its seeds from ``after``; a green
    or red bar under each image marks strict pass or fail. Upscaled 3x."""
    from PIL import Image

    p = min(rows, len(before.specs))
    _, s, h, w, _ = before.images.shape
    bar, gap = 2, 6
    width = 2 * s * (w + 1) + gap
    grid = np.full((p * (h + bar + 1), width, 3), 255, dtype=np.uint8)
    for col0, run in ((0, before), (s * (w + 1) + gap, after)):
        for i in range(p):
            for k in range(s):
                y, x = i * (h + bar + 1), col0 + k * (w + 1)
                grid[y : y + h, x : x + w] = run.images[i, k]
                ok = run.strict[i, k]
                grid[y + h : y + h + bar, x : x + w] = (40, 170, 60) if ok else (210, 40, 40)
    img = Image.fromarray(grid)
    img = img.resize((img.width * 3, img.height * 3), Image.NEAREST)
    img.save(path)
    return path


def plot_curve(rows: list[dict[str, Any]], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [r["minutes"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    overall = [r["overall"]["strict"] for r in rows]
    lo = [r["overall"]["ci95"][0] for r in rows]
    hi = [r["overall"]["ci95"][1] for r in rows]
    ax.fill_between(minutes, lo, hi, color="black", alpha=0.12, linewidth=0)
    ax.plot(minutes, overall, "o-", color="black", linewidth=2.2, label="overall (95% CI)")
    for cat in rows[0]["categories"]:
        ax.plot(
            minutes,
            [r["categories"][cat]["strict"] for r in rows],
            ".--",
            linewidth=1,
            label=cat,
        )
    ax.set_xlabel("wall-clock minutes of the run")
    ax.set_ylabel("held-out strict accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncol=2, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m omnirl.tools.shapes_curve", description=__doc__.split("\n")[0]
    )
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--every", type=int, default=1, help="every N-th checkpoint (+ last)")
    parser.add_argument("--limit", type=int, default=None, help="first N prompts only")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=None, help="default: the run's num_steps")
    parser.add_argument("--cfg", type=float, default=None, help="default: the run's guidance")
    parser.add_argument(
        "--ema", action="store_true", help="score each checkpoint's EMA weights (policy_ema/)"
    )
    parser.add_argument(
        "--merge-parts",
        action="store_true",
        help=MERGE_PARTS_HELP,
    )
    args = parser.parse_args(argv)

    import torch
    import yaml

    if args.threads:
        torch.set_num_threads(args.threads)
    ckpts = sorted((args.run_dir / "checkpoints").glob("step_*"))
    if not ckpts:
        parser.error(f"no checkpoints under {args.run_dir / 'checkpoints'}")
    chosen = ckpts[:: max(1, args.every)]
    if chosen[-1] != ckpts[-1]:
        chosen.append(ckpts[-1])
    config = yaml.safe_load((ckpts[-1] / "config.yaml").read_text())
    sampling = dict(config["sampling"])
    if args.steps is not None:
        if args.steps < 1:
            parser.error(f"--steps must be >= 1, got {args.steps}")
        sampling["num_steps"] = args.steps
    if args.cfg is not None:
        sampling["guidance_scale"] = args.cfg
    minutes = checkpoint_minutes(args.run_dir)
    specs = load_prompt_file(args.prompts)[: args.limit]
    out = args.out or args.run_dir / ("curve_ema" if args.ema else "curve")
    out.mkdir(parents=True, exist_ok=True)

    adapter = load_adapter(config["model"]["path"], device=args.device)
    runs: list[tuple[int, EvalRun]] = []
    rows = []
    for ckpt in [None, *chosen]:
        step = 0 if ckpt is None else int(ckpt.name.split("_")[1])
        if ckpt is not None:
            policy = ckpt / ("policy_ema" if args.ema else "policy")
            if not policy.is_dir():
                parser.error(f"{policy} does not exist (EMA weights need ema_decay set)")
            apply_policy(adapter, policy, config)
        run = evaluate(
            adapter,
            specs,
            seeds=args.seeds,
            guidance_scale=sampling["guidance_scale"],
            num_steps=sampling["num_steps"],
            image_size=sampling["height"],
            merge_parts=args.merge_parts,
        )
        summary = summarise(run)
        row = {
            "step": step,
            "minutes": round(minutes.get(step, 0.0), 2),
            "num_steps": sampling["num_steps"],
            "guidance_scale": sampling["guidance_scale"],
            "merge_parts": args.merge_parts,
            **summary,
        }
        rows.append(row)
        runs.append((step, run))
        print(f"step {step} ({row['minutes']:.1f} min, {run.seconds:.0f} s to evaluate)")
        print(format_table(summary), flush=True)
        (out / "curve.json").write_text(json.dumps(rows, indent=1) + "\n")

    base, last = rows[0], rows[-1]
    gain = last["overall"]["strict"] - base["overall"]["strict"]
    for row, (_, run) in zip(rows[1:], runs[1:], strict=True):
        row["gain_vs_base"] = paired_gain(runs[0][1], run)
    (out / "curve.json").write_text(json.dumps(rows, indent=1) + "\n")
    g = last["gain_vs_base"]["overall"]
    print(
        f"gain of the last checkpoint: {g['gain']:+.3f}, 95% CI [{g['ci95'][0]:+.3f}, "
        f"{g['ci95'][1]:+.3f}] (paired bootstrap over prompts); over the {g['distinct']} "
        f"distinct prompts [{g['ci95_distinct'][0]:+.3f}, {g['ci95_distinct'][1]:+.3f}]"
    )
    for cat, e in last["gain_vs_base"]["categories"].items():
        print(
            f"  {cat:<14} {e['gain']:+.3f}  [{e['ci95'][0]:+.3f}, {e['ci95'][1]:+.3f}]  "
            f"distinct ({e['distinct']}) [{e['ci95_distinct'][0]:+.3f}, "
            f"{e['ci95_distinct'][1]:+.3f}]"
        )
    title = (
        f"{config['run']['name']}: held-out strict {base['overall']['strict']:.3f} -> "
        f"{last['overall']['strict']:.3f} ({gain:+.3f}), {len(specs)} prompts x {args.seeds} seeds"
    )
    plot_curve(rows, out / "curve.png", title)
    before_after_grid(runs[0][1], runs[-1][1], out / "before_after.png")
    print(title)
    print(f"wrote {out}/curve.json, curve.png, before_after.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
