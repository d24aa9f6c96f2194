"""The GPU example (``examples/sd35m_flow_grpo_ocr.yaml`` and its launch script) is accepted
as a whole: the trainer's keys, the step's overrides, the reward spec, the prompts, and every
flag the script gives the launcher and, through it, a rollout worker on a one-GPU machine.

Nothing here runs the model (SD3.5-Medium's weights are not in the repository); the same
settings ran on the GPU machine in ``benchmarks/gpu_loop.py`` (docs/gpu_sessions.md)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from omnirl.reward.scorers.ocr import normalise, target_text
from omnirl.reward.scoring import parse_scorer_spec
from omnirl.rollout.cli import build_parser as rollout_parser
from omnirl.tools.cli import build_parser as tools_parser
from omnirl.tools.launch import (
    add_arguments,
    rollout_arguments,
    rollout_devices,
    shared_gpu_arguments,
)
from omnirl.trainer.backend import train_step_config
from omnirl.trainer.config import load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "sd35m_flow_grpo_ocr.yaml"
SCRIPT = ROOT / "examples" / "sd35m_flow_grpo_ocr.sh"


def _launch_argv() -> list[str]:
    """The arguments the script gives ``omnirl launch`` (its ``exec`` command, continuation
    lines joined, ``"$@"`` dropped)."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    (line,) = [x for x in text.splitlines() if x.startswith("exec ")]
    words = shlex.split(line)
    assert words[:5] == ["exec", "uv", "run", "omnirl", "launch"], words
    return [w for w in words[5:] if w != "$@"]


def test_every_key_of_the_example_is_accepted():
    cfg = load_config(str(CONFIG))
    assert (cfg.run.device, cfg.run.dtype) == ("cuda", "bfloat16")
    assert cfg.train.float8 and cfg.train.float8_activation == "static" and cfg.train.compile
    step = train_step_config(cfg)  # the algorithm's overrides are TrainStep.Config fields
    assert (step.kl_beta, step.lr, step.num_minibatches) == (0.04, 3e-4, 2)
    assert step.micro_batch_size == 8 and step.timestep_fraction == 0.99
    (scorer,) = parse_scorer_spec(cfg.reward.scorer)
    assert scorer.name == "ocr"


def test_the_prompts_each_name_the_text_the_ocr_reward_reads():
    cfg = load_config(str(CONFIG))
    rows = [json.loads(x) for x in (ROOT / cfg.data.prompts).read_text().splitlines()]
    assert len(rows) == 48
    for row in rows:
        assert target_text(row["prompt"]) == normalise(row["metadata"]["text"]), row


def test_the_scripts_flags_reach_a_rollout_worker_that_accepts_them():
    parser, subparsers = tools_parser()
    add_arguments(subparsers["launch"])
    args = parser.parse_args(["launch", *_launch_argv()])
    assert Path(args.config) == CONFIG.relative_to(ROOT) and (args.rollout, args.reward) == (1, 2)
    cfg = load_config(str(CONFIG))
    # what the launcher makes of them on a one-GPU machine: the worker beside the trainer
    argv = rollout_arguments(args.rollout_args, cfg, threads=4)
    devices = rollout_devices(cfg.run.device, args.rollout, args.trainer_procs, gpus=1)
    argv = shared_gpu_arguments(argv, devices, cfg.run.device, args.trainer_procs, (512, 512))
    worker = rollout_parser().parse_args([*argv, "--trainer", "tcp://127.0.0.1:5555"])
    assert worker.float8 == "static" and worker.float8_fast_accum and worker.compile_decoder
    assert worker.attention == cfg.train.attention  # the trainer's kernel (parity)
    assert worker.compile_cache == cfg.train.compile_cache  # one cache: a restart starts warm
