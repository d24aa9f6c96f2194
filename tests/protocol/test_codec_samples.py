"""One populated sample of every message kind, shared by the codec tests.

Imported by the other ``test_codec*`` files (pytest puts this folder on ``sys.path``).
"""

from __future__ import annotations

import torch

from omnirl.protocol import messages as m
from omnirl.protocol.messages import MESSAGE_TYPES

G, K, C, H, W = 2, 3, 4, 8, 8  # group, recorded steps, latent channels, latent height, width


def _prompt() -> m.PromptSpec:
    return m.PromptSpec(group_id="e0-i7", text="a red cube", metadata={"tags": ["shape"]})


def _sampling() -> m.SamplingParams:
    return m.SamplingParams(group_size=G, seed=11, num_steps=10, sde_window=(2, 5))


def _rewards() -> m.Rewards:
    return m.Rewards(
        group_id="e0-i7",
        total=[0.25, 0.75],
        components={"ocr": [0.5, 1.0], "aesthetic": [0.0, 0.5]},
        weights={"ocr": 0.5, "aesthetic": 0.5},
        scorer="reward-0",
        details={"strict": [True, False]},
    )


def diffusion_group(gen: torch.Generator | None = None) -> m.DiffusionTrajectoryGroup:
    gen = gen or torch.Generator().manual_seed(0)
    return m.DiffusionTrajectoryGroup(
        group_id="e0-i7",
        lease_id="lease-3",
        worker_id="rollout-1",
        prompt=_prompt(),
        sampling=_sampling(),
        policy_version=4,
        architecture="StableDiffusion3Pipeline",
        seeds=torch.tensor([101, 102], dtype=torch.int64),
        step_indices=torch.arange(2, 5, dtype=torch.int64),
        timesteps=torch.tensor([900.0, 800.0, 700.0]),
        sigmas=torch.tensor([0.9, 0.8, 0.7]),
        next_sigmas=torch.tensor([0.8, 0.7, 0.6]),
        noise_levels=torch.full((K,), 0.7),
        latents=torch.randn(G, K, C, H, W, generator=gen),
        next_latents=torch.randn(G, K, C, H, W, generator=gen),
        log_probs=torch.randn(G, K, generator=gen),
        final_latents=torch.randn(G, C, H, W, generator=gen),
        prompt_embeds=torch.randn(7, 16, generator=gen).to(torch.bfloat16),
        prompt_embeds_mask=torch.tensor([True] * 5 + [False] * 2),
        pooled_prompt_embeds=torch.randn(32, generator=gen).to(torch.bfloat16),
        negative_prompt_embeds=torch.randn(7, 16, generator=gen).to(torch.bfloat16),
        negative_prompt_embeds_mask=torch.ones(7, dtype=torch.bool),
        negative_pooled_prompt_embeds=torch.randn(32, generator=gen).to(torch.bfloat16),
        images=torch.randint(0, 256, (G, 16, 16, 3), dtype=torch.uint8, generator=gen),
        extra={"guidance": torch.tensor([4.5, 4.5], dtype=torch.float16)},
        rewards=_rewards(),
        timings={"sample_s": 1.25},
    )


def token_group(gen: torch.Generator | None = None) -> m.TokenTrajectoryGroup:
    gen = gen or torch.Generator().manual_seed(1)
    return m.TokenTrajectoryGroup(
        group_id="e0-i8",
        lease_id="lease-3",
        worker_id="rollout-2",
        prompt=_prompt(),
        sampling=m.SamplingParams(group_size=G, max_new_tokens=6, temperature=0.9),
        policy_version=4,
        architecture="Qwen3OmniMoeForConditionalGeneration",
        stage="thinker",
        prompt_ids=torch.tensor([1, 2, 3, 4], dtype=torch.int64),
        response_ids=torch.randint(0, 1000, (G, 6), generator=gen),
        response_mask=torch.tensor([[True] * 6, [True] * 4 + [False] * 2]),
        log_probs=-torch.rand(G, 6, generator=gen),
        multimodal=[m.MediaRef(modality="image", uri="file:///data/a.png", sha256="ab" * 32)],
        texts=["yes", "no"],
        rewards=_rewards(),
    )


def weight_update(gen: torch.Generator | None = None) -> m.WeightUpdate:
    gen = gen or torch.Generator().manual_seed(2)
    return m.WeightUpdate(
        version=5,
        format="lora",
        chunk=0,
        num_chunks=1,
        names=["blocks.0.attn.to_q.lora_A.weight", "blocks.0.attn.to_q.lora_B.weight"],
        tensors=[
            torch.randn(4, 16, generator=gen).to(torch.bfloat16),
            torch.zeros(16, 4, dtype=torch.bfloat16),
        ],
        checksum="0" * 64,
        total_bytes=256,
        adapter_config={"r": 4, "lora_alpha": 8, "target_modules": ["to_q"]},
    )


def sample_messages() -> list[m.Message]:
    """One message of every kind, every optional tensor field set."""
    return [
        m.Hello(
            role="reward",
            worker_id="reward-0",
            capabilities=m.Capabilities(architectures=["StableDiffusion3Pipeline"], device="cpu"),
            address="tcp://127.0.0.1:5601",
        ),
        m.Welcome(
            worker_id="reward-0",
            run_id="run-1",
            topology=m.Topology(
                control="tcp://127.0.0.1:5555",
                intake="tcp://127.0.0.1:5556",
                weights="tcp://127.0.0.1:5557",
                reward=["tcp://127.0.0.1:5601"],
            ),
            policy_version=3,
            model_path="/models/tiny-sd3",
            architecture="StableDiffusion3Pipeline",
            config={"algorithm": "flow_grpo", "clip_range": 1e-4, "nested": {"a": [1, 2]}},
        ),
        m.LeaseRequest(worker_id="rollout-1", capacity=2),
        m.Lease(
            lease_id="lease-3",
            worker_id="rollout-1",
            prompts=[_prompt(), m.PromptSpec(group_id="e0-i8", text="two blue spheres")],
            sampling=_sampling(),
            deadline=1_800_000_000.5,
            policy_version=4,
            reward_address="tcp://127.0.0.1:5601",
        ),
        m.LeaseReturn(
            lease_id="lease-3", worker_id="rollout-1", reason="OutOfMemoryError: CUDA out of memory"
        ),
        _rewards(),
        diffusion_group(),
        token_group(),
        weight_update(),
        m.WeightRequest(worker_id="rollout-1", have_version=-1),
        m.Heartbeat(
            worker_id="rollout-1",
            role="rollout",
            policy_version=4,
            leases=["lease-3"],
            time=1_800_000_000.25,
            stats={"groups_per_s": 0.5},
        ),
        m.Ack(ref="lease-3", detail="received"),
        m.Refusal(code="no_work", reason="the epoch is exhausted", ref="lease-4"),
        m.StatusRequest(worker_id="cli"),
        m.Status(
            run_id="run-1",
            policy_version=4,
            step=4,
            max_steps=100,
            workers=[m.WorkerStatus(worker_id="rollout-1", role="rollout", leases=["lease-3"])],
            leases_in_flight=1,
            intake_rate=0.5,
            counters={"groups_accepted": 8},
        ),
    ]


def test_samples_cover_every_kind():
    missing = set(MESSAGE_TYPES) - {type(msg) for msg in sample_messages()}
    assert not missing, f"add a sample of {sorted(c.__name__ for c in missing)} here"
