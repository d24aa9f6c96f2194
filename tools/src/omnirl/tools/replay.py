"""``uv run replay DIR --trainer ADDR [--speed recorded|max|FACTOR]``: feed a recording into a
running trainer's intake, as a reward worker would.

It says ``Hello(role="tap")`` on the trainer's control socket, learns the intake address
from the ``Welcome``, and PUSHes every intact recorded message to it, unchanged (the frames
are views of the memory-mapped segments: nothing is decoded or copied). ``--speed
recorded`` keeps the recorded gaps between messages, ``FACTOR`` divides them (2 = twice as
fast), ``max`` sends as fast as the trainer takes them (the PUSH blocks at its high-water
mark, so nothing is dropped).

The trainer must accept groups it did not lease itself: start it with
``trainer --admit-unleased`` (or use ``trainer --replay DIR``, which needs no sockets).
Exit codes: 0 all sent, 1 the trainer did not answer, 2 bad arguments or recording.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import uuid

log = logging.getLogger("omnirl.tools.replay")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from omnirl.protocol.auth import add_security_arguments

    parser.add_argument("directory", metavar="DIR", help="the recording (a folder of segments)")
    parser.add_argument("--trainer", required=True, help="the trainer's control address")
    parser.add_argument(
        "--speed",
        default="max",
        help="'recorded' (recorded gaps), 'max' (no waiting) or a speed-up factor (default max)",
    )
    parser.add_argument("--worker-id", default="", help="default: replay-<random>")
    parser.add_argument("--timeout", type=float, default=30.0, help="wait for Welcome (s)")
    parser.add_argument("--log-level", default="INFO")
    add_security_arguments(parser, default_name="replay")


def _speed(text: str) -> float:
    """0 for 'max', 1 for 'recorded', else the factor; ValueError for anything else."""
    if text == "max":
        return 0.0
    if text == "recorded":
        return 1.0
    factor = float(text)
    if not factor > 0:
        raise ValueError(f"--speed {text!r}: a factor must be > 0")
    return 1.0 / factor


def paced(records, scale: float, *, clock=time.monotonic, sleep=time.sleep):
    """Yield ``records`` (anything with a ``.time`` in seconds) no earlier than their recorded
    offsets from the first one times ``scale`` (0: at once, 1: as recorded, 0.5: twice as
    fast). Late records are not waited for and never reordered."""
    start = first = None
    for record in records:
        if first is None:
            first, start = record.time, clock()
        elif scale:
            delay = (record.time - first) * scale - (clock() - start)
            if delay > 0:
                sleep(delay)
        yield record


def _welcome(sockets, address: str, worker_id: str, timeout_s: float):
    from omnirl.protocol.messages import Hello, Refusal, Welcome
    from omnirl.protocol.sockets import recv_message, send_message

    control = sockets.connect("control", address)
    send_message(control, Hello(role="tap", worker_id=worker_id))
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            got = recv_message(control, timeout_ms=int(left * 1000))
        except TimeoutError:
            break
        if isinstance(got.message, Welcome):
            return got.message
        if isinstance(got.message, Refusal):
            raise ConnectionRefusedError(
                f"trainer refused: {got.message.code}: {got.message.reason}"
            )
    raise TimeoutError(f"no Welcome from {address} within {timeout_s:.0f} s")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from omnirl.protocol.auth import SecurityConfig
    from omnirl.protocol.recording import RecordingError, RecordingReader
    from omnirl.protocol.sockets import SocketFactory, SocketOptions, send_frames

    try:
        scale = _speed(args.speed)
        reader = RecordingReader(args.directory)
    except (ValueError, RecordingError) as err:
        print(f"replay: {err}", file=sys.stderr)
        return 2
    worker_id = args.worker_id or f"replay-{uuid.uuid4().hex[:8]}"
    # a long linger: messages still queued when the last one is handed over are delivered
    options = SocketOptions(linger_ms=60_000, heartbeat_ivl_ms=0, heartbeat_timeout_ms=0)
    with SocketFactory(SecurityConfig.from_args(args), options) as sockets:
        try:
            welcome = _welcome(sockets, args.trainer, worker_id, args.timeout)
        except (TimeoutError, ConnectionRefusedError) as err:
            print(f"replay: {err}", file=sys.stderr)
            return 1
        intake = sockets.connect("intake", welcome.topology.intake)
        log.info("replaying %s into %s (run %s)", args.directory, welcome.topology.intake,
                 welcome.run_id)  # fmt: skip
        sent = nbytes = 0
        for record in paced(reader.records(), scale):
            send_frames(intake, record.frames)
            sent += 1
            nbytes += sum(f.nbytes for f in record.frames)
        stats = reader.stats
        log.info(
            "sent %d messages (%.1f MB); skipped %d damaged regions, %d truncated tails, "
            "%d unreadable segments", sent, nbytes / 1e6, stats.corrupt, stats.truncated,
            stats.bad_segments,
        )  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="replay", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
