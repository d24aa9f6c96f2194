"""Adapter registries: lookup order, unknown names, entry-point discovery, architecture_of."""

from __future__ import annotations

import json

import pytest

from omnirl.models import registry
from omnirl.models.registry import (
    ArchitectureNotFound,
    UnknownAdapter,
    architecture_of,
    get_rollout_adapter,
    get_training_adapter,
    register_rollout_adapter,
    register_training_adapter,
)


@pytest.fixture
def clean_tables(monkeypatch):
    """Run a test against copies of the registries, discovered first so that the copies
    (thrown away afterwards) are not where the entry points' adapters land."""
    registry.discover()
    monkeypatch.setattr(registry, "_TRAINING", dict(registry._TRAINING))
    monkeypatch.setattr(registry, "_ROLLOUT", dict(registry._ROLLOUT))


def test_importing_omnirl_models_registers_nothing():
    import subprocess
    import sys

    code = (
        "import sys, omnirl.models, omnirl.models.registry as r;"
        "assert not r._TRAINING and not r._ROLLOUT, (r._TRAINING, r._ROLLOUT);"
        "assert 'omnirl.models.sd3' not in sys.modules;"
        "assert 'diffusers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_exact_algorithm_first_then_wildcard(clean_tables):
    @register_training_adapter("ToyPipeline")
    class Generic:
        pass

    @register_training_adapter("ToyPipeline", algorithms=("diffusion_dpo",))
    class Dpo:
        pass

    assert get_training_adapter("ToyPipeline", "flow_grpo") is Generic
    assert get_training_adapter("ToyPipeline", "diffusion_dpo") is Dpo
    assert get_training_adapter("ToyPipeline") is Generic


def test_unknown_architecture_lists_known_keys(clean_tables):
    @register_rollout_adapter("ToyPipeline", algorithms="flow_grpo")
    class Toy:
        pass

    with pytest.raises(UnknownAdapter) as info:
        get_rollout_adapter("NoSuchPipeline", "flow_grpo")
    message = str(info.value)
    assert "NoSuchPipeline" in message and "ToyPipeline/flow_grpo" in message
    assert isinstance(info.value, KeyError)
    with pytest.raises(UnknownAdapter, match="algorithm 'other'"):
        get_rollout_adapter("ToyPipeline", "other")


def test_duplicate_registration_is_refused(clean_tables):
    @register_training_adapter("ToyPipeline")
    class A:
        pass

    with pytest.raises(registry.DuplicateAdapter):

        @register_training_adapter("ToyPipeline")
        class B:
            pass


def test_entry_point_discovery_finds_sd3():
    train = get_training_adapter("StableDiffusion3Pipeline", "flow_grpo")
    roll = get_rollout_adapter("StableDiffusion3Pipeline", "flow_grpo")
    assert train.__name__ == "SD3TrainingAdapter"
    assert roll.__name__ == "SD3RolloutAdapter"
    known = registry.known_adapters()
    assert ("StableDiffusion3Pipeline", "*") in known["training"]


def test_architecture_of_diffusers_and_transformers(tmp_path):
    d = tmp_path / "pipe"
    d.mkdir()
    (d / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))
    assert architecture_of(d) == "StableDiffusion3Pipeline"
    t = tmp_path / "lm"
    t.mkdir()
    (t / "config.json").write_text(json.dumps({"architectures": ["Qwen3OmniForCausalLM"]}))
    assert architecture_of(t) == "Qwen3OmniForCausalLM"


def test_architecture_of_errors(tmp_path):
    with pytest.raises(ArchitectureNotFound, match="not a directory"):
        architecture_of(tmp_path / "missing")
    with pytest.raises(ArchitectureNotFound, match="neither model_index"):
        architecture_of(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "x"}))
    with pytest.raises(ArchitectureNotFound, match="architectures"):
        architecture_of(tmp_path)
    (tmp_path / "model_index.json").write_text("{not json")
    with pytest.raises(ArchitectureNotFound, match="not valid JSON"):
        architecture_of(tmp_path)


def test_architecture_of_tiny_model(tiny_sd3_path):
    assert architecture_of(tiny_sd3_path) == "StableDiffusion3Pipeline"
