"""Full-weight training, a trainer killed with SIGKILL and resumed; the workers stay up.

(d) the policy is trained in full-weight mode (``model.lora=null``): every version the
    rollout worker applies is a ``full`` update;
(e) the trainer is killed after its first checkpoint and restarted with ``--resume`` on the
    same control port: it continues from the checkpoint's step and version, the live
    workers register again and pick up its weights, and the run finishes with every
    group trained once.
Also: ``omnirl status`` against the live trainer lists the fleet.
"""

from __future__ import annotations

import json
import os
import re
import signal

import pytest
from procs import (
    applied_versions,
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

from omnirl.tools.status import fetch_status, format_status

pytestmark = pytest.mark.slow
MAX_STEPS = 4


@pytest.mark.timeout(480)
def test_full_weights_trainer_kill_and_resume(tiny_sd3_path, tmp_path):
    out, logs = tmp_path / "run", tmp_path / "logs"
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    args = overrides(
        tiny_sd3_path, out, model__lora="null", runtime__control_port=port,
        max_steps=MAX_STEPS, checkpoint__every=1,
    )  # fmt: skip
    trainer = start(trainer_cmd(*args), logs / "trainer-1.log")
    procs = [trainer]
    try:
        wait_for(lambda: (out / "trainer.addr").exists(), 180, "the trainer's address", procs)
        reward = start(
            reward_cmd(address, "reward-0", "--trainer-timeout", "240"), logs / "reward.log"
        )
        rollout = start(
            rollout_cmd(address, "rollout-0", "--trainer-timeout", "240"), logs / "rollout.log"
        )
        procs += [reward, rollout]
        first_ck = out / "checkpoints" / "step_00000001" / "state.pt"
        wait_for(first_ck.exists, 300, "the first checkpoint", procs)

        status = fetch_status(address, timeout_s=10)
        assert {w.worker_id for w in status.workers} == {"reward-0", "rollout-0"}
        assert status.step >= 1 and "rollout-0" in format_status(status)

        os.killpg(trainer.pid, signal.SIGKILL)
        trainer.wait(10)
        # the workers notice, stay up and wait for a trainer on the same address
        wait_for(lambda: grep(logs / "rollout.log", "lost the trainer"), 30, "rollout noticing")
        resumed = start(trainer_cmd(*args, "--resume"), logs / "trainer-2.log")
        procs.append(resumed)
        assert resumed.wait(300) == 0, read(logs / "trainer-2.log")[-3000:]
        assert rollout.wait(60) == 0 and reward.wait(60) == 0
    finally:
        stop_all(procs, signal.SIGKILL)

    resumed_from = re.search(
        r"resumed from \S+: step (\d+), version (\d+)", read(logs / "trainer-2.log")
    )
    assert resumed_from, read(logs / "trainer-2.log")[-2000:]
    step0 = int(resumed_from[1])
    assert 1 <= step0 < MAX_STEPS and int(resumed_from[2]) == step0

    # (d) every applied version is a full update; the rollout re-registered with the new trainer.
    rollout_log = logs / "rollout.log"
    versions = applied_versions(rollout_log)
    assert versions and all(fmt == "full" for _, fmt, _ in versions)
    assert max(v for v, _, _ in versions) >= MAX_STEPS - 1
    assert "registering again" in read(rollout_log)

    # (e) the resumed run went on from the checkpoint to the end, each group trained once.
    metrics = [json.loads(line) for line in read(out / "metrics.jsonl").splitlines()]
    assert metrics[-1]["step"] == MAX_STEPS and metrics[-1]["policy_version"] == MAX_STEPS
    after = [m["step"] for m in metrics if m["step"] > step0]
    assert after[-(MAX_STEPS - step0) :] == list(range(step0 + 1, MAX_STEPS + 1))
    ledger = final_ledger(out)["ledger"]
    assert len(ledger["trained"]) == len(set(ledger["trained"])) == 2 * MAX_STEPS
