"""SD3 rollout adapter: what a trajectory group records, and per-sample seeding."""

from __future__ import annotations

import pytest
import torch

from omnirl.models.base import sample_seeds
from omnirl.models.sd3 import SD3RolloutAdapter
from omnirl.models.sd3.sampling_rules import SamplingError
from omnirl.protocol.messages import PromptSpec, SamplingParams

STEPS = 5
pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def rollout(tiny_sd3_path):
    return SD3RolloutAdapter.from_pretrained(tiny_sd3_path, max_sequence_length=16)


def params(**kw) -> SamplingParams:
    base = dict(group_size=3, num_steps=STEPS, height=32, width=32, sde_window=(1, 4), seed=7)
    base.update(kw)
    return SamplingParams(**base)


def prompts(*names: str) -> list[PromptSpec]:
    return [PromptSpec(group_id=n, text=f"a photo of {n}") for n in names]


def sample(rollout, ps, sp):
    return rollout.sample(ps, sp, lease_id="lease-1", worker_id="w0", policy_version=3)


def test_group_records_window_steps_with_fp32_tensors(rollout):
    groups = sample(rollout, prompts("cat", "dog"), params())
    assert [g.group_id for g in groups] == ["cat", "dog"]
    g = groups[0]
    assert g.architecture == "StableDiffusion3Pipeline" and g.policy_version == 3
    assert g.lease_id == "lease-1" and g.worker_id == "w0"
    assert g.step_indices.tolist() == [1, 2, 3]
    assert g.latents.shape == (3, 3, 16, 16, 16) and g.next_latents.shape == g.latents.shape
    for name in ("latents", "next_latents", "log_probs", "timesteps", "sigmas", "next_sigmas"):
        assert getattr(g, name).dtype == torch.float32, name
    assert g.log_probs.shape == (3, 3) and torch.isfinite(g.log_probs).all()
    assert g.noise_levels.tolist() == pytest.approx([0.7] * 3)
    # consecutive window steps chain, the schedule is SD3's shifted one
    assert torch.equal(g.next_latents[:, 0], g.latents[:, 1])
    sched = rollout.scheduler
    assert torch.allclose(g.sigmas, sched.sigmas[1:4]) and torch.allclose(
        g.next_sigmas, sched.sigmas[2:5]
    )
    assert torch.allclose(g.timesteps, g.sigmas * 1000)
    assert g.final_latents.shape == (3, 16, 16, 16) and g.final_latents.dtype == torch.float32
    assert g.images.shape == (3, 32, 32, 3) and g.images.dtype == torch.uint8
    # conditioning once per group, negatives for CFG
    assert g.prompt_embeds.shape == (32, 32) and g.pooled_prompt_embeds.shape == (32,)
    assert g.negative_prompt_embeds.shape == (32, 32)
    assert g.negative_pooled_prompt_embeds.shape == (32,)
    assert not torch.equal(groups[0].prompt_embeds, groups[1].prompt_embeds)
    assert g.seeds.tolist() == sample_seeds(7, "cat", 3).tolist()
    phases = ("encode_s", "denoise_s", "decode_s", "pack_s")
    assert set(g.timings) == {*phases, "total_s"} and all(g.timings[p] >= 0 for p in phases)
    assert sum(g.timings[p] for p in phases) == pytest.approx(g.timings["total_s"])
    # each group owns its tensors: none is a view of the lease's batch
    for name in ("latents", "log_probs", "final_latents", "prompt_embeds", "images"):
        a, b = getattr(groups[0], name), getattr(groups[1], name)
        assert a.is_contiguous() and a.untyped_storage().data_ptr() != (
            b.untyped_storage().data_ptr()
        ), name


def test_no_cfg_ode_and_latent_free_variants(rollout):
    (g,) = sample(rollout, prompts("cat"), params(guidance_scale=1.0, record_images=False))
    assert g.negative_prompt_embeds is None and g.negative_pooled_prompt_embeds is None
    assert g.images is None and g.latents.shape[1] == 3
    (g,) = sample(rollout, prompts("cat"), params(sde_type="ode", group_size=2))
    assert g.latents is None and g.log_probs is None and g.final_latents.shape[0] == 2
    (g,) = sample(rollout, prompts("cat"), params(record_latents=False, sde_window=None))
    assert g.latents is None and g.step_indices is None and g.images is not None


def test_sample_depends_only_on_its_seed(rollout):
    together = sample(rollout, prompts("cat", "dog"), params())
    swapped = sample(rollout, prompts("dog", "cat"), params())
    alone = sample(rollout, prompts("cat"), params())
    again = sample(rollout, prompts("cat", "dog"), params())
    cat = together[0]
    # same call twice: bit-identical (a reissued lease reproduces its groups)
    assert torch.equal(cat.final_latents, again[0].final_latents)
    for other in (swapped[1], alone[0]):
        assert other.group_id == "cat"
        # other batch neighbours: equal up to the model's batch-composition effects
        torch.testing.assert_close(other.latents, cat.latents, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(other.log_probs, cat.log_probs, atol=1e-5, rtol=1e-5)
    # another seed or group id gives another trajectory
    other_seed = sample(rollout, prompts("cat"), params(seed=8))[0]
    assert not torch.allclose(other_seed.final_latents, cat.final_latents, atol=1e-3)
    samples = cat.final_latents
    assert not torch.allclose(samples[0], samples[1], atol=1e-3)


def test_same_initial_noise_shares_x_t_per_group(rollout):
    (g,) = sample(rollout, prompts("cat"), params(same_initial_noise=True, sde_window=(0, 2)))
    assert torch.equal(g.latents[0, 0], g.latents[1, 0]) and torch.equal(
        g.latents[0, 0], g.latents[2, 0]
    )
    assert not torch.allclose(g.next_latents[0, 0], g.next_latents[1, 0])  # step noise differs


def test_bad_sampling_params_raise_clear_errors(rollout):
    with pytest.raises(SamplingError, match="multiples of 4"):
        sample(rollout, prompts("cat"), params(height=30))
    with pytest.raises(SamplingError, match="sde_type"):
        sample(rollout, prompts("cat"), params(sde_type="ddim"))
    with pytest.raises(ValueError, match="duplicate group_id") as raised:
        sample(rollout, prompts("cat", "cat"), params())
    assert not isinstance(raised.value, SamplingError)  # a lease's content: issued again
    assert sample(rollout, [], params()) == []


def test_the_training_adapter_checks_the_rollouts_rules_before_any_lease(rollout, tiny_sd3_path):
    """What the trainer checks at start refuses exactly what the rollout refuses, with the
    same words; the size rule comes from the folder's VAE config (the trainer loads no VAE)."""
    from omnirl.models.sd3 import SD3TrainingAdapter
    from omnirl.models.sd3.sampling_rules import folder_vae_scale_factor

    train = SD3TrainingAdapter.from_pretrained(tiny_sd3_path)
    assert folder_vae_scale_factor(tiny_sd3_path) == rollout.pipeline.vae_scale_factor
    for bad in (dict(height=30), dict(width=34), dict(height=0), dict(sde_type="ddim")):
        with pytest.raises(SamplingError) as at_start:
            train.check_sampling(params(**bad))
        with pytest.raises(SamplingError) as at_lease:
            sample(rollout, prompts("cat"), params(**bad))
        assert str(at_start.value) == str(at_lease.value)
    train.check_sampling(params())  # what the rollout samples passes
    train.path = None  # a transformer built without a folder: no VAE factor to check against
    train.check_sampling(params(height=30))


def test_shared_initial_noise_runs_one_row_per_group_until_the_first_stochastic_step(rollout):
    rows: list[int] = []
    hook = rollout.transformer.register_forward_pre_hook(
        lambda _m, _a, kw: rows.append(int(kw["hidden_states"].shape[0])), with_kwargs=True
    )
    try:
        (g,) = sample(rollout, prompts("cat"), params(same_initial_noise=True))
        (h,) = sample(rollout, prompts("cat"), params(same_initial_noise=False))
    finally:
        hook.remove()
    # window (1, 4): ODE step 0 and stochastic step 1 on one row (x2 for CFG), then 3 rows
    assert rows == [2, 2, 6, 6, 6] + [6] * STEPS
    assert torch.equal(g.latents[0, 0], g.latents[2, 0])
    assert not torch.allclose(g.next_latents[0, 0], g.next_latents[1, 0])
    assert not torch.equal(h.latents[0, 0], h.latents[1, 0])


def _decode_calls(rollout) -> list[int]:
    """Record the batch of each VAE decode call from here on."""
    calls: list[int] = []
    decode = rollout.pipeline.vae.decode

    def counted(z, *args, **kwargs):
        calls.append(int(z.shape[0]))
        return decode(z, *args, **kwargs)

    rollout.pipeline.vae.decode = counted
    return calls


def test_decode_batch_splits_the_vae_calls_and_gives_the_same_images(tiny_sd3_path):
    rollout = SD3RolloutAdapter.from_pretrained(tiny_sd3_path, max_sequence_length=16)
    calls = _decode_calls(rollout)
    whole = sample(rollout, prompts("cat", "dog"), params())
    assert calls == [6]
    rollout.set_decode_batch(4)
    calls.clear()
    split = sample(rollout, prompts("cat", "dog"), params())
    assert calls == [4, 2]
    for a, b in zip(whole, split, strict=True):
        # the same images, to a unit of uint8 rounding (the convolutions' batch may differ)
        assert (a.images.int() - b.images.int()).abs().max() <= 1
        assert torch.equal(a.final_latents, b.final_latents)
    with pytest.raises(ValueError, match="decode batch"):
        rollout.set_decode_batch(-1)


def test_the_worker_builds_its_model_with_the_decode_batch(tiny_sd3_path, make_welcome, capsys):
    from omnirl.rollout.cli import main
    from omnirl.rollout.model import RolloutModel
    from omnirl.rollout.weights_inbox import ReadyUpdate

    first = ReadyUpdate(
        version=1, format="full", tensors={}, adapter_config=None, update_checksum=""
    )
    welcome = make_welcome(tiny_sd3_path, "StableDiffusion3Pipeline")
    built = RolloutModel.build(welcome, first, device="cpu", dtype="float32", decode_batch=2)
    assert built.adapter.decode_batch == 2
    assert main(["--trainer", "tcp://127.0.0.1:1", "--decode-batch", "-1"]) == 2
    assert "--decode-batch must be >= 0" in capsys.readouterr().err
