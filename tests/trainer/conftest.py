"""Fixtures of the trainer tests."""

from __future__ import annotations

import json

import pytest

from omnirl.trainer.config import load_config
from omnirl.trainer.server import TrainerServer


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
