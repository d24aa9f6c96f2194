"""``omnirl <subcommand>``: the tools' command-line dispatcher.

Each subcommand is a module with ``add_arguments(parser)`` and ``run(args) -> int``.
To add one, add a line to :data:`SUBCOMMANDS` (modules are imported only when chosen,
so one tool's heavy imports never slow another down).
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    # name: (module, one-line help)
    "keygen": ("omnirl.tools.keygen", "write a CurveZMQ key pair (NAME.key, NAME.key_secret)"),
    "launch": ("omnirl.tools.launch", "start a trainer and its rollout / reward workers here"),
    "status": ("omnirl.tools.status", "show a running trainer's fleet, versions and leases"),
    "tap": ("omnirl.tools.tap", "record any stream: a PULL that writes a recording (and forwards)"),
    "replay": ("omnirl.tools.replay", "feed a recording into a running trainer's intake"),
    "inspect": ("omnirl.tools.inspect_recording", "summarise a recording; image grid of groups"),
}


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser and one (still empty) parser per subcommand."""
    parser = argparse.ArgumentParser(prog="omnirl", description="omnirl tools")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    subparsers = {
        name: sub.add_parser(name, help=help_text, description=help_text)
        for name, (_, help_text) in SUBCOMMANDS.items()
    }
    return parser, subparsers


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser, subparsers = build_parser()
    # First pass reads only the subcommand's name, so that only the chosen tool is imported.
    first = argv[:1] if argv and not argv[0].startswith("-") else argv
    command = parser.parse_known_args(first)[0].command
    module = importlib.import_module(SUBCOMMANDS[command][0])
    module.add_arguments(subparsers[command])
    args = parser.parse_args(argv)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
