"""Preference files: (prompt, chosen image, rejected image) pairs for offline Diffusion-DPO.

A preference file is JSON Lines. An optional first line is a header; every other line is one
pair::

    {"format": "omnirl.preferences", "version": 1, "metadata": {...}}          (optional header)
    {"prompt": "a photo of a red circle", "chosen": "images/000000_w.png",
     "rejected": "images/000000_l.png", "metadata": {...}, "scores": {...}}

``chosen`` and ``rejected`` are image paths relative to the file's folder (absolute paths are
taken as they are); both images of a pair have the size the run samples at. ``metadata`` is
the prompt's metadata (it travels in ``PromptSpec.metadata``, as in a prompt file);
``scores`` and the header's ``metadata`` say how the file was made and are not read by the
trainer. :func:`read_preference_file` checks every row and that every image exists.

:class:`PreferenceSource` walks the pairs epoch after epoch in an order fixed by
``(seed, epoch)`` (the prompt source's :class:`~omnirl.trainer.data.EpochSampler`), resumable
from a checkpoint; :func:`preference_groups` turns pairs into two-sample trajectory groups
(chosen first, rewards ``[1, 0]``) through the model family's
:class:`~omnirl.models.base.SampleEncoder`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from omnirl.protocol.messages import (
    DiffusionTrajectoryGroup,
    PromptSpec,
    Rewards,
    SamplingParams,
)
from omnirl.trainer.data import DataError, EpochSampler

FORMAT = "omnirl.preferences"
VERSION = 1


@dataclasses.dataclass(frozen=True, slots=True)
class PreferencePair:
    """One row: the prompt and the absolute paths of its chosen and rejected images."""

    prompt: str
    chosen: Path
    rejected: Path
    metadata: dict[str, Any]


@dataclasses.dataclass(frozen=True, slots=True)
class PreferenceFile:
    path: Path
    pairs: list[PreferencePair]
    metadata: dict[str, Any]  # the header's, {} without a header


def read_preference_file(path: str | Path) -> PreferenceFile:
    """Read and check a preference file; :class:`DataError` names the file and line."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"preference file not found: {path}")
    pairs: list[PreferencePair] = []
    header: dict[str, Any] = {}
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{where}: not JSON: {err.msg}") from None
            if not isinstance(row, dict):
                raise DataError(f"{where}: a row must be a JSON object")
            if "format" in row:
                if pairs or header:
                    raise DataError(f"{where}: a header may only be the first line")
                header = _header(row, where)
                continue
            pairs.append(_pair(row, path.parent, where))
    if not pairs:
        raise DataError(f"{path}: no preference pairs")
    return PreferenceFile(path=path, pairs=pairs, metadata=header)


def _header(row: dict[str, Any], where: str) -> dict[str, Any]:
    if row.get("format") != FORMAT:
        raise DataError(f"{where}: header format must be {FORMAT!r}, got {row.get('format')!r}")
    if row.get("version") != VERSION:
        raise DataError(f"{where}: unsupported version {row.get('version')!r} (known: {VERSION})")
    meta = row.get("metadata") or {}
    if not isinstance(meta, dict):
        raise DataError(f"{where}: header 'metadata' is not an object")
    return meta


def _pair(row: dict[str, Any], folder: Path, where: str) -> PreferencePair:
    for key in ("prompt", "chosen", "rejected"):
        if not isinstance(row.get(key), str) or not row[key]:
            raise DataError(f"{where}: no string {key!r} field")
    metadata = row.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise DataError(f"{where}: 'metadata' is not an object")
    images = {}
    for key in ("chosen", "rejected"):
        image = folder / row[key]  # an absolute path stays as it is
        if not image.is_file():
            raise DataError(f"{where}: {key} image not found: {image}")
        images[key] = image
    if images["chosen"].resolve() == images["rejected"].resolve():
        raise DataError(f"{where}: chosen and rejected are the same image")
    return PreferencePair(row["prompt"], images["chosen"], images["rejected"], dict(metadata))


def load_image(path: Path, size: tuple[int, int]) -> torch.Tensor:
    """The RGB image at ``path`` as uint8 ``[H, W, 3]``; :class:`DataError` unless ``(H, W)``
    is ``size``."""
    import numpy as np
    from PIL import Image

    with Image.open(path) as img:
        array = np.asarray(img.convert("RGB"), dtype=np.uint8)
    if tuple(array.shape[:2]) != tuple(size):
        raise DataError(
            f"{path}: image is {array.shape[0]}x{array.shape[1]}, the run samples at "
            f"{size[0]}x{size[1]} (sampling.height x sampling.width)"
        )
    return torch.from_numpy(array.copy())


class PreferenceSource:
    """The pairs of a preference file, epoch after epoch; ``next()`` -> ``(PromptSpec, pair,
    epoch)``. The prompt's ``group_id`` is ``pref:e{epoch}:i{index}``, so every pass of the
    file trains each pair once and a resumed run continues where the checkpoint was."""

    def __init__(self, file: PreferenceFile, *, shuffle: bool = True, seed: int = 0):
        self.file = file
        self.sampler = EpochSampler(len(file.pairs), shuffle=shuffle, seed=seed)

    def __len__(self) -> int:
        return len(self.file.pairs)

    def next(self) -> tuple[PromptSpec, PreferencePair, int]:
        epoch, index = next(self.sampler)
        pair = self.file.pairs[index]
        spec = PromptSpec(
            group_id=f"pref:e{epoch}:i{index}", text=pair.prompt, metadata=dict(pair.metadata)
        )
        return spec, pair, epoch

    def peek_epoch(self) -> int:
        """The epoch of the pair ``next()`` returns."""
        return self.sampler.epoch + (1 if self.sampler.position >= self.sampler.size else 0)

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)


def offline_sampling(sampling_cfg: Any, *, seed: int) -> SamplingParams:
    """The ``SamplingParams`` a preference group carries: the run's schedule length, guidance
    and size (the trainer reads them to draw noise levels and to guide the velocity), two
    samples, no SDE."""
    return SamplingParams(
        group_size=2,
        seed=seed,
        num_steps=int(sampling_cfg.num_steps),
        guidance_scale=float(sampling_cfg.guidance_scale),
        height=int(sampling_cfg.height),
        width=int(sampling_cfg.width),
        negative_prompt=str(sampling_cfg.negative_prompt),
        sde_type="ode",
        noise_level=0.0,
        record_latents=False,
    )


def preference_groups(
    items: list[tuple[PromptSpec, PreferencePair]],
    encoder: Any,
    sampling: SamplingParams,
    *,
    policy_version: int,
    architecture: str = "",
) -> list[DiffusionTrajectoryGroup]:
    """One two-sample group per pair: ``final_latents`` = the encoder's latents of
    (chosen, rejected), the prompt's conditioning, ``rewards.total = [1, 0]``, the images.

    ``encoder`` is a :class:`~omnirl.models.base.SampleEncoder`; prompts and images of all
    pairs are encoded in one call each.
    """
    size = (sampling.height, sampling.width)
    images = torch.stack(
        [load_image(p, size) for _, pair in items for p in (pair.chosen, pair.rejected)]
    )  # uint8 [2P, H, W, 3], pair by pair, chosen first
    latents = encoder.encode_images(images).to(torch.float32)  # [2P, C, h, w]
    conds = encoder.encode_prompts(
        [spec.text for spec, _ in items],
        guidance_scale=sampling.guidance_scale,
        negative_prompt=sampling.negative_prompt,
    )
    groups = []
    for j, ((spec, _), cond) in enumerate(zip(items, conds, strict=True)):
        rows = slice(2 * j, 2 * j + 2)
        groups.append(
            DiffusionTrajectoryGroup(
                group_id=spec.group_id,
                lease_id="offline",
                worker_id="offline",
                prompt=spec,
                sampling=sampling,
                policy_version=policy_version,
                architecture=architecture,
                seeds=torch.zeros(2, dtype=torch.int64),
                final_latents=latents[rows].clone(),
                images=images[rows].clone(),
                rewards=Rewards(
                    group_id=spec.group_id,
                    total=[1.0, 0.0],
                    components={"preference": [1.0, 0.0]},
                    scorer="preference_file",
                ),
                **cond,
            )
        )
    return groups
