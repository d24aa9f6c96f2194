"""A trainer that comes back somewhere else, as a requeued Slurm job on another node does.

The workers are started first, with ``--trainer-file <output_dir>/trainer.addr`` (no
address): they wait for the file. The trainer is killed with SIGKILL after its first
checkpoint and resumed on another control port, which it writes to the same file; the
workers read the file again while the trainer is unreachable, follow it, register again,
and the run finishes with every group trained once.
"""

from __future__ import annotations

import json
import os
import re
import signal

import pytest
from procs import (
    final_ledger,
    free_port,
    grep,
    overrides,
    read,
    reward_cmd,
    rollout_cmd,
    start,
    stop_all,
    trainer_cmd,
    wait_for,
)

pytestmark = pytest.mark.slow
MAX_STEPS = 3


@pytest.mark.timeout(420)
def test_workers_follow_a_trainer_resumed_at_another_address(tiny_sd3_path, tmp_path):
    out, logs = tmp_path / "run", tmp_path / "logs"
    first_port, second_port = free_port(), free_port()
    while second_port == first_port:
        second_port = free_port()
    address_file = out / "trainer.addr"
    workers = [
        start(
            reward_cmd(address_file, "reward-0", "--trainer-timeout", "240"), logs / "reward.log"
        ),
        start(
            rollout_cmd(address_file, "rollout-0", "--trainer-timeout", "240"), logs / "rollout.log"
        ),
    ]
    procs = list(workers)
    try:
        args = overrides(tiny_sd3_path, out, max_steps=MAX_STEPS, checkpoint__every=1)
        trainer = start(
            trainer_cmd(*args, f"runtime.control_port={first_port}"), logs / "trainer-1.log"
        )
        procs.append(trainer)
        first_ck = out / "checkpoints" / "step_00000001" / "state.pt"
        wait_for(first_ck.exists, 300, "the first checkpoint", procs)
        os.killpg(trainer.pid, signal.SIGKILL)
        trainer.wait(10)
        wait_for(lambda: grep(logs / "rollout.log", "lost the trainer"), 30, "rollout noticing")
        resumed = start(
            trainer_cmd(*args, f"runtime.control_port={second_port}", "--resume"),
            logs / "trainer-2.log",
        )
        procs.append(resumed)
        assert resumed.wait(300) == 0, read(logs / "trainer-2.log")[-3000:]
        assert [w.wait(60) for w in workers] == [0, 0]
    finally:
        stop_all(procs, signal.SIGKILL)

    moved = f"following the trainer to tcp://127.0.0.1:{second_port}"
    for name in ("rollout", "reward"):
        log = read(logs / f"{name}.log")
        assert f"tcp://127.0.0.1:{first_port} (from {address_file})" in log, log[-2000:]
        assert moved in log, log[-2000:]
    step0 = int(re.search(r"resumed from \S+: step (\d+)", read(logs / "trainer-2.log"))[1])
    assert 1 <= step0 < MAX_STEPS
    metrics = [json.loads(line) for line in read(out / "metrics.jsonl").splitlines()]
    assert metrics[-1]["step"] == MAX_STEPS
    ledger = final_ledger(out)["ledger"]
    assert len(ledger["trained"]) == len(set(ledger["trained"])) == 2 * MAX_STEPS
