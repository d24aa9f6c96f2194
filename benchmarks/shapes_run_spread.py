"""Where the run-to-run spread of ShapesEval's held-out gain comes from.

Reads the ``curve.json`` of several runs (as ``omnirl.tools.shapes_curve`` writes it; a run
folder means its ``curve/curve.json``) and prints, per category and overall, each run's gain
of its last scored checkpoint over the base, then the mean and the standard deviation across
runs, and each category's share of the variance of the overall gain.

The overall gain is the mean of the six categories' gains (equal prompt counts), so its
variance is ``sum_ij cov(g_i, g_j) / 36``. A category's share is its row of that sum: its
own variance plus its covariances with the others, over the overall variance. The shares add
to 1; a category that moves with the others gets credit for the co-movement.

    uv run python benchmarks/shapes_run_spread.py outputs/run32 outputs/run33 ... [--names a,b]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def last_gain(curve_path: Path) -> dict[str, float]:
    """``{category: gain, ..., "overall": gain}`` of the last scored checkpoint."""
    rows = json.loads(curve_path.read_text())
    scored = [r for r in rows if "gain_vs_base" in r]
    if not scored:
        raise ValueError(f"{curve_path}: no checkpoint scored against the base")
    gain = scored[-1]["gain_vs_base"]
    out = {cat: float(entry["gain"]) for cat, entry in gain["categories"].items()}
    out["overall"] = float(gain["overall"]["gain"])
    return out


def spread(gains: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per category: ``mean``, ``sd`` (across runs, ddof 1) and ``share`` of the overall
    gain's variance (``nan`` for ``overall`` itself; every share ``nan`` if it is 0)."""
    if len(gains) < 2:
        raise ValueError("the spread needs at least two runs")
    cats = [c for c in gains[0] if c != "overall"]
    if any(sorted(g) != sorted(gains[0]) for g in gains):
        raise ValueError("the runs were scored on different categories")
    table = np.array([[g[c] for c in cats] for g in gains])  # [runs, categories]
    overall = np.array([g["overall"] for g in gains])
    cov = np.cov(table.T, ddof=1) / len(cats) ** 2
    total = float(cov.sum())
    out = {}
    for i, c in enumerate(cats):
        share = float(cov[i].sum()) / total if total > 0 else float("nan")
        out[c] = {
            "mean": float(table[:, i].mean()),
            "sd": float(table[:, i].std(ddof=1)),
            "share": share,
        }
    out["overall"] = {
        "mean": float(overall.mean()),
        "sd": float(overall.std(ddof=1)),
        "share": float("nan"),
    }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders or curve.json files")
    parser.add_argument("--names", help="comma-separated row names (default: the folder names)")
    args = parser.parse_args(argv)
    paths = [p / "curve" / "curve.json" if p.is_dir() else p for p in args.runs]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        parser.error(f"no curve.json: {', '.join(missing)}")
    names = (
        args.names.split(",")
        if args.names
        else [
            p.parent.parent.name if p.name == "curve.json" and p.parent.name == "curve" else p.stem
            for p in paths
        ]
    )
    if len(names) != len(paths):
        parser.error(f"{len(names)} names for {len(paths)} runs")
    try:
        gains = [last_gain(p) for p in paths]
        stats = spread(gains)
    except ValueError as err:
        parser.error(str(err))
    cols = list(stats)
    print("| run | " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for name, g in zip(names, gains, strict=True):
        print(f"| {name} | " + " | ".join(f"{g[c]:+.3f}" for c in cols) + " |")
    for key, fmt in (("mean", "{:+.3f}"), ("sd", "{:.3f}"), ("share", "{:.2f}")):
        cells = ["" if np.isnan(stats[c][key]) else fmt.format(stats[c][key]) for c in cols]
        print(f"| {key} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
