"""``omnirl status --trainer ADDR``: the trainer's view of a running fleet.

Sends a ``StatusRequest`` on the trainer's control socket and prints the ``Status``:
workers (role, version held, last heard, leases in hand, time left on a bench), the policy
version and step,
leases in flight, buffered groups, intake rate and the ledger's counters. ``--json``
prints the message itself; ``--watch S`` repeats every S seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import msgspec

from omnirl.protocol.auth import SecurityConfig, add_security_arguments


class StatusUnavailable(RuntimeError):
    """The trainer did not answer (not running, wrong address, or wrong keys)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trainer", default="", help="the trainer's control address")
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="read the address from RUN_DIR/trainer.addr instead of --trainer",
    )
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer")
    parser.add_argument("--json", action="store_true", help="print the Status message as JSON")
    parser.add_argument("--watch", type=float, default=0.0, help="repeat every WATCH seconds")
    add_security_arguments(parser, default_name="client")


def fetch_status(address: str, *, security: SecurityConfig | None = None, timeout_s: float = 5.0):
    """One ``Status`` from the trainer at ``address``; raises :class:`StatusUnavailable`."""
    from omnirl.protocol.messages import Refusal, Status, StatusRequest
    from omnirl.protocol.sockets import SocketFactory, SocketOptions, recv_message, send_message

    with SocketFactory(security or SecurityConfig(), SocketOptions(linger_ms=0)) as sockets:
        control = sockets.connect("control", address)
        send_message(control, StatusRequest(worker_id="omnirl-status"))
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                received = recv_message(control, timeout_ms=int(left * 1000))
            except TimeoutError:
                break
            msg = received.message
            if isinstance(msg, Status):
                return msg
            if isinstance(msg, Refusal):
                raise StatusUnavailable(
                    f"trainer refused the status request: {msg.code}: {msg.reason}"
                )
    raise StatusUnavailable(f"no answer from {address} within {timeout_s:g} s")


def format_status(status) -> str:
    """A few lines a person reads: the run, then one line per worker."""
    lines = [
        f"run {status.run_id}: {status.state}, step {status.step}/{status.max_steps}, "
        f"policy version {status.policy_version}",
        f"leases in flight {status.leases_in_flight}, groups buffered {status.groups_buffered}, "
        f"intake {status.intake_rate:.2f} groups/s",
    ]
    workers = sorted(status.workers, key=lambda w: (w.role, w.worker_id))
    if workers:
        lines.append(f"{'worker':<24} {'role':<8} {'version':>7} {'seen':>7}  leases")
        for w in workers:
            leases = ", ".join(w.leases) if w.leases else "-"
            version = str(w.policy_version) if w.policy_version >= 0 else "-"
            lines.append(
                f"{w.worker_id:<24} {w.role:<8} {version:>7} {w.last_seen_s:>6.1f}s  {leases}"
                + (f"  @ {w.address}" if w.address else "")
                + (f"  benched {w.benched_s:.0f}s" if w.benched_s > 0 else "")
            )
    else:
        lines.append("no workers")
    if status.counters:
        counters = ", ".join(f"{k}={v}" for k, v in sorted(status.counters.items()))
        lines.append(f"counters: {counters}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    address = args.trainer
    if not address and args.run_dir is not None:
        from omnirl.protocol.trainer_link import ADDRESS_FILE, read_address_file

        try:
            address = read_address_file(args.run_dir / ADDRESS_FILE)
        except (OSError, ValueError) as exc:
            print(f"omnirl status: {exc}", file=sys.stderr)
            return 2
        if not address:
            print(f"omnirl status: no address in {args.run_dir / ADDRESS_FILE}", file=sys.stderr)
            return 2
    if not address:
        print("omnirl status: give --trainer ADDR or --run-dir DIR", file=sys.stderr)
        return 2
    security = SecurityConfig.from_args(args)
    while True:
        try:
            status = fetch_status(address, security=security, timeout_s=args.timeout)
        except StatusUnavailable as exc:
            print(f"omnirl status: {exc}", file=sys.stderr)
            return 1
        if args.json:
            print(json.dumps(msgspec.to_builtins(status), indent=2, sort_keys=True))
        else:
            print(format_status(status))
        if args.watch <= 0:
            return 0
        print()
        time.sleep(args.watch)
