"""``uv run omnirl tap (--bind ADDR | --connect ADDR) --out DIR [--forward ADDR]``: record a
stream.

A PULL socket that writes every multipart message pushed to it into a recording (see
docs/recording.md), untouched, and optionally PUSHes it on to ``--forward`` (so the tap can
sit between a reward worker and the trainer's intake). It stops on SIGINT / SIGTERM, after
``--count`` messages or ``--duration`` seconds, and closes the segment cleanly.
``--connect`` dials a PUSH that binds (plain TCP: CURVE keys only with ``--bind``).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time

log = logging.getLogger("omnirl.tools.tap")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from omnirl.protocol.auth import add_security_arguments

    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--bind", help="bind the PULL here (senders connect to it)")
    where.add_argument("--connect", help="connect the PULL to a PUSH that binds")
    parser.add_argument("--out", required=True, help="recording directory")
    parser.add_argument("--forward", default=None, help="PUSH every message on to this address")
    parser.add_argument("--max-segment-mb", type=float, default=256.0)
    parser.add_argument("--fsync", choices=("never", "segment", "always"), default="segment")
    parser.add_argument("--count", type=int, default=0, help="stop after N messages (0: never)")
    parser.add_argument("--duration", type=float, default=0.0, help="stop after S seconds")
    parser.add_argument("--log-level", default="INFO")
    add_security_arguments(parser, default_name="tap")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    import zmq

    from omnirl.protocol.auth import SecurityConfig
    from omnirl.protocol.recording import RecordingError, RecordingWriter
    from omnirl.protocol.sockets import (
        SocketFactory,
        SocketOptions,
        bound_endpoint,
        recv_ready,
        send_frames,
    )

    options = SocketOptions(heartbeat_ivl_ms=0, heartbeat_timeout_ms=0, linger_ms=5000)
    security = SecurityConfig.from_args(args)
    stopping = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.append(True))
    try:
        writer = RecordingWriter(args.out, int(args.max_segment_mb * 2**20), fsync=args.fsync)
    except (RecordingError, OSError) as err:
        print(f"tap: {err}", file=sys.stderr)
        return 2
    with SocketFactory(security, options) as sockets, writer:
        try:
            if args.bind:
                pull = sockets.bind("intake", args.bind)
            else:
                security.check_endpoint(args.connect)
                pull = sockets.context.socket(zmq.PULL)
                options.apply(pull)
                pull.connect(args.connect)
            forward = sockets.connect("intake", args.forward) if args.forward else None
        except Exception as err:  # bad address, refused key, port in use: say it and stop
            print(f"tap: {err}", file=sys.stderr)
            return 2
        where = bound_endpoint(pull) if args.bind else args.connect
        log.info("tap recording %s into %s%s", where, args.out,
                 f", forwarding to {args.forward}" if forward is not None else "")  # fmt: skip
        print(f"tap listening {where}", flush=True)
        deadline = time.monotonic() + args.duration if args.duration else None
        try:
            while not stopping and not (args.count and writer.records >= args.count):
                if deadline is not None and time.monotonic() >= deadline:
                    break
                if not pull.poll(100):
                    continue
                frames = recv_ready(pull)
                if frames is None:  # a CURVE heartbeat woke the poll
                    continue
                writer.write(frames)
                if forward is not None:
                    send_frames(forward, frames)
        finally:
            if not args.bind:
                pull.close(linger=0)
        log.info("tap: %d messages, %.1f MB in %d segments", writer.records, writer.bytes / 1e6,
                 len(writer.segments))  # fmt: skip
    return 0
