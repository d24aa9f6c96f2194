"""Offline Diffusion-DPO: ``trainer --preferences FILE`` trains a tiny ShapesT2I model from a
preference file with no workers (epochs, the dropped last batch, resume from the file
position, refusals), and training on pairs moves the policy the right way: the chosen
image's flow-matching error falls relative to the rejected one's, against the reference."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from omnirl.models.clean_batch import collate_clean_samples
from omnirl.models.registry import get_training_adapter
from omnirl.tools.eval_shapes import load_prompt_file
from omnirl.tools.shapes_preferences import rendered_pair, write_preferences
from omnirl.trainer.cli import main
from omnirl.trainer.forward_step import ForwardProcessStep
from omnirl.trainer.preferences import (
    PreferenceSource,
    offline_sampling,
    preference_groups,
    read_preference_file,
)
from omnirl.trainer.step import TrainStep

pytestmark = pytest.mark.usefixtures("torch_one_thread")
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "shapes_flow_grpo_lora.yaml"
PROMPTS = ROOT / "examples" / "prompts" / "shapes_train.jsonl"
ARCH = "ShapesT2IPipeline"


def _preference_file(folder: Path, n: int) -> Path:
    specs = load_prompt_file(PROMPTS)[:n]
    rng = np.random.default_rng(0)
    pairs = [rendered_pair(s, size=32, seed=i, rng=rng) for i, s in enumerate(specs)]
    return write_preferences(folder, specs, pairs, {"source": "test"})


@pytest.fixture(scope="module")
def prefs(tmp_path_factory):
    return {n: _preference_file(tmp_path_factory.mktemp(f"prefs{n}"), n) for n in (3, 4)}


def _run(model, prefs_file, out, *extra, max_steps=10, overrides=()):
    items = {
        "model.path": model,
        "model.lora.r": 4,
        "model.lora.alpha": 4,
        "run.output_dir": out,
        "algorithm.name": "diffusion_dpo",
        "sampling.same_initial_noise": "null",  # the example's true is refused for ODE sampling
        "train.groups_per_step": 2,
        "sampling.num_steps": 3,
        "runtime.control_port": 0,
        "runtime.shutdown_grace_s": 0,
        "logging.progress_bar": "false",
        "logging.tensorboard": "false",
        "logging.image_grid_every": 0,
        "checkpoint.every": 0,
        "max_steps": max_steps,
    }
    argv = ["--config", str(EXAMPLE), *(f"{k}={v}" for k, v in items.items()), *overrides]
    return main([*argv, "--preferences", str(prefs_file), *extra])


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_epochs_of_the_file_then_stop_dropping_the_short_last_batch(
    tiny_shapes_path, prefs, tmp_path
):
    # 3 pairs x 2 epochs = 6 pairs = 3 steps of 2; with 1 epoch: 1 step, 1 pair left over
    assert _run(tiny_shapes_path, prefs[3], tmp_path / "a", "--epochs", "2") == 0
    rows = _rows(tmp_path / "a")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["staleness_max"] == 0.0 and r["reward_mean"] == 0.5
        assert r["num_samples"] == 4.0 and r["skipped_groups"] == 0.0
        assert np.isfinite(r["loss"]) and r["grad_norm"] > 0
    assert rows[-1]["ledger/groups_trained"] == 6.0
    assert _run(tiny_shapes_path, prefs[3], tmp_path / "b") == 0
    assert [r["step"] for r in _rows(tmp_path / "b")] == [1]
    assert (tmp_path / "b" / "checkpoints" / "step_00000001").is_dir()


def test_resume_continues_at_the_next_pair(tiny_shapes_path, prefs, tmp_path):
    out = tmp_path / "run"
    assert _run(tiny_shapes_path, prefs[4], out, max_steps=1) == 0
    # 4 pairs, 2 a step: the resumed run has exactly one step left in the file (from the start
    # it would train two)
    assert _run(tiny_shapes_path, prefs[4], out, "--resume") == 0
    steps = [r["step"] for r in _rows(out)]
    assert steps[-1] == 2 and 3 not in steps
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*"))[-1] == "step_00000002"


def test_refusals(tiny_shapes_path, prefs, tmp_path, capsys):
    # a model folder that is not there: a one-line error that names the directory a
    # relative path was read from, not a traceback
    assert _run(tmp_path / "no_model", prefs[3], tmp_path / "m") == 2
    err = capsys.readouterr().err
    assert "no_model" in err and f"working directory, {os.getcwd()}" in err
    assert "Traceback" not in err
    assert (
        _run(tiny_shapes_path, prefs[3], tmp_path / "x", overrides=["algorithm.name=flow_grpo"])
        == 2
    )
    assert _run(tiny_shapes_path, prefs[3], tmp_path / "y", "--epochs", "0") == 2
    with pytest.raises(SystemExit) as exc:
        _run(tiny_shapes_path, prefs[3], tmp_path / "z", "--replay", str(tmp_path))
    assert exc.value.code == 2


def _margin(adapter, batch, levels, noise):
    """mean over pairs and levels of (e_w - e_ref_w) - (e_l - e_ref_l); row 2i chosen, 2i+1
    rejected; one shared noise and level per pair."""
    x0 = batch.latents
    out = []
    with torch.no_grad():
        for t, eps in zip(levels, noise, strict=True):
            eps2 = eps.repeat_interleave(2, dim=0)
            x_t = (1 - t) * x0 + t * eps2
            ts = torch.full((x0.shape[0],), 1000.0 * t)
            err = {}
            for name in ("policy", "reference"):
                if name == "reference":
                    with adapter.reference():
                        v = adapter.velocity(x_t, ts, batch)
                else:
                    v = adapter.velocity(x_t, ts, batch)
                err[name] = ((v - (eps2 - x0)) ** 2).mean(dim=(1, 2, 3))
            d = err["policy"] - err["reference"]
            out.append((d[0::2] - d[1::2]).mean())
    return float(torch.stack(out).mean())


def test_training_on_pairs_prefers_the_chosen_images(tiny_shapes_path, prefs):
    adapter = get_training_adapter(ARCH, "diffusion_dpo").from_pretrained(
        tiny_shapes_path, lora={"r": 4, "lora_alpha": 4}
    )
    from omegaconf import OmegaConf

    source = PreferenceSource(read_preference_file(prefs[4]), shuffle=False)
    sampling_cfg = OmegaConf.create({"num_steps": 10, "guidance_scale": 1.0, "height": 32,
                                     "width": 32, "negative_prompt": ""})  # fmt: skip
    groups = preference_groups(
        [source.next()[:2] for _ in range(4)],
        adapter.sample_encoder(),
        offline_sampling(sampling_cfg, seed=0),
        policy_version=0,
    )
    batch = collate_clean_samples(groups)
    gen = torch.Generator().manual_seed(1)
    levels = [0.2, 0.5, 0.8]
    noise = [torch.randn((4, 3, 32, 32), generator=gen) for _ in levels]
    assert _margin(adapter, batch, levels, noise) == 0.0  # LoRA B = 0: policy == reference
    step = TrainStep(adapter, "diffusion_dpo", TrainStep.Config(lr=3e-3, dpo_beta=500.0))
    assert isinstance(step, ForwardProcessStep)
    for _ in range(6):
        m = step.step(groups, policy_version=0)
    assert m["skipped_groups"] == 0.0 and m["num_samples"] == 8.0
    assert _margin(adapter, batch, levels, noise) < 0.0


def test_pairs_train_a_latent_model_in_its_latent_space(tiny_shapes_latent_path, prefs):
    """On a latent ShapesT2I model (preset ``tiny_latent``) the pairs' images become its
    4x8x8 VAE latents, and a Diffusion-DPO step trains on them (noise levels from the latent
    schedule) and moves the LoRA weights."""
    from omegaconf import OmegaConf

    adapter = get_training_adapter(ARCH, "diffusion_dpo").from_pretrained(
        tiny_shapes_latent_path, lora={"r": 4, "lora_alpha": 4}
    )
    source = PreferenceSource(read_preference_file(prefs[4]), shuffle=False)
    sampling_cfg = OmegaConf.create({"num_steps": 4, "guidance_scale": 1.0, "height": 32,
                                     "width": 32, "negative_prompt": ""})  # fmt: skip
    groups = preference_groups(
        [source.next()[:2] for _ in range(2)],
        adapter.sample_encoder(),
        offline_sampling(sampling_cfg, seed=0),
        policy_version=0,
    )
    assert [tuple(g.final_latents.shape) for g in groups] == [(2, 4, 8, 8)] * 2
    assert all(g.images.shape == (2, 32, 32, 3) for g in groups)
    before = {k: v.clone() for k, v in adapter.export_weights().items()}
    step = TrainStep(adapter, "diffusion_dpo", TrainStep.Config(lr=1e-3))
    m = step.step(groups, policy_version=0)
    assert m["skipped_groups"] == 0.0 and m["num_samples"] == 4.0
    after = adapter.export_weights()
    assert any(not torch.equal(before[k], after[k]) for k in before)
