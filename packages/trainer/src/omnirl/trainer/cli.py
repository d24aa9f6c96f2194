"""``uv run trainer --config FILE [key=value ...] [--resume] [--record DIR] [--replay DIR]
[--preferences FILE [--epochs N]]``.

Argument parsing imports nothing heavy; torch, diffusers and the model stack are imported
inside :func:`main` after the arguments are understood, so ``--help`` is instant.

Exit codes: 0 when ``max_steps`` were trained (or ``--print-config``), 2 for a bad
config or command line, 1 when the model or the sockets cannot be set up.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import NoReturn


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="trainer",
        description="omnirl trainer process: leases prompts to rollout workers, trains on "
        "scored groups from reward workers, publishes weight versions.",
        epilog="Overrides are OmegaConf dotlist items, e.g. train.max_staleness=1 "
        "runtime.control_port=0 (0: pick a free port; the control address is written to "
        "<run.output_dir>/trainer.addr). An unknown key is an error.",
    )
    p.add_argument("--config", required=True, help="YAML config (see examples/)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    p.add_argument(
        "--resume", action="store_true", help="continue from the latest checkpoint of the run"
    )
    p.add_argument(
        "--record",
        metavar="DIR",
        default=None,
        help="record every intake message to DIR (segment files, see docs/recording.md)",
    )
    p.add_argument(
        "--replay",
        metavar="DIR",
        default=None,
        help="train from the recording in DIR instead of workers (see docs/recording.md)",
    )
    p.add_argument(
        "--preferences",
        metavar="FILE",
        default=None,
        help="train diffusion_dpo offline from a preference file of (prompt, chosen, rejected) "
        "images, no workers (see docs/algorithms.md); data.prompts defaults to FILE",
    )
    p.add_argument(
        "--epochs",
        type=int,
        default=1,
        help="with --preferences: passes over the file before the run stops (default 1)",
    )
    p.add_argument(
        "--admit-unleased",
        action="store_true",
        help="train on intake groups this run did not lease (to be fed by `uv run replay`)",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic GPU kernels, no TF32, math attention (slower; docs/recording.md)",
    )
    p.add_argument("--print-config", action="store_true", help="print the merged config and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.preferences is not None and (args.replay is not None or args.admit_unleased):
        parser.error("--preferences cannot be combined with --replay or --admit-unleased")
    from omegaconf import OmegaConf

    from omnirl.trainer.config import ConfigError, load_config

    overrides = list(args.overrides)
    if args.preferences is not None:  # the pairs' prompts: data.prompts is not read, but required
        overrides.insert(0, f"data.prompts={args.preferences}")
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as err:
        print(f"trainer: config error: {err}", file=sys.stderr)
        return 2
    if args.print_config:
        print(OmegaConf.to_yaml(cfg), end="")
        return 0
    logging.basicConfig(
        level=getattr(logging, str(cfg.logging.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    log = logging.getLogger("omnirl.trainer")
    from omnirl.protocol.memory import retain_freed_memory

    retain_freed_memory()  # large messages reuse mapped pages (omnirl.protocol.memory)
    if cfg.run.threads:  # on a CPU shared with rollout workers, fewer threads spin less
        import torch

        torch.set_num_threads(cfg.run.threads)
    from omnirl.models.device import attention_backend, describe_attention_backends

    # the SDPA kernel for every compile and call of the run (torch-global flags, held open
    # for the whole run: a context entered and dropped would be undone at once)
    with attention_backend(cfg.train.attention):
        log.info("trainer: attention %s", describe_attention_backends())
        code = _serve(args, cfg, log)
    if _under_torchrun():
        _exit_rank(code)
    return code


def _serve(args: argparse.Namespace, cfg, log: logging.Logger) -> int:
    """Build the backend and server the arguments ask for, and run it to the end."""
    from omnirl.models.base import SamplingParamsError
    from omnirl.trainer.backend import AdapterBackend
    from omnirl.trainer.config import ConfigError
    from omnirl.trainer.data import DataError
    from omnirl.trainer.server import TrainerServer

    if args.replay is not None and not os.path.isdir(args.replay):
        print(f"trainer: --replay {args.replay}: not a recording directory", file=sys.stderr)
        return 2
    if args.deterministic:
        from omnirl.trainer.determinism import enable_determinism

        enable_determinism()
    dist_info = None
    if _under_torchrun():
        if args.preferences is not None:
            print("trainer: --preferences runs in one process, not under torchrun", file=sys.stderr)
            return 2
        import datetime

        import torch

        from omnirl.trainer.distributed import init_distributed

        # ranks wait on rank 0 between steps as long as the rollouts take: no 10-minute limit
        dist_info = init_distributed(
            torch.device(cfg.run.device).type, timeout=datetime.timedelta(hours=24)
        )
    recorder = None
    try:
        backend = AdapterBackend(cfg, dist_info)
        if dist_info is not None and not dist_info.is_main:
            from omnirl.trainer.replicas import follow

            # a follower stops when rank 0 says so (rank 0 stops cleanly on SIGINT / SIGTERM,
            # torchrun forwards them to every rank): leaving early would break rank 0's step
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_IGN)
            return follow(backend, chunk_bytes=cfg.runtime.weight_chunk_bytes)
        if dist_info is not None:
            from omnirl.trainer.replicas import LeaderBackend

            backend = LeaderBackend(backend, chunk_bytes=cfg.runtime.weight_chunk_bytes)
        if args.record is not None:
            from omnirl.protocol.recording import RecordingWriter

            recorder = RecordingWriter(args.record)
        if args.preferences is not None:
            from omnirl.trainer.offline import PreferenceTrainerServer

            server = PreferenceTrainerServer(
                cfg,
                backend,
                resume=args.resume,
                intake_tap=recorder,
                preferences=args.preferences,
                epochs=args.epochs,
            )
        elif args.replay is not None or args.admit_unleased:
            from omnirl.trainer.replay import ReplayTrainerServer

            server = ReplayTrainerServer(
                cfg, backend, resume=args.resume, intake_tap=recorder, replay=args.replay
            )
        else:
            _check_sampling(cfg, backend)
            server = TrainerServer(cfg, backend, resume=args.resume, intake_tap=recorder)
    except ConfigError as err:
        print(f"trainer: config error: {err}", file=sys.stderr)
        return 2
    except SamplingParamsError as err:
        print(
            f"trainer: the model refuses this run's sampling parameters: {err}; change the "
            "run's sampling settings (sampling.*)",
            file=sys.stderr,
        )
        return 2
    except DataError as err:
        print(f"trainer: data error: {err}", file=sys.stderr)
        return 2
    except FileNotFoundError as err:  # a model folder, a checkpoint, a prompt file
        print(
            f"trainer: {err} (a relative path in the config is read from the working "
            f"directory, {os.getcwd()})",
            file=sys.stderr,
        )
        return 2
    except Exception:
        log.exception("trainer: cannot set up the run")
        return 1

    def stop(signum, _frame):
        log.info("trainer: %s received, stopping", signal.Signals(signum).name)
        server.request_stop()

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        code = server.run()
    finally:
        if recorder is not None:
            recorder.close()
        if dist_info is not None:
            backend.close()  # the follower ranks leave
    return code


def _check_sampling(cfg, backend) -> None:
    """The run's sampling parameters against the model's rules, before any lease: a size the
    model cannot sample would otherwise fail every worker's first lease."""
    from omnirl.trainer.algorithms.windows import lease_sampling_params

    backend.adapter.check_sampling(lease_sampling_params(cfg, seed=cfg.run.seed, step=0))


def _under_torchrun() -> bool:
    """Started by ``torchrun`` as one rank of several."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def _exit_rank(code: int) -> NoReturn:
    """End a ``torchrun`` rank whose run is over: leave the process group once nothing
    holds it any more, then exit without the interpreter's teardown.

    Exiting normally, a finished rank 0 was now and then killed by SIGABRT in the
    interpreter's teardown ("terminate called without an active exception", no Python frame
    on any thread; 2 of about 85 two-rank CPU runs here, and once in CI), and torchrun then
    reports the whole run failed. Here the objects that hold the group (the DDP module and
    its reducer, the server) are freed and the group destroyed while the interpreter is
    whole, and the C++ teardown is skipped. Checkpoints, metrics and the recording are
    closed by then; the logs are flushed before the exit.
    """
    import gc

    import torch.distributed as dist

    gc.collect()  # what _serve left in reference cycles
    if dist.is_initialized():
        dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
