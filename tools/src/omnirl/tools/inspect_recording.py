"""``uv run omnirl inspect DIR [--json] [--grid OUT.png --groups ID,...]``: what a recording holds.

Counts by message kind, policy versions, rewards (total and per component: mean, std, min,
max), staleness, timing, damage found by the reader, and optionally a PNG grid of chosen
groups' images (one row per group, one column per sample).

Staleness here is what the stream itself shows: for each group, the newest policy version
seen in the recording so far minus the group's own version (the trainer's version at
receipt is not recorded).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from collections import Counter
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", metavar="DIR", help="the recording (a folder of segments)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--grid", default=None, metavar="OUT.png", help="write an image grid")
    parser.add_argument("--groups", default="", help="comma-separated group ids for --grid")


def _describe(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    return {"n": len(values), "mean": mean, "std": std, "min": min(values), "max": max(values)}


def summarize(directory: str, *, keep_images: set[str] = frozenset()) -> tuple[dict, dict]:
    """(summary, images of the groups in ``keep_images`` by group id: uint8 [G, H, W, 3])."""
    import numpy as np

    from omnirl.protocol.codec import decode, decode_header
    from omnirl.protocol.recording import RecordingReader

    reader = RecordingReader(directory)
    kinds: Counter[str] = Counter()
    versions: Counter[int] = Counter()
    staleness: Counter[int] = Counter()
    totals: list[float] = []
    components: dict[str, list[float]] = {}
    timings: dict[str, list[float]] = {}
    times: list[float] = []
    undecodable: Counter[str] = Counter()
    images: dict[str, Any] = {}
    nbytes, newest = 0, -1
    for record in reader.records():
        times.append(record.time)
        nbytes += sum(f.nbytes for f in record.frames)
        try:
            kinds[decode_header(record.frames[0]).kind] += 1
            msg = decode(record.frames, check_finite=False)
        except Exception as err:  # a recording may hold anything the stream carried
            undecodable[type(err).__name__] += 1
            continue
        version = getattr(msg, "policy_version", None)
        if version is None or not hasattr(msg, "group_id"):
            continue
        versions[version] += 1
        newest = max(newest, version)
        staleness[newest - version] += 1
        if msg.rewards is not None:
            totals.extend(msg.rewards.total)
            for name, vals in msg.rewards.components.items():
                components.setdefault(name, []).extend(vals)
        for name, seconds in msg.timings.items():
            timings.setdefault(name, []).append(seconds)
        if msg.group_id in keep_images and getattr(msg, "images", None) is not None:
            img = msg.images
            images[msg.group_id] = np.array(img.numpy() if hasattr(img, "numpy") else img)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    span = times[-1] - times[0] if len(times) > 1 else 0.0
    stats = reader.stats
    summary = {
        "directory": str(directory),
        "segments": [
            {"name": s.path.name, "protocol": "{}.{}".format(*s.protocol), "created": s.created}
            for s in reader.segment_info
        ],
        "records": stats.records,
        "bytes": nbytes,
        "kinds": dict(kinds),
        "undecodable": dict(undecodable),
        "policy_versions": {str(k): v for k, v in sorted(versions.items())},
        "staleness": {str(k): v for k, v in sorted(staleness.items())},
        "reward_total": _describe(totals),
        "reward_components": {k: _describe(v) for k, v in sorted(components.items())},
        "timings": {k: _describe(v) for k, v in sorted(timings.items())},
        "time": {
            "first": times[0] if times else None,
            "last": times[-1] if times else None,
            "span_s": span,
            "rate_per_s": (len(times) - 1) / span if span > 0 else None,
            "gap_s": _describe(gaps),
        },
        "damage": {
            "corrupt": stats.corrupt,
            "truncated": stats.truncated,
            "bad_segments": stats.bad_segments,
            "problems": [list(p) for p in stats.problems],
        },
    }
    return summary, images


def write_grid(images: dict[str, Any], order: list[str], path: str) -> tuple[int, int]:
    """One row per group (in ``order``), one column per sample; returns (width, height)."""
    import numpy as np
    from PIL import Image

    rows = [images[g] for g in order]
    frames = [r.reshape(-1, *r.shape[-3:]) for r in rows]  # video: frames side by side
    h, w = frames[0].shape[1:3]
    cols = max(f.shape[0] for f in frames)
    canvas = np.zeros((len(frames) * h, cols * w, 3), dtype=np.uint8)
    for i, row in enumerate(frames):
        for j, image in enumerate(row):
            canvas[i * h : (i + 1) * h, j * w : (j + 1) * w] = image[:h, :w, :3]
    Image.fromarray(canvas).save(path)
    return canvas.shape[1], canvas.shape[0]


def _print(summary: dict) -> None:
    def fmt(d: dict) -> str:
        if not d.get("n"):
            return "none"
        return "n={n} mean={mean:.4g} std={std:.4g} min={min:.4g} max={max:.4g}".format(**d)

    s = summary
    print(f"recording {s['directory']}: {s['records']} records, {s['bytes'] / 1e6:.2f} MB, "
          f"{len(s['segments'])} segments (protocol "
          f"{', '.join(sorted({x['protocol'] for x in s['segments']}))})")  # fmt: skip
    print("kinds:", ", ".join(f"{k}={v}" for k, v in s["kinds"].items()) or "none")
    if s["undecodable"]:
        print("undecodable:", s["undecodable"])
    print("policy versions:", s["policy_versions"])
    print("staleness (newest seen - own):", s["staleness"])
    print("reward total:", fmt(s["reward_total"]))
    for name, d in s["reward_components"].items():
        print(f"  {name}: {fmt(d)}")
    for name, d in s["timings"].items():
        print(f"timing {name}: {fmt(d)}")
    t = s["time"]
    print(f"time: span {t['span_s']:.3f} s, gaps {fmt(t['gap_s'])}")
    dmg = s["damage"]
    print(f"damage: {dmg['corrupt']} corrupt, {dmg['truncated']} truncated, "
          f"{dmg['bad_segments']} unreadable segments")  # fmt: skip
    for seg, offset, reason in dmg["problems"]:
        print(f"  {seg} @ {offset}: {reason}")


def run(args: argparse.Namespace) -> int:
    from omnirl.protocol.recording import RecordingError

    wanted = [g for g in args.groups.split(",") if g]
    if args.grid and not wanted:
        print("inspect: --grid needs --groups ID,...", file=sys.stderr)
        return 2
    try:
        summary, images = summarize(args.directory, keep_images=set(wanted))
    except RecordingError as err:
        print(f"inspect: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary, indent=1, sort_keys=True))
    else:
        _print(summary)
    if args.grid:
        missing = [g for g in wanted if g not in images]
        if missing:
            print(f"inspect: no images for groups {missing}", file=sys.stderr)
            return 2
        size = write_grid(images, wanted, args.grid)
        if not args.json:
            print(f"grid {args.grid}: {size[0]}x{size[1]}")
    return 0
