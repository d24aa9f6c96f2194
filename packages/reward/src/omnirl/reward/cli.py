"""``uv run reward --trainer tcp://HOST:PORT|--trainer-file PATH [--scorer NAME[:W],...] [--bind ADDR] [--advertise HOST]``.

Without ``--scorer`` the worker scores with the run's ``reward.scorer``, which the trainer
sends in its Welcome."""

from __future__ import annotations

import argparse
import logging
import signal
import sys


def build_parser() -> argparse.ArgumentParser:
    from omnirl.protocol.auth import add_security_arguments
    from omnirl.protocol.trainer_link import add_trainer_arguments

    parser = argparse.ArgumentParser(
        prog="reward", description="omnirl reward worker: score trajectory groups, forward them"
    )
    add_trainer_arguments(parser)
    parser.add_argument(
        "--scorer",
        default=None,
        help="scorer name, or comma-separated NAME:WEIGHT list (default: the run's "
        "reward.scorer, sent by the trainer)",
    )
    parser.add_argument("--bind", default="tcp://127.0.0.1:0", help="where to bind the PULL")
    parser.add_argument(
        "--advertise",
        default="",
        help="host name or IP rollout workers connect to for this PULL (default: the --bind "
        "host, or this machine's host name where --bind is 0.0.0.0)",
    )
    parser.add_argument("--worker-id", default="", help="default: reward-<random>")
    parser.add_argument(
        "--trainer-timeout",
        type=float,
        default=30.0,
        help="exit (code 2) after the trainer is unreachable this long (s)",
    )
    parser.add_argument(
        "--batch-groups", type=int, default=1, help="score up to N queued groups together"
    )
    parser.add_argument(
        "--score-threads", type=int, default=1, help="threads for thread-safe rewards"
    )
    parser.add_argument("--log-level", default="INFO")
    add_security_arguments(parser, default_name="reward")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stdout,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from omnirl.protocol.memory import retain_freed_memory

    retain_freed_memory()  # large messages reuse mapped pages (omnirl.protocol.memory)
    from omnirl.protocol.auth import SecurityConfig
    from omnirl.reward.scorers import UnknownScorer
    from omnirl.reward.scoring import ScorerSpecError, parse_scorer_spec
    from omnirl.reward.worker import RewardWorker, RewardWorkerConfig

    try:
        scorers = parse_scorer_spec(args.scorer) if args.scorer is not None else None
    except (UnknownScorer, ScorerSpecError, ValueError) as exc:  # bad options, bad folders
        print(f"reward: {exc}", file=sys.stderr)
        return 2
    worker = RewardWorker(
        RewardWorkerConfig(
            trainer=args.trainer or "",
            trainer_file=args.trainer_file or "",
            scorers=scorers,
            bind=args.bind,
            advertise=args.advertise,
            worker_id=args.worker_id,
            security=SecurityConfig.from_args(args),
            trainer_timeout_s=args.trainer_timeout,
            batch_groups=max(1, args.batch_groups),
            score_threads=max(1, args.score_threads),
        )
    )
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: worker.stop())
    return worker.run()


if __name__ == "__main__":
    sys.exit(main())
