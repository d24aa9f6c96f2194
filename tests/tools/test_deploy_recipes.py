"""The cluster recipes in ``deploy/``: every omnirl command in them parses with the real
command-line parsers, the trainer's overrides load with the real config loader (over the
quick start's config), the Kubernetes ports and addresses agree, and the Slurm scripts are
valid shell. (Nothing here can run a cluster: ``deploy/README.md`` says what was checked.)"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
QUICK_START = ROOT / "examples" / "shapes_flow_grpo.yaml"


def _parsers():
    from omnirl.reward.cli import build_parser as reward
    from omnirl.rollout.cli import build_parser as rollout
    from omnirl.trainer.cli import build_parser as trainer

    return {"trainer": trainer(), "rollout": rollout(), "reward": reward()}


def _parse(role: str, argv: list[str]):
    """Parse ``argv`` as ``role``'s command line; a trainer's overrides go through the
    config loader too. A parser error (argparse exits) fails the test with the arguments."""
    from omnirl.trainer.config import load_config

    try:
        args = _parsers()[role].parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"{role} {shlex.join(argv)}: rejected by its parser ({e})")
    if role == "trainer":
        load_config(QUICK_START, args.overrides)
    return args


def _containers():
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "omnirl.yaml").read_text()))
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    containers = {}
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            [c] = doc["spec"]["template"]["spec"]["containers"]
            containers[c["name"]] = c
    return by_kind, containers


def _overrides(args) -> dict[str, str]:
    return dict(o.split("=", 1) for o in args.overrides)


def test_kubernetes_commands_parse_and_agree():
    by_kind, containers = _containers()
    assert set(containers) == {"trainer", "rollout", "reward"}
    trainer = containers["trainer"]
    command = trainer["command"]
    assert Path(command[0]).name == "torchrun" and command[-2:] == ["-m", "omnirl.trainer.cli"]
    targs = _parse("trainer", trainer["args"])
    o = _overrides(targs)
    service = by_kind[("Service", "omnirl-trainer")]
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    assert {role: int(o[f"runtime.{role}_port"]) for role in ports} == ports
    assert o["runtime.host"] == "0.0.0.0"
    assert o["runtime.advertise_host"] == service["metadata"]["name"]
    assert {p["containerPort"] for p in trainer["ports"]} == set(ports.values())
    gpus = trainer["resources"]["limits"]["nvidia.com/gpu"]
    assert command[command.index("--nproc-per-node") + 1] == str(gpus)

    for role in ("rollout", "reward"):
        c = containers[role]
        assert Path(c["command"][0]).name == role
        args = _parse(role, c["args"])
        assert args.trainer == f"tcp://{service['metadata']['name']}:{ports['control']}"
        assert args.key_name == role and str(args.server_key) == "/keys/trainer.key"
        keys = next(v for v in c["volumeMounts"] if v["name"] == "keys")["mountPath"]
        assert str(args.keys) == keys
    reward = _parse("reward", containers["reward"]["args"])
    assert reward.bind.startswith("tcp://0.0.0.0:") and reward.advertise == "$(POD_IP)"
    assert {e["name"] for e in containers["reward"]["env"]} >= {"POD_IP"}
    assert int(reward.bind.rsplit(":", 1)[1]) == containers["reward"]["ports"][0]["containerPort"]
    # the model folder the trainer names is mounted where it loads it, read-only, on both
    for role in ("trainer", "rollout"):
        mounts = {v["name"]: v for v in containers[role]["volumeMounts"]}
        assert mounts["models"]["mountPath"] == "/models" and mounts["models"]["readOnly"]


def _slurm_commands(path: Path) -> dict[str, list[str]]:
    """The omnirl command lines of a Slurm script, shell variables left as words."""
    text = path.read_text().replace("\\\n", " ")
    found = {}
    for role in ("trainer", "rollout", "reward"):
        pattern = r"-m omnirl\.trainer\.cli (.*)" if role == "trainer" else rf"/{role}\" (.*)"
        m = re.search(pattern, text)
        if m:
            line = m.group(1).split('\' "$OMNIRL"')[0]
            line = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", line)  # ${NAME:-default}: the default
            found[role] = shlex.split(line.replace("'", " "))
    return found


@pytest.mark.parametrize("script", ["trainer", "rollout", "reward"])
def test_slurm_scripts_are_valid_shell_and_their_commands_parse(script):
    path = DEPLOY / "slurm" / f"{script}.sbatch"
    subprocess.run(["bash", "-n", str(path)], check=True)
    commands = _slurm_commands(path)
    assert list(commands) == [script]
    args = _parse(script, commands[script])
    if script == "trainer":
        o = _overrides(args)
        assert o["runtime.host"] == "0.0.0.0" and args.resume
    else:
        assert args.key_name == script and args.trainer_timeout >= 60
        # the trainer's address file, followed if a requeued trainer comes back elsewhere
        # ("$1" of the srun bash -c, the first argument after "$OMNIRL")
        assert args.trainer is None and args.trainer_file == "$1"
        assert '"$OMNIRL" "$RUN_DIR/trainer.addr"' in path.read_text()
