"""The launcher with stand-in processes: prefixes, log files, exit code, clean stops."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from omnirl.tools.launch import Launcher

TRAINER = textwrap.dedent(
    """
    import pathlib, signal, sys, time
    out, mode = pathlib.Path(sys.argv[1]), sys.argv[2]
    def on_sigint(*_):
        print("trainer stopping", flush=True)
        if mode == "stubborn":  # never stops by itself
            return
        if mode == "slow":  # a clean stop that takes a while (a checkpoint being written)
            time.sleep(0.5)
        sys.exit(0)
    signal.signal(signal.SIGINT, on_sigint)
    print("trainer up", flush=True)
    (out / "trainer.addr").write_text("tcp://127.0.0.1:5999\\n")
    if mode == "exit3":
        time.sleep(1.0)
        print("trainer failing", flush=True)
        sys.exit(3)
    for _ in range(600):
        time.sleep(0.1)
    """
)
WORKER = textwrap.dedent(
    """
    import signal, sys, time
    signal.signal(signal.SIGTERM, lambda *_: (print("worker got SIGTERM", flush=True), sys.exit(0)))
    print("worker args", " ".join(sys.argv[1:]), flush=True)
    time.sleep(60)
    """
)


class Sink:
    def __init__(self):
        self.lines: list[str] = []

    def write(self, text):
        self.lines.extend(text.splitlines())

    def flush(self):
        pass


def _launcher(tmp_path: Path, mode: str, sink: Sink) -> Launcher:
    py = sys.executable
    return Launcher(
        output_dir=tmp_path,
        trainer_argv=[py, "-c", TRAINER, str(tmp_path), mode],
        reward_argv=[py, "-c", WORKER],
        rollout_argv=[py, "-c", WORKER],
        num_reward=1,
        num_rollout=2,
        address_timeout_s=20,
        grace_s=5,
        out=sink,
    )


def test_trainer_failure_stops_workers_and_gives_its_exit_code(tmp_path):
    sink = Sink()
    launcher = _launcher(tmp_path, "exit3", sink)
    assert launcher.run() == 3
    assert launcher.address == "tcp://127.0.0.1:5999"
    assert all(c.popen.returncode is not None for c in launcher.children)
    text = "\n".join(sink.lines)
    assert "[trainer] trainer up" in text and "[trainer] trainer failing" in text
    assert "[rollout-1] worker args --trainer tcp://127.0.0.1:5999 --worker-id rollout-1" in text
    assert "[reward-0] worker got SIGTERM" in text
    names = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert names == ["reward-0.log", "rollout-0.log", "rollout-1.log", "trainer.log"]
    assert "trainer failing" in (tmp_path / "logs" / "trainer.log").read_text()


def test_each_rollout_worker_is_started_on_its_own_device(tmp_path):
    sink = Sink()
    launcher = _launcher(tmp_path, "exit3", sink)
    launcher.rollout_devices = ["cuda:1", "cuda:2"]
    assert launcher.run() == 3
    text = "\n".join(sink.lines)
    for i in range(2):
        assert (
            f"[rollout-{i}] worker args --device cuda:{i + 1} --trainer tcp://127.0.0.1:5999 "
            f"--worker-id rollout-{i}"
        ) in text


def _driver(tmp_path: Path, mode: str = "wait") -> subprocess.Popen:
    """A launcher in its own process, returned once its rollout worker is up."""
    driver = textwrap.dedent(
        f"""
        import sys
        sys.path[:0] = {sys.path!r}
        from pathlib import Path
        from omnirl.tools.launch import Launcher
        py = sys.executable
        launcher = Launcher(
            output_dir=Path({str(tmp_path)!r}),
            trainer_argv=[py, "-c", {TRAINER!r}, {str(tmp_path)!r}, {mode!r}],
            reward_argv=[py, "-c", {WORKER!r}], rollout_argv=[py, "-c", {WORKER!r}],
            num_reward=1, num_rollout=1, address_timeout_s=20, grace_s=5,
        )
        sys.exit(launcher.run())
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        log = tmp_path / "logs" / "rollout-0.log"
        if log.exists() and "worker args" in log.read_text():
            break
        time.sleep(0.1)
    return proc


def test_sigint_stops_trainer_first_then_workers(tmp_path):
    proc = _driver(tmp_path)
    os.kill(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "[trainer] trainer stopping" in out
    assert "[rollout-0] worker got SIGTERM" in out
    assert out.index("trainer stopping") < out.index("worker got SIGTERM")


def test_one_ctrl_c_delivered_twice_still_stops_cleanly(tmp_path):
    """Under ``uv run`` the terminal's SIGINT and uv's forwarded copy arrive together."""
    proc = _driver(tmp_path, "slow")
    os.kill(proc.pid, signal.SIGINT)
    time.sleep(0.05)
    os.kill(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out  # not killed: the trainer stopped by itself
    assert "[trainer] trainer stopping" in out and "[rollout-0] worker got SIGTERM" in out


def test_a_second_ctrl_c_later_kills_everything(tmp_path):
    proc = _driver(tmp_path, "stubborn")  # would hold the launcher for its 5 s grace period
    os.kill(proc.pid, signal.SIGINT)
    time.sleep(1.5)
    start = time.monotonic()
    os.kill(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert time.monotonic() - start < 3.0, out
    assert "[trainer] trainer stopping" in out
    assert proc.returncode == 128 + signal.SIGKILL, out  # the trainer was killed


def test_cores_are_shared_between_trainer_and_rollout_workers():
    from omnirl.tools.launch import share_cores

    assert share_cores(1, cores=2) == 1
    assert share_cores(1, cores=16) == 8
    assert share_cores(3, cores=16) == 4
    assert share_cores(8, cores=4) == 1  # never fewer than one thread


def test_rollout_workers_get_the_gpus_the_trainer_leaves_free():
    from omnirl.tools.launch import LaunchError, rollout_devices

    assert rollout_devices("cuda", 2, 1, 1) == ["cuda:0", "cuda:0"]  # one GPU: shared
    assert rollout_devices("cuda:0", 3, 1, 4) == ["cuda:1", "cuda:2", "cuda:3"]
    assert rollout_devices("cuda:2", 4, 1, 4) == ["cuda:0", "cuda:1", "cuda:3", "cuda:0"]
    assert rollout_devices("cuda", 3, 2, 4) == ["cuda:2", "cuda:3", "cuda:2"]  # ranks on 0, 1
    assert rollout_devices("cuda", 1, 2, 2) == ["cuda:0"]  # every GPU a rank: rank 0's
    with pytest.raises(LaunchError, match="no CUDA device"):
        rollout_devices("cuda", 1, 1, 0)
    with pytest.raises(LaunchError, match="only 2 CUDA"):
        rollout_devices("cuda:3", 1, 1, 2)
    with pytest.raises(LaunchError, match="not 'cuda' or 'cuda:N'"):
        rollout_devices("cuda:x", 1, 1, 2)


def test_workers_on_the_trainers_gpu_decode_in_small_batches_unless_told_otherwise():
    from omnirl.tools.launch import rollout_devices, shared_gpu_arguments

    def args(argv, devices, device, procs, hw=(512, 512)):
        return shared_gpu_arguments(argv, devices, device, procs, hw)

    four = ["--decode-batch", "4"]  # four 512x512 images a VAE call
    one_gpu = rollout_devices("cuda", 1, 1, 1)
    assert args(["--compile"], one_gpu, "cuda", 1) == ["--compile", *four]
    assert args([], ["cuda:1"], "cuda:1", 1) == four
    assert args([], ["cuda:0"], "cuda", 2) == four  # rank 0's GPU
    assert args([], one_gpu, "cuda", 1, (1024, 1024)) == ["--decode-batch", "1"]
    assert args([], one_gpu, "cuda", 1, (2048, 2048)) == ["--decode-batch", "1"]  # at least one
    assert args([], one_gpu, "cuda", 1, (256, 256)) == ["--decode-batch", "16"]
    given = ["--decode-batch=0"]  # the user's choice stands
    assert args(given, one_gpu, "cuda", 1) == given
    own = rollout_devices("cuda:0", 2, 1, 3)  # GPUs of their own: nothing added
    assert args([], own, "cuda:0", 1) == []
    assert args([], ["cuda:2"], "cuda", 2) == []


def test_rollout_workers_get_the_runs_dtype_and_compile_unless_told_otherwise():
    from omnirl.tools.launch import rollout_arguments
    from omnirl.trainer.config import load_config

    base = ["model.path=x", "data.prompts=p"]
    cfg = load_config(None, [*base, "run.dtype=bfloat16", "train.compile=true"])
    assert rollout_arguments("", cfg, 1) == ["--threads", "1", "--dtype", "bfloat16", "--compile"]
    given = "--threads=2 --dtype float32 --compile-mode max-autotune-no-cudagraphs"
    assert rollout_arguments(given, cfg, 1) == given.split()
    plain = load_config(None, base)
    assert rollout_arguments("--capacity 2", plain, 3) == [
        *("--capacity", "2", "--threads", "3", "--dtype", "float32")
    ]
