"""DanceGRPO (Xue et al. 2025, "DanceGRPO: Unleashing GRPO on Visual Generation").

FlowGRPO's estimator and PPO-clip loss, with DanceGRPO's sampling and step choice
(``fastvideo/train_grpo_flux.py`` of the DanceGRPO repository):

- the ``dance_sde`` step, ``std = eta * sqrt(sigma - sigma_next)``, ``eta = 0.3``;
- one initial noise ``x_T`` for every sample of a prompt (``same_initial_noise``);
- advantages normalised by the prompt's own group (``std = "group"``), clamped to +-5;
- a random ``timestep_fraction = 0.6`` of the recorded steps trained, no KL term.

Departures, on purpose (``docs/algorithms.md``, "DanceGRPO"): DanceGRPO draws a separate
random permutation of the steps for every sample; we draw one subset per optimisation
call, shared by every sample of the batch (hence of each group), so that each trained step
is one batched model call at one noise level. Its group std is the unbiased one plus 1e-8;
ours is the population std plus 1e-4 (a factor ``sqrt(G / (G - 1))`` on the advantages).
"""

from __future__ import annotations

from omnirl.trainer.algorithms import flow_grpo  # noqa: F401  (registers the base)
from omnirl.trainer.algorithms.registry import register_alias

register_alias(
    "dance_grpo",
    of="flow_grpo",
    sde_type="dance_sde",
    defaults={
        "std": "group",
        "clip_range": 1e-4,
        "kl_beta": 0.0,
        "timestep_fraction": 0.6,
        "timestep_selection": "random",
    },
    sampling_defaults={"sde_type": "dance_sde", "noise_level": 0.3, "same_initial_noise": True},
    description="DanceGRPO (fastvideo/train_grpo_flux.py): dance SDE, one x_T per prompt, "
    "group std, random 60% of the steps",
)
