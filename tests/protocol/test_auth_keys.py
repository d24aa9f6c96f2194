"""CurveZMQ key files, the keygen command, endpoint parsing and the loopback rule."""

from __future__ import annotations

import argparse
import os
import stat

import pytest
import zmq
import zmq.auth

from omnirl.protocol.auth import (
    InsecureEndpointError,
    InvalidEndpointError,
    SecurityConfig,
    SecurityConfigError,
    add_security_arguments,
    generate_keypair,
    is_loopback,
    load_keypair,
    load_public_key,
    parse_endpoint,
)
from omnirl.tools.cli import main as omnirl_main


def test_generate_keypair_writes_valid_keys_with_private_secret(tmp_path):
    public_path, secret_path = generate_keypair(tmp_path / "keys", "trainer")
    assert public_path.name == "trainer.key" and secret_path.name == "trainer.key_secret"
    assert stat.S_IMODE(secret_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(public_path.stat().st_mode) == 0o644

    # zmq's own reader agrees, and the pair is a real CURVE pair.
    public, secret = zmq.auth.load_certificate(secret_path)
    assert zmq.auth.load_certificate(public_path) == (public, None)
    assert len(public) == 40 and len(secret) == 40
    assert zmq.curve_public(secret) == public
    keys = load_keypair(tmp_path / "keys", "trainer")
    assert (keys.public, keys.secret) == (public, secret)
    assert load_public_key(public_path) == public


def test_generate_keypair_refuses_to_overwrite_unless_asked(tmp_path):
    generate_keypair(tmp_path, "a")
    first = load_public_key(tmp_path / "a.key")
    with pytest.raises(SecurityConfigError, match="exists"):
        generate_keypair(tmp_path, "a")
    assert load_public_key(tmp_path / "a.key") == first
    generate_keypair(tmp_path, "a", overwrite=True)
    assert load_public_key(tmp_path / "a.key") != first


@pytest.mark.parametrize("name", ["", "../x", ".hidden", "a/b"])
def test_generate_keypair_rejects_bad_names(tmp_path, name):
    with pytest.raises(SecurityConfigError, match="key name"):
        generate_keypair(tmp_path, name)


def test_load_keypair_refuses_a_readable_secret_and_missing_files(tmp_path):
    _, secret_path = generate_keypair(tmp_path, "w")
    os.chmod(secret_path, 0o644)
    with pytest.raises(SecurityConfigError, match="0600"):
        load_keypair(tmp_path, "w")
    with pytest.raises(SecurityConfigError, match="cannot read"):
        load_keypair(tmp_path, "missing")
    with pytest.raises(SecurityConfigError, match="cannot read public key"):
        load_public_key(tmp_path / "missing.key")


def test_keygen_command(tmp_path, capsys):
    assert omnirl_main(["keygen", str(tmp_path / "k"), "--name", "rollout-0"]) == 0
    out = capsys.readouterr().out
    public = load_public_key(tmp_path / "k" / "rollout-0.key")
    assert public.decode() in out
    assert stat.S_IMODE((tmp_path / "k" / "rollout-0.key_secret").stat().st_mode) == 0o600
    # a second run refuses (exit 1, clear message); --force replaces
    assert omnirl_main(["keygen", str(tmp_path / "k"), "--name", "rollout-0"]) == 1
    assert "exists" in capsys.readouterr().out
    assert omnirl_main(["keygen", str(tmp_path / "k"), "--name", "rollout-0", "--force"]) == 0
    assert load_public_key(tmp_path / "k" / "rollout-0.key") != public


def test_cli_rejects_unknown_subcommand(capsys):
    with pytest.raises(SystemExit) as e:
        omnirl_main(["no-such-tool"])
    assert e.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("tcp://127.0.0.1:5555", True),
        ("tcp://127.3.4.5:*", True),
        ("tcp://localhost:0", True),
        ("tcp://[::1]:5555", True),
        ("ipc:///tmp/omnirl.sock", True),
        ("inproc://control", True),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://*:5555", False),
        ("tcp://192.0.2.7:5555", False),
        ("tcp://[::]:5555", False),
        ("tcp://eth0:5555", False),
        ("tcp://trainer.example.org:5555", False),
        ("tcp://127.0.0.1:0;10.0.0.1:5555", False),  # source;destination
    ],
)
def test_loopback_detection(address, loopback):
    assert is_loopback(address) is loopback


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1:5555", "udp://127.0.0.1:5", "tcp://127.0.0.1", "tcp://:5555", "tcp://h:99999", ""],
)
def test_bad_endpoints_are_typed_errors(address):
    with pytest.raises(InvalidEndpointError, match="endpoint"):
        parse_endpoint(address)


def test_parse_endpoint_fields():
    assert parse_endpoint("tcp://[::1]:7").host == "::1"
    assert parse_endpoint("tcp://[::1]:7").is_ipv6
    assert parse_endpoint("tcp://10.1.2.3:*").port == "*"
    assert parse_endpoint("ipc:///run/x").path == "/run/x"


def test_non_loopback_needs_keys_or_insecure(tmp_path):
    with pytest.raises(InsecureEndpointError, match="--insecure"):
        SecurityConfig().check_endpoint("tcp://0.0.0.0:5555")
    SecurityConfig().check_endpoint("tcp://127.0.0.1:5555")
    SecurityConfig(insecure=True).check_endpoint("tcp://0.0.0.0:5555")
    SecurityConfig(keys_dir=tmp_path, name="x").check_endpoint("tcp://0.0.0.0:5555")


def test_security_arguments_round_trip(tmp_path):
    parser = argparse.ArgumentParser()
    add_security_arguments(parser, default_name="trainer")
    cfg = SecurityConfig.from_args(parser.parse_args([]))
    assert cfg == SecurityConfig(name="trainer")
    args = parser.parse_args(
        ["--keys", str(tmp_path), "--key-name", "r0", "--server-key", "s.key", "--insecure"]
    )
    cfg = SecurityConfig.from_args(args)
    assert cfg.curve and cfg.insecure and cfg.name == "r0" and cfg.keys_dir == tmp_path
    assert cfg.allow_list_dir() == tmp_path  # defaults to the keys folder
