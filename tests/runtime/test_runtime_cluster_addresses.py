"""A run set up the way the cluster recipes in ``deploy/`` set it up, on loopback: every
process binds every interface (``0.0.0.0``) and says which host to reach it at (the trainer's
``runtime.advertise_host``, the reward worker's ``--advertise``), and every socket is
encrypted and authenticated with CurveZMQ keys written by ``omnirl keygen`` (no
``--insecure``). Real processes: a trainer, a rollout worker, a reward worker; the run ends
by itself after its last step."""

from __future__ import annotations

import json
import subprocess

import pytest
from procs import (
    BIN,
    ENV,
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


@pytest.mark.timeout(300)
def test_wildcard_binds_advertised_hosts_and_curve_keys(tiny_sd3_path, tmp_path):
    keys = tmp_path / "keys"
    for name in ("trainer", "rollout", "reward"):
        subprocess.run(
            [str(BIN / "omnirl"), "keygen", str(keys), "--name", name], check=True, env=ENV
        )
    out, logs = tmp_path / "run", tmp_path / "logs"
    trainer = start(
        trainer_cmd(
            *overrides(tiny_sd3_path, out, max_steps=2),
            "runtime.host=0.0.0.0",
            "runtime.advertise_host=127.0.0.1",
            f"runtime.keys_dir={keys}",
        ),
        logs / "trainer.log",
    )
    procs = [trainer]
    try:
        address = wait_for(lambda: read(out / "trainer.addr").strip(), 120, "trainer.addr", procs)
        assert address.startswith("tcp://127.0.0.1:")
        server_key = ["--keys", str(keys), "--server-key", str(keys / "trainer.key")]
        reward = start(
            reward_cmd(
                address, "reward-0", "--bind", "tcp://0.0.0.0:0", "--advertise", "127.0.0.1",
                *server_key, "--key-name", "reward",
            ),
            logs / "reward.log",
        )  # fmt: skip
        rollout = start(
            rollout_cmd(address, "rollout-0", *server_key, "--key-name", "rollout"),
            logs / "rollout.log",
        )
        procs += [reward, rollout]
        assert trainer.wait(150) == 0, read(logs / "trainer.log")[-3000:]
        assert rollout.wait(60) == 0 and reward.wait(60) == 0
    finally:
        stop_all(procs)
    # what each process was told to connect to: the advertised host, never 0.0.0.0
    reward_log, rollout_log = read(logs / "reward.log"), read(logs / "rollout.log")
    assert "PULL on tcp://127.0.0.1:" in reward_log, reward_log[-2000:]
    assert ", intake tcp://127.0.0.1:" in reward_log
    assert "sending groups to reward worker tcp://127.0.0.1:" in rollout_log, rollout_log[-2000:]
    metrics = [json.loads(line) for line in read(out / "metrics.jsonl").splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
