"""Helpers of the multi-process runtime tests: start real processes, read their logs."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

BIN = Path(sys.executable).parent
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_sd3_jpeg.yaml"
PROMPTS = Path(__file__).resolve().parents[2] / "examples" / "prompts" / "animals.jsonl"
ENV = {
    **os.environ,
    "PYTHONUNBUFFERED": "1",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def overrides(model: Path, out: Path, **extra) -> list[str]:
    """Tiny, fast settings for the example config; ``extra`` as ``key=value`` (dots as __)."""
    items = {
        "model.path": str(model),
        "run.output_dir": str(out),
        "data.prompts": str(PROMPTS),
        "data.group_size": 2,
        "sampling.num_steps": 3,
        "train.groups_per_step": 2,
        "runtime.control_port": 0,
        "runtime.heartbeat_interval_s": 0.5,
        "runtime.heartbeat_timeout_s": 5,
        "runtime.lease_timeout_s": 60,
        "runtime.shutdown_grace_s": 2,
        "logging.progress_bar": "false",
        "logging.tensorboard": "false",
        "checkpoint.every": 0,
    }
    items.update({k.replace("__", "."): v for k, v in extra.items()})
    return [f"{k}={v}" for k, v in items.items()]


def start(argv: list[str], log: Path) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as f:
        return subprocess.Popen(
            argv, stdout=f, stderr=subprocess.STDOUT, env=ENV, start_new_session=True
        )


def trainer_cmd(*args: str) -> list[str]:
    return [str(BIN / "trainer"), "--config", str(EXAMPLE), *args]


def _trainer(address: str | Path) -> list[str]:
    """``--trainer ADDRESS``, or ``--trainer-file PATH`` for a path."""
    if isinstance(address, Path):
        return ["--trainer-file", str(address)]
    return ["--trainer", address]


def rollout_cmd(address: str | Path, worker_id: str, *args: str) -> list[str]:
    return [
        str(BIN / "rollout"),
        *_trainer(address),
        "--worker-id",
        worker_id,
        "--threads",
        "1",
        *args,
    ]


def reward_cmd(address: str | Path, worker_id: str, *args: str) -> list[str]:
    return [str(BIN / "reward"), *_trainer(address), "--worker-id", worker_id, *args]


def wait_for(
    predicate, timeout_s: float, what: str, procs: list[subprocess.Popen] = (), every=0.05
):
    """Poll ``predicate()`` until it returns something truthy; fail if a process in ``procs`` died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(
                    f"process {p.args[0]} exited with {p.returncode} while waiting for {what}"
                )
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def grep(path: Path, pattern: str) -> list[re.Match]:
    return list(re.finditer(pattern, read(path)))


def applied_versions(log: Path) -> list[tuple[int, str, str]]:
    """(version, format, digest) of each weight version a rollout worker applied, in order."""
    return [
        (int(m[1]), m[2], m[3])
        for m in grep(log, r"applied weights version=(\d+) format=(\w+) digest=(\w+)")
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_all(procs: list[subprocess.Popen], sig=signal.SIGTERM, timeout_s: float = 30.0) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, sig)
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)


def final_ledger(out: Path) -> dict:
    """The ledger in the newest checkpoint of a run."""
    steps = sorted((out / "checkpoints").glob("step_*"))
    assert steps, f"no checkpoint in {out}"
    state = torch.load(steps[-1] / "state.pt", map_location="cpu", weights_only=True)
    return state
