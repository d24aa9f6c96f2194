"""``omnirl launch CONFIG [--rollout N] [--reward M] [key=value ...]``: a run on this machine.

Starts the trainer, waits for the control address it writes to ``<output_dir>/trainer.addr``,
then M reward and N rollout workers pointed at it. Every child's output is prefixed
(``[trainer]``, ``[rollout-0]``, ...), interleaved on stdout, and kept whole in
``<output_dir>/logs/<name>.log``.

The machine's cores are shared out: the trainer (on the CPU) and each rollout worker get
``cores // (rollouts + 1)`` torch threads (at least 1) unless the config or the rollout
arguments say otherwise. The rollout workers run at the trainer's ``run.dtype`` (the same
numerics on both sides of the log-prob ratio) and compile when ``train.compile`` is on,
unless ``--rollout-args`` names ``--dtype`` or ``--compile`` itself. On a GPU run
(``run.device: cuda...``) each rollout worker gets a ``--device``: the visible GPUs the
trainer's ranks leave free, round robin, or the trainer's own GPU when none is free
(:func:`rollout_devices`); workers on the trainer's GPU decode a few images per VAE call,
fewer the larger they are (:func:`shared_gpu_arguments`), unless the rollout arguments name
``--decode-batch``.

Each child runs in its own process group. Ctrl-C (or SIGTERM) stops the trainer first
(SIGINT: it finishes cleanly and tells the workers to shut down), then the workers; a
second Ctrl-C kills everything at once. Signals within ``SAME_SIGNAL_S`` of the first count
as that one: under ``uv run`` a Ctrl-C reaches the launcher twice (from the terminal and
forwarded by uv). When the trainer exits on its own, the workers are
stopped too. The exit code is the trainer's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from omnirl.protocol.trainer_link import ADDRESS_FILE, read_address_file

SAME_SIGNAL_S = 1.0  # a repeat within this long is the same Ctrl-C (uv forwards SIGINT)


class LaunchError(RuntimeError):
    """The run could not be started (bad config, trainer died before it was reachable)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", type=Path, help="the trainer's YAML config")
    parser.add_argument("overrides", nargs="*", help="trainer config overrides, key=value")
    parser.add_argument("--rollout", type=int, default=1, help="rollout workers (default 1)")
    parser.add_argument("--reward", type=int, default=1, help="reward workers (default 1)")
    parser.add_argument("--resume", action="store_true", help="resume the trainer")
    # argparse reads "--rollout-args --compile" as two options: the value needs the "=" form
    for role in ("rollout", "reward", "trainer"):
        parser.add_argument(
            f"--{role}-args",
            default="",
            help=f"extra {role} arguments as one string; one that starts with a dash "
            f'needs the "=" form: --{role}-args="--flag value"',
        )
    parser.add_argument(
        "--address-timeout",
        type=float,
        default=300.0,
        help="seconds to wait for the trainer's address file",
    )
    parser.add_argument(
        "--trainer-procs",
        type=int,
        default=1,
        help="trainer ranks under torchrun (data parallel, one per GPU; default 1: no torchrun)",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=60.0,
        help="seconds a stopped process gets before it is killed",
    )


def run(args: argparse.Namespace) -> int:
    from omnirl.trainer.config import ConfigError, load_config

    if args.rollout < 0 or args.reward < 0:
        print("omnirl launch: --rollout and --reward must be >= 0", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config, list(args.overrides))
    except ConfigError as exc:
        print(f"omnirl launch: {exc}", file=sys.stderr)
        return 2
    output_dir = Path(cfg.run.output_dir)
    if args.trainer_procs < 1:
        print("omnirl launch: --trainer-procs must be >= 1", file=sys.stderr)
        return 2
    trainer = [*_command("trainer", "omnirl.trainer.cli"), "--config", str(args.config)]
    if args.trainer_procs > 1:  # rank 0 serves the run, the others follow (trainer.replicas)
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        torchrun += ["--nproc-per-node", str(args.trainer_procs), "-m", "omnirl.trainer.cli"]
        trainer = [*torchrun, "--config", str(args.config)]
    trainer += [*shlex.split(args.trainer_args), *(["--resume"] if args.resume else [])]
    threads = share_cores(args.rollout + args.trainer_procs - 1)
    if cfg.run.threads == 0 and cfg.run.device == "cpu":
        trainer.append(f"run.threads={threads}")
    trainer += list(args.overrides)
    rollout_args = rollout_arguments(args.rollout_args, cfg, threads)
    devices = None
    if cfg.run.device.startswith("cuda") and not _names(rollout_args, "--device"):
        import torch

        try:
            devices = rollout_devices(
                cfg.run.device, args.rollout, args.trainer_procs, torch.cuda.device_count()
            )
        except LaunchError as exc:
            print(f"omnirl launch: {exc}", file=sys.stderr)
            return 2
        rollout_args = shared_gpu_arguments(
            rollout_args,
            devices,
            cfg.run.device,
            args.trainer_procs,
            (cfg.sampling.height, cfg.sampling.width),
        )
    launcher = Launcher(
        output_dir=output_dir,
        trainer_argv=trainer,
        reward_argv=[*_command("reward", "omnirl.reward.cli"), *shlex.split(args.reward_args)],
        rollout_argv=[*_command("rollout", "omnirl.rollout.cli"), *rollout_args],
        num_reward=args.reward,
        num_rollout=args.rollout,
        rollout_devices=devices,
        address_timeout_s=args.address_timeout,
        grace_s=args.grace,
    )
    return launcher.run()


def rollout_arguments(given: str, cfg, threads: int) -> list[str]:
    """The rollout workers' arguments: ``given`` (``--rollout-args``) plus ``--threads``,
    ``--dtype run.dtype`` and, with ``train.compile``, ``--compile``, where it names none."""
    argv = shlex.split(given)
    if not _names(argv, "--threads"):
        argv += ["--threads", str(threads)]
    if not _names(argv, "--dtype"):
        argv += ["--dtype", str(cfg.run.dtype)]
    if cfg.train.compile and not _names(argv, "--compile", "--compile-mode"):
        argv.append("--compile")
    return argv


def rollout_devices(device: str, num_rollout: int, trainer_procs: int, gpus: int) -> list[str]:
    """Each rollout worker's ``--device`` on a GPU run whose trainer is on ``device``.

    The trainer holds ``device`` (one rank) or ``cuda:0`` to ``cuda:{trainer_procs - 1}``
    (under torchrun, a rank per GPU). The workers are dealt round robin over the ``gpus``
    visible GPUs the trainer leaves free; with none free they share the trainer's (rank 0's)
    GPU, as on a one-GPU machine.
    """
    if gpus < 1:
        raise LaunchError(f"run.device is {device!r} but no CUDA device is visible")
    own, taken = _trainer_gpus(device, trainer_procs)
    if own >= gpus:
        raise LaunchError(f"run.device is {device!r} but only {gpus} CUDA device(s) are visible")
    free = [g for g in range(gpus) if g not in taken] or [own]
    return [f"cuda:{free[i % len(free)]}" for i in range(num_rollout)]


# Pixels per VAE call for workers that share the trainer's GPU: the decoder at full
# resolution sets a lease's memory peak, and four 512x512 images a call took 13.4 GB off a
# 16-image lease's for 1.6 % of its time (docs/gpu_sessions.md, fifteenth session). The
# decoder's activations grow with the pixels, so larger images get fewer a call.
SHARED_GPU_DECODE_PIXELS = 4 * 512 * 512


def shared_gpu_arguments(
    argv: list[str], devices: list[str], device: str, trainer_procs: int, image_hw: tuple[int, int]
) -> list[str]:
    """``argv`` plus a ``--decode-batch`` of ``SHARED_GPU_DECODE_PIXELS`` worth of images of
    ``image_hw`` (at least one) when the workers (on ``devices``, from
    :func:`rollout_devices`) share a GPU with the trainer and ``argv`` names no decode batch:
    there the worker's peak is memory the trainer's step lacks."""
    trainer = {f"cuda:{i}" for i in _trainer_gpus(device, trainer_procs)[1]}
    if _names(argv, "--decode-batch") or not trainer & set(devices):
        return argv
    images = max(1, SHARED_GPU_DECODE_PIXELS // max(1, image_hw[0] * image_hw[1]))
    return [*argv, "--decode-batch", str(images)]


def _trainer_gpus(device: str, trainer_procs: int) -> tuple[int, set[int]]:
    """``(rank 0's GPU, every GPU the trainer's ranks hold)``: ``device`` for one rank,
    ``cuda:0`` to ``cuda:{trainer_procs - 1}`` under torchrun."""
    if trainer_procs > 1:
        return 0, set(range(trainer_procs))
    index = device.split(":", 1)[1] if ":" in device else "0"
    if not index.isdigit():
        raise LaunchError(f"run.device {device!r} is not 'cuda' or 'cuda:N'")
    return int(index), {int(index)}


def _names(argv: list[str], *options: str) -> bool:
    """Whether ``argv`` gives any of ``options`` (``--opt value`` or ``--opt=value``)."""
    return any(a in options or a.split("=", 1)[0] in options for a in argv)


def share_cores(num_rollout: int, cores: int | None = None) -> int:
    """Torch CPU threads for each of the trainer and the ``num_rollout`` rollout workers of
    one machine: its cores shared out, at least 1. Left to torch, every process would start
    a thread per core, and their OpenMP threads would spin against each other (on 2 cores, a
    tiny model ran several times slower). ``run.threads`` or ``--rollout-args=--threads N``
    win over it; a trainer on a GPU is left alone."""
    cores = cores or len(os.sched_getaffinity(0))
    return max(1, cores // (num_rollout + 1))


def _command(script: str, module: str) -> list[str]:
    """The console script beside this interpreter, else ``python -c`` of its ``main``."""
    found = shutil.which(script, path=str(Path(sys.executable).parent))
    if found:
        return [found]
    return [sys.executable, "-c", f"import sys; from {module} import main; sys.exit(main())"]


@dataclass
class Child:
    name: str
    argv: list[str]
    popen: subprocess.Popen
    log: TextIO
    reader: threading.Thread | None = None


@dataclass(kw_only=True)
class Launcher:
    output_dir: Path
    trainer_argv: list[str]
    reward_argv: list[str]
    rollout_argv: list[str]
    num_reward: int = 1
    num_rollout: int = 1
    rollout_devices: list[str] | None = None  # one --device per rollout worker
    address_timeout_s: float = 300.0
    grace_s: float = 60.0
    out: TextIO = field(default_factory=lambda: sys.stdout)
    children: list[Child] = field(default_factory=list)
    address: str = ""
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _signals: int = 0
    _first_signal_at: float = 0.0

    # --------------------------------------------------------------------------- children

    def start(self, name: str, argv: list[str]) -> Child:
        logs = self.output_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log = open(logs / f"{name}.log", "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        popen = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            bufsize=1,
            env=env,
            start_new_session=True,
            errors="replace",
        )
        child = Child(name, argv, popen, log)
        child.reader = threading.Thread(target=self._pump, args=(child,), daemon=True)
        child.reader.start()
        self.say(f"started {name} (pid {popen.pid}): {shlex.join(argv)}")
        self.children.append(child)
        return child

    def _pump(self, child: Child) -> None:
        prefix = f"[{child.name}] "
        for line in child.popen.stdout:
            child.log.write(line)
            with self._lock:
                self.out.write(prefix + line)
                self.out.flush()
        child.log.flush()

    def say(self, text: str) -> None:
        with self._lock:
            self.out.write(f"[launch] {text}\n")
            self.out.flush()

    @staticmethod
    def signal_child(child: Child, sig: int) -> None:
        if child.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.popen.pid, sig)

    def _wait(self, children: list[Child], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(c.popen.poll() is not None for c in children):
                return True
            time.sleep(0.05)
        return all(c.popen.poll() is not None for c in children)

    def stop(self, children: list[Child], sig: int = signal.SIGTERM) -> None:
        """``sig`` to each child's group; SIGKILL to what is left after ``grace_s``."""
        for child in children:
            self.signal_child(child, sig)
        if not self._wait(children, self.grace_s):
            for child in children:
                if child.popen.poll() is None:
                    self.say(f"{child.name} did not stop in {self.grace_s:.0f} s: killing it")
                    self.signal_child(child, signal.SIGKILL)
            self._wait(children, 5.0)

    # -------------------------------------------------------------------------------- run

    def _on_signal(self, signum: int, _frame) -> None:
        now = time.monotonic()
        if self._signals and now - self._first_signal_at < SAME_SIGNAL_S:
            return  # the same Ctrl-C, delivered twice (terminal + uv's forwarding)
        self._signals += 1
        if self._signals == 1:
            self._first_signal_at = now
            return
        for child in self.children:
            self.signal_child(child, signal.SIGKILL)

    def wait_for_address(self, trainer: Child, since: float) -> str:
        path = self.output_dir / ADDRESS_FILE
        deadline = time.monotonic() + self.address_timeout_s
        while time.monotonic() < deadline:
            if trainer.popen.poll() is not None:
                raise LaunchError(
                    f"the trainer exited with code {trainer.popen.returncode} "
                    "before writing its address"
                )
            if self._signals:
                raise LaunchError("interrupted while waiting for the trainer's address")
            try:
                if path.stat().st_mtime >= since and (address := read_address_file(path)):
                    return address
            except (FileNotFoundError, ValueError):  # not written yet, or half written
                pass
            time.sleep(0.1)
        raise LaunchError(f"no address in {path} after {self.address_timeout_s:.0f} s")

    def run(self) -> int:
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._run()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            for child in self.children:
                if child.reader is not None:
                    child.reader.join(timeout=2.0)
                child.log.close()

    def _run(self) -> int:
        since = time.time() - 1.0  # mtime resolution; an older file is a previous run's
        trainer = self.start("trainer", self.trainer_argv)
        try:
            self.address = self.wait_for_address(trainer, since)
        except LaunchError as exc:
            self.say(str(exc))
            self.stop([trainer], signal.SIGINT)
            code = trainer.popen.returncode
            return code if code not in (None, 0) else 1
        self.say(f"trainer at {self.address}")
        workers = [
            self.start(
                f"reward-{i}",
                [*self.reward_argv, "--trainer", self.address, "--worker-id", f"reward-{i}"],
            )
            for i in range(self.num_reward)
        ]
        workers += [
            self.start(
                f"rollout-{i}",
                [
                    *self.rollout_argv,
                    *(["--device", self.rollout_devices[i]] if self.rollout_devices else []),
                    *("--trainer", self.address, "--worker-id", f"rollout-{i}"),
                ],
            )
            for i in range(self.num_rollout)
        ]
        reported: set[str] = set()
        while trainer.popen.poll() is None and not self._signals:
            for child in workers:
                if child.popen.poll() is not None and child.name not in reported:
                    reported.add(child.name)
                    self.say(f"{child.name} exited with code {child.popen.returncode}")
            time.sleep(0.2)
        if self._signals:
            self.say("interrupted: stopping the trainer, then the workers")
            self.stop([trainer], signal.SIGINT)
        code = trainer.popen.returncode
        self.say(f"trainer exited with code {code}; stopping the workers")
        if not self._wait(workers, 5.0):  # they leave by themselves on the trainer's shutdown
            self.stop(workers, signal.SIGTERM)
        for child in workers:
            if child.name not in reported:
                self.say(f"{child.name} exited with code {child.popen.returncode}")
        if code is None:
            return 1
        return code if code >= 0 else 128 - code
