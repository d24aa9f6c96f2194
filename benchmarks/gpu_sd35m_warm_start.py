"""The warm-start stage of ``gpu_sd35m.py``: a rollout worker joining a running fleet.

The parent saves its compile artifacts (``torch.compiler`` mega-cache) and starts a fresh
process of ``gpu_sd35m.py --warm-start-child ARTIFACTS`` with an empty inductor cache; the
child loads them, builds the rollout, compiles and samples its first group, and prints its
timings on a ``WARMSTART {json}`` line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "gpu_sd35m.py"
MARK = "WARMSTART "


def measure_warm_start(args, timeout_s: float) -> dict:
    """Run the child and return the report row: artifact size, process start to first
    group, and the child's own ``*_s`` timings."""
    from omnirl.models.compile_cache import save_artifacts

    art = Path(tempfile.mkdtemp()) / "artifacts.bin"
    size = save_artifacts(art)
    cmd = [sys.executable, "-u", str(SCRIPT), "--warm-start-child", str(art)]
    cmd += ["--device", args.device, "--dtype", args.dtype, "--threads", str(args.threads)]
    cmd += ["--compile-backend", args.compile_backend] + (["--tiny"] if args.tiny else [])
    cmd += ["--compile-mode", args.compile_mode] if args.compile_mode else []
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp())  # an empty cache
    start = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=max(30, timeout_s))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
    if proc.returncode or not lines:
        raise RuntimeError(f"warm-start child failed ({proc.returncode}): {proc.stderr[-800:]}")
    child = json.loads(lines[-1][len(MARK) :])
    return {
        "artifacts_bytes": size,
        "process_to_first_group_s": child["end"] - start,
        **{k: v for k, v in child.items() if k.endswith("_s")},
    }


def warm_start_child(args, bench) -> int:
    """The joining worker (``bench``: a fresh ``gpu_sd35m.Bench``): load the artifacts,
    build, compile, first group."""
    from omnirl.models.compile_cache import load_artifacts

    marks = {"start": time.time()}
    loaded = load_artifacts(args.warm_start_child)
    marks["artifacts_s"] = time.time() - marks["start"]
    t = time.time()
    bench.build_omnirl(trainer=False)
    marks["build_s"] = time.time() - t
    t = time.time()
    bench.rollout.compile(bench.compile_config())
    bench.sample()
    marks["end"] = time.time()
    marks["compile_and_first_group_s"] = marks["end"] - t
    _, marks["second_group_s"] = bench.sample()
    marks["loaded"] = loaded
    print(MARK + json.dumps(marks), flush=True)
    return 0
