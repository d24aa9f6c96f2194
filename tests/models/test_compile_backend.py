"""The compiled backend (regional torch.compile) of the SD3 adapters, on the tiny model.

Graphs are traced with the ``aot_eager`` backend (dynamo + AOTAutograd, no code
generation) so the tests take seconds on a CPU; ``OMNIRL_TEST_DEVICE=cuda`` runs them on a
GPU. Inductor itself is exercised by ``benchmarks/gpu_sd35m.py``.
"""

from __future__ import annotations

import os

import pytest
import torch

from omnirl.models.compile import (
    CompileConfig,
    compile_module,
    is_compiled,
    regional_scope,
    repeated_blocks,
)
from omnirl.models.compile_cache import load_artifacts, save_artifacts, use_cache_dir
from omnirl.models.sd3 import SD3RolloutAdapter, SD3TrainingAdapter
from omnirl.models.transitions import collate_transitions
from omnirl.protocol.messages import PromptSpec, SamplingParams

pytestmark = pytest.mark.usefixtures("torch_one_thread")
LORA = {"r": 4, "lora_alpha": 8}
SAMPLING = SamplingParams(group_size=2, num_steps=3, height=32, width=32, sde_window=(0, 2), seed=3)


class CountingBackend:
    """A dynamo backend that counts the graphs it is handed and runs them as traced."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


def _sample(adapter, text: str = "a cat"):
    prompts = [PromptSpec(group_id="g", text=text)]
    return adapter.sample(prompts, SAMPLING, lease_id="l", worker_id="w", policy_version=0)


def _compiled_rollout(path, device, config: CompileConfig):
    """The tiny rollout adapter compiled with ``config``, and the names it compiled."""
    torch.manual_seed(0)
    adapter = SD3RolloutAdapter.from_pretrained(
        path, device=device, lora=LORA, max_sequence_length=16
    )
    return adapter, adapter.compile(config)


def _assert_matches_eager(groups, eager_groups) -> None:
    torch.testing.assert_close(groups[0].log_probs, eager_groups[0].log_probs, atol=1e-5, rtol=0)
    torch.testing.assert_close(groups[0].final_latents, eager_groups[0].final_latents)


@pytest.fixture(scope="module")
def eager_groups(tiny_sd3_path, test_device):
    torch.manual_seed(0)
    adapter = SD3RolloutAdapter.from_pretrained(
        tiny_sd3_path, device=test_device, lora=LORA, max_sequence_length=16
    )
    return _sample(adapter)


def test_repeated_blocks_are_the_transformer_blocks(tiny_sd3_path):
    from diffusers import SD3Transformer2DModel

    model = SD3Transformer2DModel.from_pretrained(tiny_sd3_path, subfolder="transformer")
    blocks = repeated_blocks(model)
    assert blocks == list(model.transformer_blocks)
    names = compile_module(model, CompileConfig(backend="eager"))
    assert names == [f"transformer_blocks.{i}" for i in range(len(blocks))]
    assert is_compiled(model) and compile_module(model, CompileConfig(backend="eager")) == []
    assert set(model.state_dict()) == set(
        SD3Transformer2DModel.from_pretrained(tiny_sd3_path, subfolder="transformer").state_dict()
    )  # the module tree and its keys are unchanged


def test_compiled_rollout_matches_eager_and_prompt_length_does_not_recompile(
    tiny_sd3_path, test_device, eager_groups
):
    counter = CountingBackend()
    adapter, _ = _compiled_rollout(tiny_sd3_path, test_device, CompileConfig(backend=counter))
    assert adapter.backend == "compiled"
    groups = _sample(adapter)
    graphs = counter.graphs
    assert graphs >= 2  # two block variants (the last block is context-pre-only)
    _assert_matches_eager(groups, eager_groups)
    # a much longer prompt: the tokenizers pad / truncate to a fixed length, no new graph
    _sample(adapter, "a very long prompt " * 20)
    assert counter.graphs == graphs


def test_compiled_trainer_with_checkpointing_matches_eager_log_probs_and_grads(
    tiny_sd3_path, test_device, eager_groups
):
    batch = collate_transitions(eager_groups, 1)
    grads, logps = [], []
    for compiled in (False, True):
        torch.manual_seed(0)
        train = SD3TrainingAdapter.from_pretrained(
            tiny_sd3_path, device=test_device, lora=LORA, gradient_checkpointing=compiled
        )
        with torch.no_grad():
            for p in train.trainable_parameters():
                p.add_(0.01)
        if compiled:
            train.compile(CompileConfig(backend="aot_eager"))
        out = train.transition(batch, sde_type="sde")
        out.log_prob.sum().backward()
        logps.append(out.log_prob.detach().cpu())
        grads.append(torch.cat([p.grad.flatten() for p in train.trainable_parameters()]).cpu())
        with torch.no_grad(), train.reference():  # the adapter-disabled graphs
            ref = train.transition(batch, sde_type="sde")
        assert torch.isfinite(ref.prev_sample_mean).all()
    torch.testing.assert_close(logps[1], logps[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-4)
    with pytest.raises(ValueError, match="CUDA graphs"):
        train.compile(CompileConfig(mode="reduce-overhead"))


def test_whole_scope_compiles_the_denoiser_as_one_module_and_matches_eager(
    tiny_sd3_path, test_device, eager_groups
):
    whole = CompileConfig(backend=CountingBackend(), regional=regional_scope("whole"))
    adapter, names = _compiled_rollout(tiny_sd3_path, test_device, whole)
    assert names == ["SD3Transformer2DModel"]
    assert not any(
        getattr(b, "_omnirl_compiled", False) for b in repeated_blocks(adapter.transformer)
    )
    _assert_matches_eager(_sample(adapter), eager_groups)
    # the trainer's whole graph: log-probs and gradients as eager, the reference pass too
    batch = collate_transitions(eager_groups, 1)
    grads = []
    for scope in (None, "whole"):
        torch.manual_seed(0)
        train = SD3TrainingAdapter.from_pretrained(tiny_sd3_path, device=test_device, lora=LORA)
        if scope:
            train.compile(CompileConfig(backend="aot_eager", regional=regional_scope(scope)))
        out = train.transition(batch, sde_type="sde")
        out.log_prob.sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in train.trainable_parameters()]).cpu())
        with torch.no_grad(), train.reference():
            assert torch.isfinite(train.transition(batch, sde_type="sde").prev_sample_mean).all()
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-4)


def test_compile_scopes_by_name():
    assert regional_scope("blocks") is True and regional_scope("whole") is False
    with pytest.raises(ValueError, match="unknown compile scope 'layers'; known: blocks, whole"):
        regional_scope("layers")


def test_compile_cache_directory_and_artifacts(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR", ""))
    path = use_cache_dir(tmp_path / "cache")
    assert path.is_dir() and os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(path)
    assert not load_artifacts(tmp_path / "missing.bin")  # a cold start, not an error
    size = save_artifacts(tmp_path / "artifacts.bin")
    assert size == 0 or (tmp_path / "artifacts.bin").stat().st_size == size
    (tmp_path / "junk.bin").write_bytes(b"not a cache")
    assert not load_artifacts(tmp_path / "junk.bin")


def test_compiled_decoder_gives_eager_images_and_the_worker_compiles_it(
    tiny_sd3_path, test_device, make_welcome, monkeypatch, caplog
):
    """``compile_decoder`` compiles the VAE decoder whole (one graph a decode batch size); the
    images are eager's; the worker's ``compile_decoder`` reaches it through the warm-up."""
    from omnirl.rollout.model import RolloutModel

    eager = SD3RolloutAdapter.from_pretrained(
        tiny_sd3_path, device=test_device, max_sequence_length=16
    )
    latents = torch.randn(2, 16, 4, 4, generator=torch.Generator().manual_seed(0)).to(test_device)
    counter = CountingBackend()
    adapter = SD3RolloutAdapter.from_pretrained(
        tiny_sd3_path, device=test_device, max_sequence_length=16
    )
    adapter.compile_decoder(CompileConfig(backend=counter))
    assert is_compiled(adapter.pipeline.vae.decoder) and counter.graphs == 0
    images = adapter._decode(latents)
    assert counter.graphs == 1 and images.dtype == torch.uint8
    assert (images.int() - eager._decode(latents).int()).abs().max() <= 1
    adapter._decode(latents)
    assert counter.graphs == 1  # same batch size: no new graph
    assert not is_compiled(adapter.transformer)  # the denoiser is the adapter's compile()
    graphed = SD3RolloutAdapter.from_pretrained(
        tiny_sd3_path, device=test_device, max_sequence_length=16
    )
    calls = []
    monkeypatch.setattr(
        "omnirl.models.sd3.encoder.compile_module",
        lambda module, config: calls.append(config.mode) or [],
    )
    graphed.compile_decoder(CompileConfig(mode="reduce-overhead"))
    graphed.compile_decoder(CompileConfig(mode="max-autotune-no-cudagraphs"))
    assert calls == [None, "max-autotune-no-cudagraphs"]  # never CUDA graphs for the decoder
    monkeypatch.undo()

    welcome = make_welcome(
        tiny_sd3_path,
        "StableDiffusion3Pipeline",
        {"sampling": {"num_steps": 2, "height": 32, "width": 32}},
    )
    worker_adapter = SD3RolloutAdapter.from_pretrained(
        tiny_sd3_path, device=test_device, max_sequence_length=16
    )
    model = RolloutModel(worker_adapter, format="full")
    with caplog.at_level("INFO", logger="omnirl.rollout"):
        model.compile_and_warm_up(welcome, backend="aot_eager", decoder=True)
    assert is_compiled(worker_adapter.pipeline.vae.decoder)
    assert "the image decoder is compiled too" in caplog.text
    plain = SD3RolloutAdapter.from_pretrained(
        tiny_sd3_path, device=test_device, max_sequence_length=16
    )
    RolloutModel(plain, format="full").compile_and_warm_up(welcome, backend="aot_eager")
    assert not is_compiled(plain.pipeline.vae.decoder)


def test_a_family_without_a_decoder_says_so():
    from omnirl.models.base import DiffusionRolloutAdapter

    class NoDecoder(DiffusionRolloutAdapter):
        from_pretrained = sample = load_weights = None

    with pytest.raises(NotImplementedError, match="NoDecoder has no compiled decoder"):
        NoDecoder.compile_decoder(object.__new__(NoDecoder), CompileConfig())
