"""``omnirl keygen DIR --name NAME``: write a CurveZMQ key pair.

Writes ``DIR/NAME.key`` (public: copy it into the allow-list folder of every server this
process may connect to, or hand it to clients as ``--server-key``) and
``DIR/NAME.key_secret`` (secret, mode 0600: never leaves this machine).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from omnirl.protocol.auth import SecurityConfigError, generate_keypair, load_public_key


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, help="folder to write the key files into")
    parser.add_argument("--name", required=True, help="key pair name, e.g. trainer, rollout-0")
    parser.add_argument("--force", action="store_true", help="replace an existing key pair")


def run(args: argparse.Namespace) -> int:
    try:
        public_path, secret_path = generate_keypair(args.dir, args.name, overwrite=args.force)
    except (SecurityConfigError, OSError) as e:
        print(f"omnirl keygen: {e}")
        return 1
    print(f"public key  {public_path}  {load_public_key(public_path).decode('ascii')}")
    print(f"secret key  {secret_path}  (mode 0600)")
    return 0
