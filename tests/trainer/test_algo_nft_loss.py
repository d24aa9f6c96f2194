"""DiffusionNFT's loss on hand-computed examples: fails on a wrong sign, mean or normaliser.

Worked example (one row, latent of 2 elements), beta = 1, c = adv_clip_max = 5:
x0 = [1, 0], t = 0.5, eps = [-1, 2]  ->  x_t = [0, 1]
v_old = [1, 0], v_theta = [3, 2]
v+ = [3, 2]   x0+ = [-1.5, 0]  err+ = [-2.5, 0]  weight+ = 1.25  L+ = 3.125 / 1.25 = 2.5
v- = [-1, -2] x0- = [0.5, 2]   err- = [-0.5, 2]  weight- = 1.25  L- = 2.125 / 1.25 = 1.7
A = 2.5 -> r = 2.5 / 5 / 2 + 0.5 = 0.75
loss = 5 * (0.75 * 2.5 + 0.25 * 1.7) / 1 = 11.5
"""

import pytest
import torch

from omnirl.trainer.algorithms.diffusion_nft import (
    DiffusionNFTLoss,
    NFTLossInputs,
    old_policy_decay,
    optimality_probability,
)
from omnirl.trainer.algorithms.registry import get_algorithm


def _inputs(v_theta, *, adv=2.5, v_ref=None):
    return NFTLossInputs(
        x0=torch.tensor([[1.0, 0.0]]),
        x_t=torch.tensor([[0.0, 1.0]]),
        t=torch.tensor([0.5]),
        v_theta=v_theta,
        v_old=torch.tensor([[1.0, 0.0]]),
        advantages=torch.tensor([adv]),
        v_ref=v_ref,
    )


def test_optimality_probability_maps_clamped_advantages_to_unit_interval():
    a = torch.tensor([5.0, -5.0, 0.0, 10.0, -2.5, 1.0])
    r = optimality_probability(a, 5.0)
    assert torch.allclose(r, torch.tensor([1.0, 0.0, 0.5, 1.0, 0.25, 0.6]))


def test_worked_example_beta_one():
    loss = DiffusionNFTLoss(DiffusionNFTLoss.Config(nft_beta=1.0, adv_clip_max=5.0))
    out = loss(_inputs(torch.tensor([[3.0, 2.0]])))
    assert out.loss.item() == pytest.approx(11.5, abs=1e-5)
    assert out.per_sample["optimality"].item() == pytest.approx(0.75)
    assert out.per_sample["old_deviation"].item() == pytest.approx((4 + 4) / 2)


def test_worked_example_beta_half_divides_by_beta():
    # v+ = 0.5*[3,2] + 0.5*[1,0] = [2,1]: x0+ = [-1, 0.5], err+ = [-2, 0.5], w = 1.25,
    #   L+ = (4 + 0.25) / 2 / 1.25 = 1.7
    # v- = 1.5*[1,0] - 0.5*[3,2] = [0,-1]: x0- = [0, 1.5], err- = [-1, 1.5], w = 1.25,
    #   L- = (1 + 2.25) / 2 / 1.25 = 1.3
    # loss = 5 * (0.75 * 1.7 + 0.25 * 1.3) / 0.5 = 16
    loss = DiffusionNFTLoss(DiffusionNFTLoss.Config(nft_beta=0.5, adv_clip_max=5.0))
    assert loss(_inputs(torch.tensor([[3.0, 2.0]]))).loss.item() == pytest.approx(16.0, abs=1e-5)


def test_kl_is_the_mean_squared_velocity_gap_times_kl_beta():
    loss = DiffusionNFTLoss(DiffusionNFTLoss.Config(kl_beta=0.1))
    assert loss.needs_reference()
    out = loss(_inputs(torch.tensor([[3.0, 2.0]]), v_ref=torch.tensor([[1.0, 1.0]])))
    assert out.kl.item() == pytest.approx(2.5)  # mean(4, 1)
    assert out.loss.item() == pytest.approx(11.5 + 0.25, abs=1e-5)
    with pytest.raises(ValueError, match="v_ref"):
        loss(_inputs(torch.tensor([[3.0, 2.0]])))


def test_gradient_sign_and_detached_normaliser():
    # One element: x0 = 1, x_t = 0, t = 0.5, v_old = 1, v_theta = 3, beta = 1.
    # err+ = -2.5, err- = -0.5; with the weights detached
    # dL+/dv = 2 err+ (-t) / |err+| = 1, dL-/dv = 2 err- (+t) / |err-| = -1
    # dloss/dv = 5 * (r * 1 + (1 - r) * (-1)) = 5 * (2r - 1)
    for adv, expected in ((2.5, 2.5), (-2.5, -2.5), (5.0, 5.0)):
        v = torch.tensor([[3.0]], requires_grad=True)
        inp = NFTLossInputs(
            x0=torch.tensor([[1.0]]),
            x_t=torch.tensor([[0.0]]),
            t=torch.tensor([0.5]),
            v_theta=v,
            v_old=torch.tensor([[1.0]]),
            advantages=torch.tensor([adv]),
        )
        DiffusionNFTLoss()(inp).loss.backward()
        assert v.grad.item() == pytest.approx(expected, abs=1e-5), adv
    # a positive advantage moves v_theta (by gradient descent) towards the velocity that
    # reconstructs x0, (x_t - x0) / t = -2; a negative one away from it


def test_at_the_old_policy_a_neutral_advantage_gives_no_gradient():
    v = torch.tensor([[1.0, 0.0]], requires_grad=True)  # v_theta == v_old
    DiffusionNFTLoss()(_inputs(v, adv=0.0)).loss.backward()
    assert torch.allclose(v.grad, torch.zeros_like(v.grad), atol=1e-6)


def test_rows_are_averaged_not_summed():
    loss = DiffusionNFTLoss()
    one = _inputs(torch.tensor([[3.0, 2.0]]))
    two = NFTLossInputs(
        **{
            name: torch.cat([getattr(one, name)] * 2)
            for name in ("x0", "x_t", "t", "v_theta", "v_old", "advantages")
        }
    )
    assert loss(two).loss.item() == pytest.approx(11.5, abs=1e-5)


def test_config_and_shape_errors():
    with pytest.raises(ValueError, match="nft_beta"):
        DiffusionNFTLoss.Config(nft_beta=0.0)
    with pytest.raises(ValueError, match="adv_clip_max"):
        DiffusionNFTLoss.Config(adv_clip_max=float("inf"))
    bad = NFTLossInputs(
        x0=torch.zeros(1, 2),
        x_t=torch.zeros(1, 2),
        t=torch.zeros(2),
        v_theta=torch.zeros(1, 2),
        v_old=torch.zeros(1, 2),
        advantages=torch.zeros(1),
    )
    with pytest.raises(ValueError, match="t and advantages"):
        DiffusionNFTLoss()(bad)


def test_old_policy_decay_schedule():
    assert old_policy_decay(0, rate=0.001, max_decay=0.5) == 0.0
    assert old_policy_decay(100, rate=0.001, max_decay=0.5) == pytest.approx(0.1)
    assert old_policy_decay(10_000, rate=0.001, max_decay=0.5) == 0.5


def test_spec_is_log_prob_free_ode():
    spec = get_algorithm("diffusion_nft")
    assert not spec.needs_log_probs and spec.sde_type == "ode"
    assert spec.defaults["nft_beta"] == 1.0 and spec.defaults["adv_clip_max"] == 5.0
