"""FlowMatchSDEScheduler: schedule, steps, log-probs, per-sample noise, window.

The expected values are computed here from the formulas in docs/algorithms.md, written
independently of the scheduler's code, and log-probs are checked against
``torch.distributions.Normal``.
"""

import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from omnirl.models.schedulers import (
    FlowMatchSDEScheduler,
    SchedulerInputError,
    SDEStepOutput,
    initial_noise,
    noise_levels,
    per_sample_noise,
    random_window,
    window_mask,
)

SD3_SCHEDULER_CONFIG = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "_diffusers_version": "0.29.0.dev0",
    "num_train_timesteps": 1000,
    "shift": 3.0,
}
STOCHASTIC = ("sde", "cps", "dance_sde")
LATENT = (4, 6, 6)


def make_scheduler(num_steps: int = 10, shift: float = 3.0) -> FlowMatchSDEScheduler:
    sched = FlowMatchSDEScheduler.from_config({**SD3_SCHEDULER_CONFIG, "shift": shift})
    sched.set_timesteps(num_steps)
    return sched


def random_batch(sched: FlowMatchSDEScheduler, batch: int = 6, seed: int = 0):
    """Random latents / velocities at random steps of the schedule (step 0, sigma = 1, included)."""
    gen = torch.Generator().manual_seed(seed)
    num_steps = len(sched.sigmas) - 1
    steps = torch.randint(0, num_steps, (batch,), generator=gen)
    steps[0] = 0
    x = torch.randn((batch, *LATENT), generator=gen)
    v = torch.randn((batch, *LATENT), generator=gen)
    a = 0.2 + 0.8 * torch.rand(batch, generator=gen)
    return steps, x, v, sched.sigmas[steps], sched.sigmas[steps + 1], a


def expected_gaussian(sde_type, x, v, sigma, sigma_next, a, sigma_max):
    """(mean, step std) of the step written from the papers' formulas, float64."""
    x, v = x.double(), v.double()
    view = (-1,) + (1,) * (x.ndim - 1)
    s, sn, a = sigma.double().view(view), sigma_next.double().view(view), a.double().view(view)
    dt = sn - s
    if sde_type == "sde":
        s_den = torch.where(s == 1, torch.full_like(s, sigma_max), s)
        g = a * torch.sqrt(s / (1 - s_den))
        score = -(x + (1 - s) * v) / s  # score of the linear path given the velocity
        mean = x + (v - 0.5 * g**2 * score) * dt
        return mean, (g * torch.sqrt(-dt)).flatten()
    if sde_type == "dance_sde":
        score = -(x + (1 - s) * v) / s
        mean = x + (v - 0.5 * a**2 * score) * dt
        return mean, (a * torch.sqrt(-dt)).flatten()
    if sde_type == "cps":
        std = sn * torch.sin(a * math.pi / 2)
        x0, x1 = x - s * v, x + (1 - s) * v
        return x0 * (1 - sn) + x1 * torch.sqrt(sn**2 - std**2), std.flatten()
    raise AssertionError(sde_type)


# ------------------------------------------------------------------------------- schedule


def test_schedule_matches_diffusers():
    sched = make_scheduler(10)
    ref = FlowMatchEulerDiscreteScheduler.from_config(SD3_SCHEDULER_CONFIG)
    ref.set_timesteps(10)
    assert isinstance(sched, FlowMatchEulerDiscreteScheduler)
    assert sched.sigmas.dtype == torch.float32 and sched.sigmas.shape == (11,)
    assert torch.equal(sched.sigmas, ref.sigmas)
    assert torch.equal(sched.timesteps, ref.timesteps)
    assert sched.sigmas[0] == 1.0 and sched.sigmas[-1] == 0.0
    # the shift is applied twice at the low end (CONVENTIONS.md): ~0.0089, not ~0.003
    assert sched.sigmas[-2].item() == pytest.approx(0.00893, abs=5e-5)
    assert sched.default_sde_sigma_max == sched.sigmas[1].item()


def test_ode_step_equals_diffusers_step():
    sched = make_scheduler(10)
    ref = FlowMatchEulerDiscreteScheduler.from_config(SD3_SCHEDULER_CONFIG)
    ref.set_timesteps(10)
    gen = torch.Generator().manual_seed(1)
    x_ref = x = torch.randn((3, *LATENT), generator=gen)
    for i, t in enumerate(ref.timesteps):
        v = torch.randn((3, *LATENT), generator=gen)
        x_ref = ref.step(v, t, x_ref).prev_sample
        out = sched.sde_step(v, x, sched.sigmas[i], sched.sigmas[i + 1], sde_type="ode")
        x = out.prev_sample
        assert torch.equal(x, x_ref), f"step {i}"
        assert torch.equal(out.log_prob, torch.zeros(3))


# ------------------------------------------------------------------------------ log-probs


@pytest.mark.parametrize("sde_type", ["sde", "dance_sde"])
def test_log_prob_equals_direct_gaussian_density(sde_type):
    sched = make_scheduler(10)
    for seed in range(3):
        _, x, v, s, sn, a = random_batch(sched, seed=seed)
        prev = torch.randn(x.shape, generator=torch.Generator().manual_seed(100 + seed))
        out = sched.sde_step(v, x, s, sn, sde_type=sde_type, noise_level=a, prev_sample=prev)
        mean, std = expected_gaussian(sde_type, x, v, s, sn, a, sched.sigmas[1].item())
        std_b = std.view(-1, 1, 1, 1).expand_as(mean)
        direct = torch.distributions.Normal(mean, std_b).log_prob(prev.double()).mean(dim=(1, 2, 3))
        torch.testing.assert_close(out.log_prob.double(), direct, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.prev_sample_mean.double(), mean, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.step_std.double(), std, rtol=1e-5, atol=1e-7)
        assert torch.equal(out.prev_sample, prev)


def test_sde_std_dev_t_excludes_sqrt_dt_and_first_step_std_is_noise_level():
    sched = make_scheduler(10)
    x = torch.randn(2, *LATENT)
    v = torch.randn(2, *LATENT)
    s, sn = sched.sigmas[0], sched.sigmas[1]
    out = sched.sde_step(v, x, s, sn, sde_type="sde", noise_level=0.7)
    # sigma = 1 takes sigma_max = sigmas[1] in the denominator: the step's std is exactly a
    torch.testing.assert_close(out.step_std, torch.full((2,), 0.7), rtol=1e-6, atol=0)
    torch.testing.assert_close(out.std_dev_t, out.step_std / torch.sqrt(s - sn))
    custom = sched.sde_step(v, x, s, sn, sde_type="sde", noise_level=0.7, sigma_max=0.5)
    torch.testing.assert_close(custom.std_dev_t, torch.full((2,), 0.7 * math.sqrt(2.0)))
    # at sigma < 1: std_dev_t = a * sqrt(sigma / (1 - sigma))
    s3, sn3 = sched.sigmas[3], sched.sigmas[4]
    mid = sched.sde_step(v, x, s3, sn3, sde_type="sde", noise_level=0.7)
    expect = 0.7 * math.sqrt(s3.item() / (1 - s3.item()))
    torch.testing.assert_close(mid.std_dev_t, torch.full((2,), expect))


def test_cps_log_prob_is_its_surrogate():
    sched = make_scheduler(10)
    _, x, v, s, sn, a = random_batch(sched, seed=3)
    prev = torch.randn(x.shape, generator=torch.Generator().manual_seed(7))
    out = sched.sde_step(v, x, s, sn, sde_type="cps", noise_level=a, prev_sample=prev)
    mean, std = expected_gaussian("cps", x, v, s, sn, a, 0.0)
    surrogate = -((prev.double() - mean) ** 2).mean(dim=(1, 2, 3))
    det = std == 0  # the terminal step (sigma_next = 0) is deterministic: log-prob 0
    torch.testing.assert_close(out.log_prob.double()[~det], surrogate[~det], rtol=1e-5, atol=1e-6)
    assert torch.equal(out.log_prob[det], torch.zeros(int(det.sum())))
    torch.testing.assert_close(out.std_dev_t.double(), std, rtol=1e-6, atol=1e-7)
    assert torch.equal(out.std_dev_t, out.step_std)


@pytest.mark.parametrize("sde_type", STOCHASTIC)
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_recomputed_log_prob_reproduces_sampled_one(sde_type, model_dtype):
    sched = make_scheduler(10)
    steps, x, v, s, sn, a = random_batch(sched, batch=7, seed=4)
    v = v.to(model_dtype)
    seeds = torch.arange(100, 107)
    noise = torch.cat([per_sample_noise(seeds[i : i + 1], int(steps[i]), LATENT) for i in range(7)])
    old = sched.sde_step(v, x, s, sn, sde_type=sde_type, noise_level=a, noise=noise)
    new = sched.sde_step(v, x, s, sn, sde_type=sde_type, noise_level=a, prev_sample=old.prev_sample)
    assert (old.log_prob - new.log_prob).abs().max().item() <= 1e-6
    ratio = torch.exp(new.log_prob - old.log_prob)
    assert (ratio - 1).abs().max().item() <= 1e-5
    assert torch.equal(new.prev_sample, old.prev_sample)
    assert torch.equal(old.prev_sample_mean, new.prev_sample_mean)


@pytest.mark.parametrize("sde_type", [*STOCHASTIC, "ode"])
def test_step_is_bitwise_the_same_for_shared_and_per_sample_arguments(sde_type):
    """A mixed batch ([B] sigmas and noise levels: float64 tensor coefficients) and each sample
    alone (Python floats: host coefficients) give bitwise the same step."""
    sched = make_scheduler(10)
    _, x, v, s, sn, a = random_batch(sched, batch=6, seed=11)
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(12))
    kw = {"sde_type": sde_type, "noise_level": a}
    batch = sched.sde_step(v, x, s, sn, noise=noise, **kw)
    for i in range(6):
        one = sched.sde_step(
            v[i : i + 1], x[i : i + 1], float(s[i]), float(sn[i]), sde_type=sde_type,
            noise_level=float(a[i]), noise=noise[i : i + 1],
        )  # fmt: skip
        for name in ("prev_sample", "log_prob", "prev_sample_mean", "std_dev_t", "step_std"):
            assert torch.equal(getattr(one, name)[0], getattr(batch, name)[i]), (name, i)
    # a float noise level and the same value as a float32 tensor are the same input
    as_float = sched.sde_step(v, x, s[0], sn[0], noise=noise, sde_type=sde_type, noise_level=0.7)
    as_tensor = sched.sde_step(
        v, x, s[0], sn[0], noise=noise, sde_type=sde_type, noise_level=torch.tensor([0.7] * 6)
    )
    assert torch.equal(as_float.log_prob, as_tensor.log_prob)
    assert torch.equal(as_float.prev_sample, as_tensor.prev_sample)


def test_log_prob_gradient_flows_to_model_output_only_through_the_mean():
    sched = make_scheduler(10)
    _, x, v, s, sn, _ = random_batch(sched, seed=5)
    a = torch.tensor([0.7, 0.0, 0.7, 0.0, 0.7, 0.7])  # noise level 0 rows: deterministic
    for sde_type in STOCHASTIC:
        prev = sched.sde_step(v, x, s, sn, sde_type=sde_type, noise_level=a).prev_sample
        v_leaf = v.clone().requires_grad_(True)
        out = sched.sde_step(v_leaf, x, s, sn, sde_type=sde_type, noise_level=a, prev_sample=prev)
        out.log_prob.sum().backward()
        assert torch.isfinite(v_leaf.grad).all()
        assert v_leaf.grad[out.step_std > 0].abs().sum() > 0
        assert torch.equal(out.log_prob[a == 0], torch.zeros(2))


@pytest.mark.parametrize("sde_type", STOCHASTIC)
def test_noise_level_zero_is_the_ode_step(sde_type):
    sched = make_scheduler(10)
    _, x, v, s, sn, _ = random_batch(sched, seed=6)
    ode = sched.sde_step(v, x, s, sn, sde_type="ode")
    out = sched.sde_step(v, x, s, sn, sde_type=sde_type, noise_level=0.0)
    torch.testing.assert_close(out.prev_sample, ode.prev_sample, rtol=1e-6, atol=1e-6)
    assert torch.equal(out.log_prob, torch.zeros(6))
    assert torch.equal(out.step_std, torch.zeros(6))


# ------------------------------------------------------------------------------ float32


@pytest.mark.parametrize("sde_type", [*STOCHASTIC, "ode"])
def test_outputs_are_float32_for_bf16_model_output(sde_type):
    sched = make_scheduler(10)
    _, x, v, s, sn, a = random_batch(sched, seed=8)
    out = sched.sde_step(v.bfloat16(), x, s, sn, sde_type=sde_type, noise_level=a)
    assert isinstance(out, SDEStepOutput)
    for name in ("prev_sample", "log_prob", "prev_sample_mean", "std_dev_t", "step_std"):
        assert getattr(out, name).dtype == torch.float32, name
    assert out.log_prob.shape == out.std_dev_t.shape == out.step_std.shape == (6,)


def test_low_precision_latents_are_refused():
    sched = make_scheduler(10)
    _, x, v, s, sn, _ = random_batch(sched, seed=9)
    kw = {"sde_type": "sde", "noise_level": 0.7}
    with pytest.raises(SchedulerInputError, match="sample must be float32"):
        sched.sde_step(v, x.bfloat16(), s, sn, **kw)
    with pytest.raises(SchedulerInputError, match="prev_sample must be float32"):
        sched.sde_step(v, x, s, sn, prev_sample=x.bfloat16(), **kw)
    with pytest.raises(SchedulerInputError, match="noise must be float32"):
        sched.sde_step(v, x, s, sn, noise=x.half(), **kw)


def test_bad_arguments_raise_typed_errors():
    sched = make_scheduler(10)
    _, x, v, s, sn, _ = random_batch(sched, seed=10)
    with pytest.raises(SchedulerInputError, match="known: sde, cps, dance_sde, ode"):
        sched.sde_step(v, x, s, sn, sde_type="ddim", noise_level=0.7)
    with pytest.raises(SchedulerInputError, match="noise_level is required"):
        sched.sde_step(v, x, s, sn, sde_type="sde")
    with pytest.raises(SchedulerInputError, match="sigma_next <= sigma"):
        sched.sde_step(v, x, sn, s, sde_type="sde", noise_level=0.7)
    with pytest.raises(SchedulerInputError, match="model_output must be a tensor of shape"):
        sched.sde_step(v[:, :2], x, s, sn, sde_type="sde", noise_level=0.7)
    with pytest.raises(SchedulerInputError, match="noise_level must be >= 0"):
        sched.sde_step(v, x, s, sn, sde_type="cps", noise_level=-0.1)
    with pytest.raises(SchedulerInputError, match=r"\[B\] tensor with B=6"):
        sched.sde_step(v, x, s[:2], sn, sde_type="sde", noise_level=0.7)
    with pytest.raises(SchedulerInputError, match="sigma_max must be in"):
        sched.sde_step(v, x, s, sn, sde_type="sde", noise_level=0.7, sigma_max=1.0)
    fresh = FlowMatchSDEScheduler.from_config(SD3_SCHEDULER_CONFIG)  # no set_timesteps
    with pytest.raises(SchedulerInputError, match="needs sigma_max"):
        fresh.sde_step(v, x, 1.0, 0.9, sde_type="sde", noise_level=0.7)
    assert fresh.sde_step(v, x, 1.0, 0.9, sde_type="sde", noise_level=0.7, sigma_max=0.9)


# -------------------------------------------------------------------------- seeding


def test_per_sample_noise_does_not_depend_on_the_batch():
    seeds = torch.tensor([3, 1, 4, 1_000_003, 5, 9, 2**40 + 7], dtype=torch.int64)
    batch = per_sample_noise(seeds, 2, LATENT)
    assert batch.shape == (7, *LATENT) and batch.dtype == torch.float32
    for i in range(7):
        alone = per_sample_noise(seeds[i : i + 1], 2, LATENT)
        assert torch.equal(alone[0], batch[i])
    perm = torch.randperm(7, generator=torch.Generator().manual_seed(0))
    assert torch.equal(per_sample_noise(seeds[perm], 2, LATENT), batch[perm])
    assert torch.equal(per_sample_noise(seeds.tolist(), 2, LATENT), batch)
    # another step, another seed, the initial noise: different streams
    assert not torch.equal(per_sample_noise(seeds, 3, LATENT), batch)
    assert not torch.equal(batch[0], per_sample_noise([4], 2, LATENT)[0])
    x_t = initial_noise(seeds, LATENT)
    assert not torch.equal(x_t, per_sample_noise(seeds, 0, LATENT))
    assert torch.equal(x_t, per_sample_noise(seeds, -1, LATENT))
    assert per_sample_noise(seeds, 2, LATENT, dtype=torch.bfloat16).dtype == torch.bfloat16
    # standard normal
    big = per_sample_noise(torch.arange(64), 0, (32, 32))
    assert abs(big.mean().item()) < 0.02 and abs(big.std().item() - 1) < 0.02


def test_per_sample_noise_rejects_bad_input():
    with pytest.raises(SchedulerInputError, match="integer"):
        per_sample_noise(torch.tensor([1.0]), 0, LATENT)
    with pytest.raises(SchedulerInputError, match="step_index"):
        per_sample_noise(torch.tensor([1]), -2, LATENT)


# --------------------------------------------------------------------------- window


def test_window_mask_and_noise_levels():
    sched = make_scheduler(10)
    mask = sched.window_mask(10, (2, 5))
    assert mask.dtype == torch.bool and mask.tolist() == [False] * 2 + [True] * 3 + [False] * 5
    assert window_mask(10, None).all()
    levels = noise_levels(10, 0.7, (2, 5))
    assert levels.dtype == torch.float32
    torch.testing.assert_close(levels, mask.float() * 0.7)
    assert torch.equal(sched.noise_levels(4, 0.5, None), torch.full((4,), 0.5))
    for bad in [(3, 3), (-1, 2), (8, 11), (5, 2)]:
        with pytest.raises(SchedulerInputError, match="window"):
            window_mask(10, bad)
    w = random_window(123, 10, 2, (0, 6))
    assert w == random_window(123, 10, 2, (0, 6)) and w[0] >= 0 and w[1] <= 6 and w[1] - w[0] == 2
    starts = {random_window(s, 10, 2, (0, 6))[0] for s in range(200)}
    assert starts == set(range(5))


def test_window_steps_are_stochastic_and_others_are_ode():
    """Sampling a trajectory with per-step noise levels from the window."""
    sched = make_scheduler(6)
    levels = noise_levels(6, 0.7, (1, 3))
    seeds = torch.tensor([11, 12])
    x = initial_noise(seeds, LATENT)
    v = torch.full_like(x, 0.3)
    for i in range(6):
        noise = per_sample_noise(seeds, i, LATENT)
        out = sched.sde_step(
            v, x, sched.sigmas[i], sched.sigmas[i + 1], sde_type="sde",
            noise_level=levels[i], noise=noise,
        )  # fmt: skip
        ode = sched.sde_step(v, x, sched.sigmas[i], sched.sigmas[i + 1], sde_type="ode")
        if levels[i] > 0:
            assert (out.log_prob != 0).all() and not torch.allclose(
                out.prev_sample, ode.prev_sample
            )
        else:
            assert torch.equal(out.log_prob, torch.zeros(2))
            torch.testing.assert_close(out.prev_sample, ode.prev_sample, rtol=1e-6, atol=1e-6)
        x = out.prev_sample


# ------------------------------------------------------------------ marginal sanity


def gaussian_velocity(x, sigma, m, s0):
    """Exact velocity E[eps - x0 | x_sigma = x] for data N(m, s0^2) and x = (1-s) x0 + s eps."""
    var = (1 - sigma) ** 2 * s0**2 + sigma**2
    centred = x - (1 - sigma) * m
    return (sigma - (1 - sigma) * s0**2) * centred / var - m


@pytest.mark.parametrize(
    ("sde_type", "noise_level"), [("ode", 0.0), ("sde", 0.7), ("dance_sde", 0.5)]
)
def test_sampling_with_the_exact_velocity_reaches_the_data_distribution(sde_type, noise_level):
    """The SDEs share the ODE's marginals: with the exact velocity of Gaussian data and small
    steps, all three end at N(m, s0^2) (Euler error is O(1/T): 0.36 at T=10, 0.495 at T=160)."""
    m, s0, num_steps = 0.5, 0.5, 100
    sched = make_scheduler(num_steps, shift=1.0)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((2048, 16), generator=gen)
    for i in range(num_steps):
        s, sn = sched.sigmas[i], sched.sigmas[i + 1]
        v = gaussian_velocity(x, s, m, s0)
        out = sched.sde_step(v, x, s, sn, sde_type=sde_type, noise_level=noise_level, generator=gen)
        x = out.prev_sample
    assert abs(x.mean().item() - m) < 0.015
    assert abs(x.std().item() - s0) < 0.015


@pytest.mark.parametrize("noise_level", [0.3, 0.7, 1.0])
def test_cps_preserves_the_coefficients_of_every_step(noise_level):
    """CPS's defining property: when the prediction of x0 is exact (data = one point m), every
    step lands exactly on x' = (1 - sigma') m + sigma' eps, whatever the step size. (With spread
    data CPS is not marginal-preserving: its noise is a fixed fraction of sigma' per step.)"""
    m = 0.5
    sched = make_scheduler(10)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn((2048, 16), generator=gen)
    for i in range(9):  # the last step (sigma' = 0) is deterministic and lands on m
        s, sn = sched.sigmas[i], sched.sigmas[i + 1]
        v = gaussian_velocity(x, s, m, 0.0)
        x = sched.sde_step(v, x, s, sn, sde_type="cps", noise_level=noise_level, generator=gen)
        x = x.prev_sample
        eps = (x - (1 - sn) * m) / sn
        assert abs(eps.mean().item()) < 0.02 and abs(eps.std().item() - 1) < 0.02, f"step {i}"
