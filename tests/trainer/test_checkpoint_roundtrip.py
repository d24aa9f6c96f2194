"""Checkpoints: atomic folders, `latest`, parameters / optimiser / RNG / state round trip."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from omnirl.trainer.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    set_rng_state,
)


class TinyAdapter:
    weight_format = "full"

    def __init__(self, seed):
        torch.manual_seed(seed)
        self.module = torch.nn.Linear(4, 3)

    def trainable_parameters(self):
        return list(self.module.parameters())

    def save_pretrained(self, directory):
        import os

        from safetensors.torch import save_file

        os.makedirs(directory, exist_ok=True)
        save_file(
            {k: v.contiguous() for k, v in self.module.state_dict().items()},
            f"{directory}/w.safetensors",
        )


class TinyStep:
    """Hand-written momentum SGD: an optimiser state without torch.optim's slow first import."""

    def __init__(self, adapter):
        self.params = adapter.trainable_parameters()
        self.momentum = [torch.zeros_like(p) for p in self.params]

    def train(self, adapter):
        adapter.module(torch.ones(2, 4)).sum().backward()
        with torch.no_grad():
            for p, m in zip(self.params, self.momentum, strict=True):
                m.mul_(0.9).add_(p.grad)
                p.sub_(0.1 * m)
                p.grad = None

    def state_dict(self):
        return {"momentum": [m.clone() for m in self.momentum]}

    def load_state_dict(self, state):
        for m, saved in zip(self.momentum, state["momentum"], strict=True):
            m.copy_(saved)


def test_round_trip_restores_parameters_optimiser_rng_and_state(tmp_path):
    adapter = TinyAdapter(0)
    step = TinyStep(adapter)
    step.train(adapter)
    state = {"version": 7, "data": {"pos": 3}, "ledger": {"open": [], "counters": {"x": 1}}}
    torch.manual_seed(123)
    np.random.seed(5)
    random.seed(9)
    path = save_checkpoint(
        tmp_path, 7, state=state, adapter=adapter, train_step=step, config_yaml="a: 1\n"
    )
    expected = (torch.rand(3), np.random.rand(3), random.random())
    assert (path / "policy" / "w.safetensors").is_file()
    assert latest_checkpoint(tmp_path) == path

    other = TinyAdapter(1)
    other_step = TinyStep(other)
    ck = load_checkpoint(path, adapter=other, train_step=other_step)
    for a, b in zip(adapter.trainable_parameters(), other.trainable_parameters(), strict=True):
        assert torch.equal(a, b)
    assert ck.step == 7 and ck.state["version"] == 7 and ck.state["data"] == {"pos": 3}
    set_rng_state(ck.state["rng"])
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1])
    assert random.random() == expected[2]
    # the optimiser continues identically
    step.train(adapter)
    other_step.train(other)
    for a, b in zip(adapter.trainable_parameters(), other.trainable_parameters(), strict=True):
        assert torch.equal(a, b)


def test_latest_ignores_partial_folders_and_keep_last_prunes(tmp_path):
    for s in (1, 2, 3):
        save_checkpoint(tmp_path, s, state={"version": s}, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    (tmp_path / ".step_00000004.tmp-1").mkdir()  # a crash mid-write
    (tmp_path / "step_00000005").mkdir()  # a folder without state.pt
    assert latest_checkpoint(tmp_path).name == "step_00000003"
    (tmp_path / "latest").write_text("step_00000009\n")  # stale pointer
    assert latest_checkpoint(tmp_path).name == "step_00000003"
    assert latest_checkpoint(tmp_path / "nothing") is None


def test_mismatched_model_is_refused(tmp_path):
    adapter = TinyAdapter(0)
    path = save_checkpoint(tmp_path, 1, state={"version": 1}, adapter=adapter)

    class Bigger(TinyAdapter):
        def __init__(self):
            self.module = torch.nn.Linear(5, 3)

    with pytest.raises(CheckpointError, match="shape"):
        load_checkpoint(path, adapter=Bigger())
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        load_checkpoint(tmp_path / "nope")


def test_a_lora_policy_keeps_its_adapter_config(tmp_path):
    """The LoRA weights file holds no alpha; without it a reader would get the scale wrong."""
    import json

    class TinyLora(TinyAdapter):
        weight_format = "lora"

        def adapter_config(self):
            return {"r": 2, "lora_alpha": 4, "target_modules": ("attn.to_q",)}

    path = save_checkpoint(tmp_path, 1, state={}, adapter=TinyLora(0), config_yaml="")
    saved = json.loads((path / "policy" / "adapter_config.json").read_text())
    assert saved == {"r": 2, "lora_alpha": 4, "target_modules": ["attn.to_q"]}
    full = save_checkpoint(tmp_path / "full", 1, state={}, adapter=TinyAdapter(0), config_yaml="")
    assert not (full / "policy" / "adapter_config.json").exists()


def test_an_ema_step_also_writes_the_averaged_policy(tmp_path):
    """policy_ema/ holds the EMA's values; policy/ and the live parameters keep the trained."""
    from safetensors.torch import load_file

    from omnirl.trainer.ema import EMA

    adapter = TinyAdapter(0)
    step = TinyStep(adapter)
    step.ema = EMA(adapter.trainable_parameters(), decay=0.5, warmup=False)
    start = [p.detach().clone() for p in adapter.trainable_parameters()]
    step.train(adapter)
    step.ema.update()  # average = (start + trained) / 2
    trained = [p.detach().clone() for p in adapter.trainable_parameters()]
    path = save_checkpoint(tmp_path, 1, state={}, adapter=adapter, train_step=step)
    live = load_file(path / "policy" / "w.safetensors")
    averaged = load_file(path / "policy_ema" / "w.safetensors")
    names = ["weight", "bias"]
    for name, s, t in zip(names, start, trained, strict=True):
        assert torch.equal(live[name], t)
        assert torch.allclose(averaged[name], (s + t) / 2)
    assert all(
        torch.equal(p, t) for p, t in zip(adapter.trainable_parameters(), trained, strict=True)
    )
    plain = save_checkpoint(
        tmp_path / "plain", 1, state={}, adapter=adapter, train_step=TinyStep(adapter)
    )
    assert not (plain / "policy_ema").exists()
