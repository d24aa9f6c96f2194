"""Final clean samples of many trajectory groups with their conditioning, collated.

Forward-process objectives (DiffusionNFT, Diffusion-DPO) train on the samples a rollout
produced, ``final_latents`` (``x0``), re-noised by the trainer; they need no recorded
transitions. :func:`collate_clean_samples` lays the chosen samples of several groups out as
one flat batch of ``B`` rows, the group-level conditioning gathered per row on the training
side (the wire carries it once per group).

Shapes: ``B`` rows, ``C, H, W`` latent dims, ``L`` text tokens, ``D`` embedding width,
``D'`` pooled width.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

from omnirl.models.transitions import TransitionBatchError, _gather
from omnirl.protocol.messages import DiffusionTrajectoryGroup


@dataclasses.dataclass(kw_only=True, slots=True)
class CleanSampleBatch:
    """``B`` clean samples and the conditioning of their groups, row by row."""

    latents: Tensor  # float32 [B, C, H, W] the rollout's final latents x0
    prompt_embeds: Tensor  # [B, L, D] (wire dtype; cast to model dtype at the model call)
    pooled_prompt_embeds: Tensor | None  # [B, D']
    prompt_embeds_mask: Tensor | None  # bool [B, L]
    negative_prompt_embeds: Tensor | None  # [B, L', D]; present iff guidance_scale > 1
    negative_pooled_prompt_embeds: Tensor | None  # [B, D']
    negative_prompt_embeds_mask: Tensor | None  # bool [B, L']
    guidance_scale: float
    group_index: Tensor  # int64 [B] index of the row's group in the collated list
    sample_index: Tensor  # int64 [B] index of the row's sample inside its group
    num_steps: int  # length T of the groups' sampling schedule

    @property
    def batch_size(self) -> int:
        return int(self.latents.shape[0])

    def select(self, rows: Tensor | Sequence[int]) -> CleanSampleBatch:
        """A sub-batch of the given rows (micro-batches, pairs); scalars are kept."""
        if not isinstance(rows, Tensor):
            rows = torch.as_tensor(list(rows), dtype=torch.long)
        rows = rows.to(self.latents.device)
        fields = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            fields[f.name] = value[rows] if isinstance(value, Tensor) else value
        return CleanSampleBatch(**fields)


def collate_clean_samples(
    groups: Sequence[DiffusionTrajectoryGroup], device: torch.device | str = "cpu"
) -> CleanSampleBatch:
    """Every sample of every group, group 0's first, as one :class:`CleanSampleBatch`.

    Raises :class:`~omnirl.models.transitions.TransitionBatchError` when a group has no
    ``final_latents`` or ``prompt_embeds``, or the groups do not share the latent shape, the
    number of sampling steps or the guidance scale.
    """
    if not groups:
        raise TransitionBatchError("no groups to collate")
    first = groups[0]
    for g in groups:
        for name in ("final_latents", "prompt_embeds"):
            if getattr(g, name) is None:
                raise TransitionBatchError(f"group {g.group_id!r} has no {name!r}")
        if tuple(g.final_latents.shape[1:]) != tuple(first.final_latents.shape[1:]):
            raise TransitionBatchError(
                f"groups {first.group_id!r} and {g.group_id!r} have different latent shapes "
                f"{tuple(first.final_latents.shape[1:])} and {tuple(g.final_latents.shape[1:])}"
            )
        if g.sampling.num_steps != first.sampling.num_steps:
            raise TransitionBatchError(
                f"groups {first.group_id!r} and {g.group_id!r} use different num_steps "
                f"({first.sampling.num_steps} vs {g.sampling.num_steps})"
            )
        if g.sampling.guidance_scale != first.sampling.guidance_scale:
            raise TransitionBatchError(
                f"groups {first.group_id!r} and {g.group_id!r} use different guidance scales"
            )
    sizes = [int(g.final_latents.shape[0]) for g in groups]
    group_index = torch.repeat_interleave(torch.arange(len(groups)), torch.tensor(sizes))
    gi_dev = group_index.to(device)
    return CleanSampleBatch(
        latents=torch.cat([g.final_latents for g in groups]).to(device=device, dtype=torch.float32),
        prompt_embeds=_gather(groups, "prompt_embeds", gi_dev, device),
        pooled_prompt_embeds=_gather(groups, "pooled_prompt_embeds", gi_dev, device),
        prompt_embeds_mask=_gather(groups, "prompt_embeds_mask", gi_dev, device),
        negative_prompt_embeds=_gather(groups, "negative_prompt_embeds", gi_dev, device),
        negative_pooled_prompt_embeds=_gather(
            groups, "negative_pooled_prompt_embeds", gi_dev, device
        ),
        negative_prompt_embeds_mask=_gather(groups, "negative_prompt_embeds_mask", gi_dev, device),
        guidance_scale=float(first.sampling.guidance_scale),
        group_index=gi_dev,
        sample_index=torch.cat([torch.arange(n) for n in sizes]).to(device),
        num_steps=int(first.sampling.num_steps),
    )
