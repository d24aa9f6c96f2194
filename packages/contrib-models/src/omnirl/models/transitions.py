"""Recorded transitions of many trajectory groups, collated for one recorded step.

A :class:`~omnirl.protocol.messages.DiffusionTrajectoryGroup` carries its conditioning once
per group (``prompt_embeds [L, D]``) and its transitions per sample (``latents [G, K, ...]``).
:func:`collate_transitions` takes the ``k``-th recorded step of each group and lays it out as
one flat batch of ``B = sum of selected samples`` rows: the per-sample tensors are indexed,
the group-level conditioning is gathered per row on the training side (the wire never
carries a per-sample copy).

Shapes: ``B`` rows, ``C, H, W`` latent dims (``C, F, H, W`` for video), ``L`` text tokens,
``D`` embedding width, ``D'`` pooled width.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

from omnirl.protocol.messages import DiffusionTrajectoryGroup


class TransitionBatchError(ValueError):
    """Groups cannot be collated together (missing fields, different schedules, bad k)."""


@dataclasses.dataclass(kw_only=True, slots=True)
class TransitionBatch:
    """The transitions ``x_k -> x_{k+1}`` of ``B`` samples at one recorded step.

    All groups share one sampling schedule, so ``step_index`` (into the schedule) and the
    sigmas are the same for every row; they are still stored per row so a model call and the
    scheduler need no broadcasting rules.
    """

    latents: Tensor  # float32 [B, C, H, W] x at sigma
    next_latents: Tensor  # float32 [B, C, H, W] recorded x at sigma_next
    timesteps: Tensor  # float32 [B] model timesteps (sigma * 1000)
    sigmas: Tensor  # float32 [B]
    next_sigmas: Tensor  # float32 [B]
    noise_levels: Tensor  # float32 [B]
    old_log_probs: Tensor  # float32 [B] behaviour log-probs recorded by the rollout
    prompt_embeds: Tensor  # [B, L, D] (wire dtype; cast to model dtype at the model call)
    pooled_prompt_embeds: Tensor | None  # [B, D']
    prompt_embeds_mask: Tensor | None  # bool [B, L]
    negative_prompt_embeds: Tensor | None  # [B, L', D]; present iff guidance_scale > 1
    negative_pooled_prompt_embeds: Tensor | None  # [B, D']
    negative_prompt_embeds_mask: Tensor | None  # bool [B, L']
    guidance_scale: float
    group_index: Tensor  # int64 [B] index of the row's group in the collated list
    sample_index: Tensor  # int64 [B] index of the row's sample inside its group
    k: int  # recorded-step index (into the groups' K axis)
    step_index: int  # index into the sampling schedule
    num_steps: int  # length T of the sampling schedule (to rebuild it, e.g. its sigma_max)
    # int64 [B]: rows with the same id have identical model inputs (latents, timestep,
    # conditioning), e.g. a group's samples before their first stochastic step when they share
    # the initial noise; the model then runs once per id (:func:`shared_inputs`). None: every
    # row distinct (what collate gives when no group shares an x).
    input_id: Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.latents.shape[0])

    @property
    def do_cfg(self) -> bool:
        return self.negative_prompt_embeds is not None

    def select(self, rows: Tensor | slice | Sequence[int]) -> TransitionBatch:
        """A sub-batch of the given rows (for micro-batches); scalars are kept."""
        if not isinstance(rows, slice | Tensor):
            rows = torch.as_tensor(list(rows), dtype=torch.long)
        if isinstance(rows, Tensor):
            rows = rows.to(self.latents.device)
        fields = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            fields[f.name] = value[rows] if isinstance(value, Tensor) else value
        return TransitionBatch(**fields)

    def to(self, device: torch.device | str) -> TransitionBatch:
        """A copy with every tensor on ``device``."""
        fields = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            fields[f.name] = value.to(device) if isinstance(value, Tensor) else value
        return TransitionBatch(**fields)


@dataclasses.dataclass(frozen=True, slots=True)
class SharedInputs:
    """Rows that share their model inputs: run the model on ``first`` and expand by ``inverse``.

    ``first`` int64 ``[U]`` one representative row per distinct input; ``inverse`` int64
    ``[B]`` the position in ``first`` of each row's representative, so
    ``model(x[first])[inverse]`` equals ``model(x)`` row for row, gradients included
    (``index_select``'s backward sums the rows that share an input).
    """

    first: Tensor
    inverse: Tensor

    @classmethod
    def of_groups(cls, num_groups: int, group_size: int, device) -> SharedInputs:
        """Every group of ``group_size`` consecutive rows shares one input."""
        first = torch.arange(num_groups, device=device) * group_size
        inverse = torch.arange(num_groups, device=device).repeat_interleave(group_size)
        return cls(first=first, inverse=inverse)


def shared_inputs(input_id: Tensor | None) -> SharedInputs | None:
    """The :class:`SharedInputs` of a batch's ``input_id`` ``[B]``; None when no two rows
    share an id (nothing to save)."""
    if input_id is None:
        return None
    ids, inverse = torch.unique(input_id, return_inverse=True)
    if len(ids) == len(input_id):
        return None
    rows = torch.arange(len(input_id), device=input_id.device)
    first = torch.full((len(ids),), len(input_id), dtype=torch.long, device=input_id.device)
    first = first.scatter_reduce(0, inverse, rows, reduce="amin")
    return SharedInputs(first=first, inverse=inverse)


def _same_schedule(groups: Sequence[DiffusionTrajectoryGroup], k: int) -> int:
    first = groups[0]
    step = int(first.step_indices[k])
    sigma = float(first.sigmas[k])
    for g in groups[1:]:
        if g.sampling.num_steps != first.sampling.num_steps:
            raise TransitionBatchError(
                f"groups {first.group_id!r} and {g.group_id!r} use different num_steps "
                f"({first.sampling.num_steps} vs {g.sampling.num_steps}); collate one schedule at a time"
            )
        if int(g.step_indices[k]) != step or abs(float(g.sigmas[k]) - sigma) > 1e-6:
            raise TransitionBatchError(
                f"recorded step {k} differs between groups {first.group_id!r} "
                f"(step {step}, sigma {sigma}) and {g.group_id!r} "
                f"(step {int(g.step_indices[k])}, sigma {float(g.sigmas[k])}); "
                "all groups of a batch must share the SDE window and schedule"
            )
        if g.sampling.guidance_scale != first.sampling.guidance_scale:
            raise TransitionBatchError(
                f"groups {first.group_id!r} and {g.group_id!r} use different guidance scales"
            )
    return step


def _check_group(g: DiffusionTrajectoryGroup, k: int) -> None:
    for name in ("latents", "next_latents", "log_probs", "sigmas", "next_sigmas", "timesteps"):
        if getattr(g, name) is None:
            raise TransitionBatchError(
                f"group {g.group_id!r} has no {name!r} (sampled with record_latents=False?)"
            )
    if g.prompt_embeds is None:
        raise TransitionBatchError(f"group {g.group_id!r} has no prompt_embeds")
    num_k = int(g.latents.shape[1])
    if not 0 <= k < num_k:
        raise TransitionBatchError(
            f"k={k} out of range: group {g.group_id!r} recorded {num_k} steps"
        )


def _gather(groups, name: str, group_index: Tensor, device) -> Tensor | None:
    """Stack one group-level field (``[...]`` per group) and expand it to ``[B, ...]`` rows."""
    values = [getattr(g, name) for g in groups]
    present = [v is not None for v in values]
    if not any(present):
        return None
    if not all(present):
        missing = [g.group_id for g, p in zip(groups, present, strict=True) if not p]
        raise TransitionBatchError(f"{name!r} is missing in some groups: {missing}")
    shapes = {tuple(v.shape) for v in values}
    if len(shapes) != 1:
        raise TransitionBatchError(f"{name!r} has different shapes across groups: {sorted(shapes)}")
    stacked = torch.stack([v.to(device) for v in values])  # [N_groups, ...]
    return stacked.index_select(0, group_index)


def collate_transitions(
    groups: Sequence[DiffusionTrajectoryGroup],
    k: int,
    device: torch.device | str = "cpu",
    sample_mask: Tensor | None = None,
) -> TransitionBatch:
    """Collate the ``k``-th recorded step of every group into one :class:`TransitionBatch`.

    ``sample_mask``: optional bool ``[sum of G]`` over the groups' samples in order (group 0's
    samples first); rows where it is False are left out. Raises
    :class:`TransitionBatchError` when groups are missing recorded fields or do not share the
    schedule (step index, sigma, guidance scale) at ``k``.
    """
    if not groups:
        raise TransitionBatchError("no groups to collate")
    for g in groups:
        _check_group(g, k)
    step = _same_schedule(groups, k)
    sizes = [int(g.latents.shape[0]) for g in groups]
    group_index = torch.repeat_interleave(torch.arange(len(groups)), torch.tensor(sizes))
    sample_index = torch.cat([torch.arange(n) for n in sizes])
    if sample_mask is not None:
        sample_mask = torch.as_tensor(sample_mask, dtype=torch.bool).flatten().cpu()
        if sample_mask.numel() != len(group_index):
            raise TransitionBatchError(
                f"sample_mask has {sample_mask.numel()} entries for {len(group_index)} samples"
            )
        group_index, sample_index = group_index[sample_mask], sample_index[sample_mask]
    if len(group_index) == 0:
        raise TransitionBatchError("sample_mask selects no samples")

    def per_sample(name: str) -> Tensor:  # [G, K, ...] fields -> [B, ...] float32
        parts = []
        for i, g in enumerate(groups):
            rows = sample_index[group_index == i]
            if len(rows):
                parts.append(getattr(g, name)[rows, k])
        return torch.cat(parts).to(device=device, dtype=torch.float32)

    def input_ids() -> Tensor | None:  # [B]: a group's rows share an id where x_k is one
        ids, start, any_shared = [], 0, False
        for i, g in enumerate(groups):
            n = int((group_index == i).sum())
            x = g.latents[sample_index[group_index == i], k]
            same = n > 1 and bool((x == x[:1]).all())
            any_shared |= same
            ids.append(torch.full((n,), start) if same else torch.arange(start, start + n))
            start += n
        # None where every row is distinct: the model call then needs no unique() (a device
        # sync on a GPU) to find that out
        return torch.cat(ids).to(device) if any_shared else None

    def per_step(name: str) -> Tensor:  # [K] fields -> [B] float32
        values = torch.stack([getattr(g, name)[k].to(torch.float32) for g in groups])
        return values.index_select(0, group_index).to(device)

    noise_levels = [
        g.noise_levels[k] if g.noise_levels is not None else torch.tensor(g.sampling.noise_level)
        for g in groups
    ]
    gi_dev = group_index.to(device)
    return TransitionBatch(
        latents=per_sample("latents"),
        next_latents=per_sample("next_latents"),
        old_log_probs=per_sample("log_probs"),
        timesteps=per_step("timesteps"),
        sigmas=per_step("sigmas"),
        next_sigmas=per_step("next_sigmas"),
        noise_levels=torch.stack([n.to(torch.float32) for n in noise_levels])
        .index_select(0, group_index)
        .to(device),
        prompt_embeds=_gather(groups, "prompt_embeds", gi_dev, device),
        pooled_prompt_embeds=_gather(groups, "pooled_prompt_embeds", gi_dev, device),
        prompt_embeds_mask=_gather(groups, "prompt_embeds_mask", gi_dev, device),
        negative_prompt_embeds=_gather(groups, "negative_prompt_embeds", gi_dev, device),
        negative_pooled_prompt_embeds=_gather(
            groups, "negative_pooled_prompt_embeds", gi_dev, device
        ),
        negative_prompt_embeds_mask=_gather(groups, "negative_prompt_embeds_mask", gi_dev, device),
        guidance_scale=float(groups[0].sampling.guidance_scale),
        group_index=gi_dev,
        sample_index=sample_index.to(device),
        k=k,
        step_index=step,
        num_steps=int(groups[0].sampling.num_steps),
        input_id=input_ids(),
    )
