"""Fixtures of the trainer tests."""

from __future__ import annotations

import json

import msgspec
import pytest
import torch

from omnirl.models.registry import get_rollout_adapter
from omnirl.protocol.messages import PromptSpec, Rewards, SamplingParams
from omnirl.trainer.config import load_config
from omnirl.trainer.server import TrainerServer


class NoModel:
    """A backend with no model: for server tests that never train or publish."""

    architecture, model_path, sde_type = "Null", "", "sde"
    weight_format, adapter_config = "lora", {"r": 1}
    adapter = train_step = None

    def export_weights(self):
        return {}


@pytest.fixture
def no_model() -> NoModel:
    return NoModel()


@pytest.fixture
def null_server(tmp_path):
    """``make(backend, *overrides)``: a TrainerServer over ``backend`` (a stand-in that
    trains nothing) on 8 one-line prompts, two groups per step, no sockets opened; its step
    thread is shut down at the end of the test."""
    servers = []

    def make(backend, *overrides: str) -> TrainerServer:
        prompts = tmp_path / "p.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(8)))
        cfg = load_config(
            None,
            [
                "model.path=unused",
                f"data.prompts={prompts}",
                f"run.output_dir={tmp_path / 'run'}",
                "train.groups_per_step=2",
                *overrides,
            ],
        )
        servers.append(TrainerServer(cfg, backend))
        return servers[-1]

    yield make
    for server in servers:
        server._executor.shutdown(wait=True)


@pytest.fixture(scope="module")
def tiny_sd3_groups(tiny_sd3_path):
    """Two FlowGRPO groups of 4 samples from the tiny SD3 (3 steps, the last two recorded),
    with rewards that differ within each group."""
    torch.set_num_threads(1)
    rollout = get_rollout_adapter("StableDiffusion3Pipeline", "flow_grpo").from_pretrained(
        tiny_sd3_path, device="cpu"
    )
    sampling = SamplingParams(
        group_size=4,
        num_steps=3,
        guidance_scale=1.0,
        height=32,
        width=32,
        sde_window=(1, 3),
        seed=3,
    )
    prompts = [PromptSpec(group_id=f"g{i}", text=f"a photo of thing {i}") for i in range(2)]
    out = rollout.sample(prompts, sampling, lease_id="l0", worker_id="w0", policy_version=0)
    totals = ((0.0, 1.0, 0.5, 2.0), (2.0, 0.0, 1.0, 0.3))
    return [
        msgspec.structs.replace(g, rewards=Rewards(group_id=g.group_id, total=list(r)))
        for g, r in zip(out, totals, strict=True)
    ]
