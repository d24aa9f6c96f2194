"""The tools on real processes: tap (record + forward), inspect (summary + grid), replay into
a running trainer."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq
from recording_setup import EXAMPLE, GROUPS, trainer_overrides

from omnirl.protocol.recording import RecordingReader

BIN = Path(sys.executable).parent
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_inspect_counts_rewards_and_writes_a_grid(recorded_groups, tmp_path, capsys):
    from PIL import Image

    from omnirl.tools.cli import main

    directory, groups = recorded_groups
    grid = tmp_path / "grid.png"
    rc = main(["inspect", str(directory), "--json", "--grid", str(grid), "--groups", "rec:2,rec:0"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["records"] == GROUPS and summary["kinds"] == {"diffusion_group": GROUPS}
    assert summary["policy_versions"] == {"0": GROUPS} and summary["staleness"] == {"0": GROUPS}
    totals = [r for g in groups for r in g.rewards.total]
    assert summary["reward_total"]["n"] == len(totals)
    assert summary["reward_total"]["min"] == min(totals)
    assert summary["reward_components"]["jpeg"]["max"] == max(totals)
    assert summary["time"]["span_s"] == pytest.approx(0.05 * (GROUPS - 1))
    assert summary["damage"]["corrupt"] == 0
    with Image.open(grid) as image:  # 2 groups x 2 samples of 32x32
        assert image.size == (64, 64)
    assert main(["inspect", str(directory), "--grid", str(grid), "--groups", "nope"]) == 2


@pytest.mark.slow
def test_tap_records_and_forwards_a_stream(tmp_path):
    port, out = _free_port(), tmp_path / "rec"
    ctx = zmq.Context()
    sink = ctx.socket(zmq.PULL)
    sink_port = sink.bind_to_random_port("tcp://127.0.0.1")
    tap = subprocess.Popen(
        [str(BIN / "omnirl"), "tap", "--bind", f"tcp://127.0.0.1:{port}", "--out", str(out),
         "--forward", f"tcp://127.0.0.1:{sink_port}", "--count", "5"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV,
    )  # fmt: skip
    try:
        while b"tap listening" not in (line := tap.stdout.readline()):
            assert line, "tap exited before listening"
        push = ctx.socket(zmq.PUSH)
        push.connect(f"tcp://127.0.0.1:{port}")
        sent = [[b"head %d" % i, os.urandom(1000 * i)] for i in range(5)]
        for frames in sent:
            push.send_multipart(frames)
        got = [sink.recv_multipart() for _ in sent if sink.poll(20_000)]
        assert got == sent
        assert tap.wait(timeout=20) == 0
    finally:
        tap.kill()
        ctx.destroy(linger=0)
    assert [[bytes(f) for f in r.frames] for r in RecordingReader(out).records()] == sent


@pytest.mark.slow
def test_replay_tool_feeds_a_running_trainer(tiny_sd3_path, recorded_groups, tmp_path):
    directory, _ = recorded_groups
    out = tmp_path / "run"
    log = (tmp_path / "trainer.log").open("wb")
    trainer = subprocess.Popen(
        [str(BIN / "trainer"), "--config", str(EXAMPLE), *trainer_overrides(tiny_sd3_path, out),
         "--admit-unleased", "--record", str(tmp_path / "again")],
        stdout=log, stderr=subprocess.STDOUT, env=ENV,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (out / "trainer.addr").exists():
            assert trainer.poll() is None and time.monotonic() < deadline, "trainer did not start"
            time.sleep(0.1)
        address = (out / "trainer.addr").read_text().strip()
        replay = subprocess.run(
            [str(BIN / "replay"), str(directory), "--trainer", address, "--speed", "recorded"],
            env=ENV, capture_output=True, timeout=60,
        )  # fmt: skip
        assert replay.returncode == 0, replay.stderr.decode()
        assert b"sent 4 messages" in replay.stderr
        assert trainer.wait(timeout=120) == 0, (tmp_path / "trainer.log").read_text()
    finally:
        trainer.kill()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    # the trainer's own --record saw the same messages, byte for byte
    again = [[bytes(f) for f in r.frames] for r in RecordingReader(tmp_path / "again").records()]
    assert again == [[bytes(f) for f in r.frames] for r in RecordingReader(directory).records()]


@pytest.mark.parametrize(
    ("speed", "expected_sleeps"),
    [("max", []), ("recorded", [2.0, 3.0]), ("2", [1.0, 1.5])],
)
def test_replay_pacing_keeps_recorded_gaps_scaled(speed, expected_sleeps):
    """Records at t = 10, 12, 15 s (offsets 2 and 5); the fake clock moves only when the
    replay sleeps, so each sleep is the rest of the way to the next scaled offset."""
    from types import SimpleNamespace

    from omnirl.tools.replay import _speed, paced

    now = [100.0]
    sleeps = []

    def sleep(s):
        sleeps.append(round(s, 6))
        now[0] += s

    records = [SimpleNamespace(time=t) for t in (10.0, 12.0, 15.0)]
    out = list(paced(records, _speed(speed), clock=lambda: now[0], sleep=sleep))
    assert out == records
    assert sleeps == [pytest.approx(x) for x in expected_sleeps]
