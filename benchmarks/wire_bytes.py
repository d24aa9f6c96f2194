"""Bytes per sample on the wire: FlowGRPO groups against DiffusionNFT groups.

``uv run python benchmarks/wire_bytes.py``

Every number is ``encoded_size(encode(group)) / G``: the real codec's frames (header and
tensor frames) of one scored ``DiffusionTrajectoryGroup``. Two kinds of group:

- an SD3.5-Medium shape at 512 px, built from zero tensors of the schema's dtypes: latents
  float32 ``16 x 64 x 64``, 10 steps all recorded (FlowGRPO), prompt embeds bf16 ``333 x 4096``,
  pooled bf16 ``2048``, negatives when CFG is on, uint8 images ``512 x 512 x 3`` or none;
- real groups sampled by the tiny SD3 (``make_tiny_sd3``), 10 steps, 64 x 64 px, with the
  algorithms' own lease sampling (``flow_grpo``: ``sde``, every step recorded;
  ``diffusion_nft``: ``ode``, nothing recorded).
"""

from __future__ import annotations

import tempfile

import torch

from omnirl.protocol.codec import encode, encoded_size
from omnirl.protocol.messages import DiffusionTrajectoryGroup, PromptSpec, Rewards, SamplingParams

ARCH = "StableDiffusion3Pipeline"


def _zeros(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype)


def synthetic_group(
    *, group_size: int, steps: int, latent: tuple[int, int, int], text: tuple[int, int],
    pooled: int, transitions: bool, cfg: bool, image_px: int | None,
) -> DiffusionTrajectoryGroup:  # fmt: skip
    g, bf16 = group_size, torch.bfloat16
    fields = dict(
        group_id="g",
        lease_id="l",
        worker_id="w",
        prompt=PromptSpec(group_id="g", text="a photo of a cat"),
        sampling=SamplingParams(group_size=g, num_steps=steps),
        policy_version=0,
        architecture=ARCH,
        seeds=_zeros(g, dtype=torch.int64),
        final_latents=_zeros(g, *latent),
        prompt_embeds=_zeros(*text, dtype=bf16),
        pooled_prompt_embeds=_zeros(pooled, dtype=bf16),
        rewards=Rewards(group_id="g", total=[0.0] * g),
    )
    if cfg:
        fields["negative_prompt_embeds"] = _zeros(*text, dtype=bf16)
        fields["negative_pooled_prompt_embeds"] = _zeros(pooled, dtype=bf16)
    if image_px:
        fields["images"] = _zeros(g, image_px, image_px, 3, dtype=torch.uint8)
    if transitions:
        k = steps
        fields.update(
            step_indices=_zeros(k, dtype=torch.int64),
            timesteps=_zeros(k),
            sigmas=_zeros(k),
            next_sigmas=_zeros(k),
            noise_levels=_zeros(k),
            latents=_zeros(g, k, *latent),
            next_latents=_zeros(g, k, *latent),
            log_probs=_zeros(g, k),
        )
    return DiffusionTrajectoryGroup(**fields)


def per_sample(group: DiffusionTrajectoryGroup) -> float:
    return encoded_size(encode(group)) / int(group.final_latents.shape[0])


def _tiny_groups() -> tuple[str, list[float]]:
    from omnirl.models.registry import get_rollout_adapter
    from omnirl.models.sd3.tiny import make_tiny_sd3
    from omnirl.trainer.algorithms.windows import lease_sampling

    path = make_tiny_sd3(tempfile.mkdtemp() + "/model", seed=0)
    rollout = get_rollout_adapter(ARCH, "flow_grpo").from_pretrained(path)
    out, shape = [], ""
    for algorithm, guidance in (("flow_grpo", 4.5), ("diffusion_nft", 4.5), ("diffusion_nft", 1.0)):
        fields = lease_sampling(algorithm, seed=1, step=0, num_steps=10)
        sampling = SamplingParams(
            group_size=4,
            num_steps=10,
            guidance_scale=guidance,
            height=64,
            width=64,
            seed=1,
            **fields,
        )
        (group,) = rollout.sample(
            [PromptSpec(group_id="g", text="a red circle")],
            sampling,
            lease_id="l",
            worker_id="w",
            policy_version=0,
        )
        out.append(per_sample(group))
        shape = (
            f"latents {tuple(group.final_latents.shape[1:])}, embeds "
            f"{tuple(group.prompt_embeds.shape)} {str(group.prompt_embeds.dtype)[6:]}"
        )
    return shape, out


def main() -> None:
    torch.set_num_threads(1)
    rows = []
    for image_px in (None, 512):
        sizes = []
        for transitions, cfg in ((True, True), (False, True), (False, False)):
            sizes.append(
                per_sample(
                    synthetic_group(
                        group_size=16,
                        steps=10,
                        latent=(16, 64, 64),
                        text=(333, 4096),
                        pooled=2048,
                        transitions=transitions,
                        cfg=cfg,
                        image_px=image_px,
                    )
                )
            )
        images = "512 px images" if image_px else "no images"
        rows.append((f"SD3.5-M shape, G = 16, 10 steps, {images}", sizes))
    shape, sizes = _tiny_groups()
    rows.append((f"tiny SD3, real rollout, G = 4, 10 steps, {shape}, 64 px images", sizes))
    print("| group | FlowGRPO, CFG | DiffusionNFT, CFG | DiffusionNFT, CFG-free | ratio |")
    print("|---|---|---|---|---|")
    for name, (grpo, nft_cfg, nft) in rows:
        print(
            f"| {name} | {grpo / 1e3:,.1f} KB | {nft_cfg / 1e3:,.1f} KB | {nft / 1e3:,.1f} KB "
            f"| {grpo / nft:.1f}x |"
        )


if __name__ == "__main__":
    main()
