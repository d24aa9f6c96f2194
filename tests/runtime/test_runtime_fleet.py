"""A whole run on loopback: the launcher, a trainer, 2 rollout + 1 reward worker, tiny SD3, LoRA.

(a) the rollout workers apply version after version, each with new weight bytes;
(b) one rollout worker is killed with SIGKILL in the middle of a lease: the run goes on, and
    the trainer's final ledger shows every group trained at most once and none lost;
(c) a third rollout worker joins mid-run and holds the current version before it samples.
The run is ended with SIGINT to the launcher (Ctrl-C), which also exercises its clean stop.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest
from procs import (
    BIN,
    ENV,
    EXAMPLE,
    applied_versions,
    final_ledger,
    grep,
    overrides,
    read,
    rollout_cmd,
    start,
    stop_all,
    wait_for,
)

pytestmark = pytest.mark.slow


@pytest.mark.timeout(420)
def test_fleet_lora_kill_and_late_join(tiny_sd3_path, tmp_path):
    out = tmp_path / "run"
    logs = out / "logs"
    argv = [
        str(BIN / "omnirl"), "launch", str(EXAMPLE), *overrides(tiny_sd3_path, out, max_steps=1000),
        "--rollout", "2", "--reward", "1", "--rollout-args=--threads 1 --trainer-timeout 60",
    ]  # fmt: skip
    launch_log = tmp_path / "launch.log"
    with open(launch_log, "wb") as f:
        launcher = subprocess.Popen(
            argv, stdout=f, stderr=subprocess.STDOUT, env=ENV, start_new_session=True
        )
    late = None
    try:
        r0, r1 = logs / "rollout-0.log", logs / "rollout-1.log"
        # both workers must be sampling: on a quiet machine one worker can reach version 2
        # before the other has finished loading its model
        wait_for(
            lambda: len(applied_versions(r1)) >= 2 and applied_versions(r0),
            300,
            "rollout-1 at version 1 and rollout-0 ready",
            [launcher],
        )

        # (b) stop rollout-1 just after a lease arrives, check it has not finished, SIGKILL it.
        pid = int(re.search(r"started rollout-1 \(pid (\d+)\)", read(launch_log))[1])
        seen = len(grep(r1, r"lease (\S+): groups"))
        killed_lease = None
        while killed_lease is None:
            wait_for(
                lambda n=seen: len(grep(r1, r"lease (\S+): groups")) > n, 120, "a lease", [launcher]
            )
            os.kill(pid, signal.SIGSTOP)
            leases = grep(r1, r"lease (\S+): groups ([^(]+)\(")
            last = leases[-1]
            if f"lease {last[1]} done" not in read(r1):
                killed_lease, killed_groups = last[1], last[2].split()
            else:
                os.kill(pid, signal.SIGCONT)
                seen = len(leases)
        os.kill(pid, signal.SIGKILL)
        version_at_kill = max(v for v, _, _ in applied_versions(r0))

        # (c) a third worker joins now.
        address = (out / "trainer.addr").read_text().strip()
        late_log = logs / "rollout-late.log"
        late = start(rollout_cmd(address, "rollout-late"), late_log)
        wait_for(
            lambda: "lease" in read(late_log) and " done " in read(late_log),
            240,
            "the late worker's first lease",
            [launcher, late],
        )
        wait_for(
            lambda: len(grep(logs / "trainer.log", r"worker rollout-1 lost")) >= 1,
            60,
            "the trainer noticing the kill",
            [launcher],
        )
        steps_now = len(read(out / "metrics.jsonl").splitlines())
        wait_for(
            lambda: len(read(out / "metrics.jsonl").splitlines()) >= steps_now + 1,
            120,
            "one more step",
            [launcher],
        )
        launcher.send_signal(signal.SIGINT)  # Ctrl-C
        assert launcher.wait(180) == 0, read(launch_log)[-3000:]
        assert late.wait(60) == 0  # the trainer's shutdown reached it too
    finally:
        stop_all([p for p in (launcher, late) if p is not None], signal.SIGKILL)
    text = read(launch_log)
    assert "[trainer]" in text and "[rollout-0]" in text and "[reward-0]" in text

    # (a) versions applied in order, each a new set of weight bytes; groups carry them.
    versions = applied_versions(r0)
    assert [v for v, _, _ in versions] == sorted({v for v, _, _ in versions})
    assert len({d for _, _, d in versions}) == len(versions) >= 3
    assert all(fmt == "lora" for _, fmt, _ in versions)
    metrics = [json.loads(line) for line in read(out / "metrics.jsonl").splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, len(metrics) + 1))
    assert metrics[-1]["policy_version"] == len(metrics)

    # (c) the late joiner's first applied version is the current one, before any lease.
    late_text = read(late_log)
    first_applied = re.search(r"applied weights version=(\d+)", late_text)
    assert first_applied and int(first_applied[1]) >= max(1, version_at_kill)
    assert first_applied.start() < late_text.index(": groups ")

    # (b) exactly once: trained ids are unique, the killed lease's groups were not lost.
    state = final_ledger(out)
    ledger = state["ledger"]
    trained = ledger["trained"]
    open_ids = {r["group_id"] for r in ledger["open"]}
    assert len(trained) == len(set(trained)) == 2 * len(metrics)
    assert not open_ids & set(trained)
    for gid in killed_groups:
        assert gid in trained or gid in open_ids, (gid, killed_lease)
    counters = ledger["counters"]
    assert counters["leases_lost_worker"] + counters.get("leases_expired", 0) >= 1
    assert counters["groups_trained"] == len(trained)
    print(
        f"steps={len(metrics)} killed={killed_lease} {killed_groups} counters={counters}",
        file=sys.stderr,
    )
