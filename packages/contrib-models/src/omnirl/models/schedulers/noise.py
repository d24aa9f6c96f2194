"""Per-sample noise: a sample's noise depends only on (its seed, the step), never on its batch.

Each sample gets its own ``torch.Generator`` seeded with a 63-bit key mixed from
``(seed, stream)``; stream ``step_index`` (0 .. T-1) is the noise of SDE step ``step_index``
and stream ``-1`` is the initial latent x_T. Mixing uses two rounds of splitmix64, so nearby
seeds and nearby steps give unrelated streams.

The generator lives on ``generator_device`` (default: the output device). CPU and CUDA
generators produce different numbers for the same key, so noise is reproducible per device
type; pass ``generator_device="cpu"`` to get the same noise on every machine (slower on GPU).
"""

from collections.abc import Sequence

import torch

from omnirl.models.schedulers.errors import SchedulerInputError

INITIAL_NOISE_STEP = -1
_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def stream_key(seed: int, step_index: int) -> int:
    """The 63-bit generator seed of sample ``seed`` at ``step_index`` (-1: initial noise)."""
    return _splitmix64((_splitmix64(seed & _MASK64) + step_index + 1) & _MASK64) >> 1


def _seed_list(seeds: torch.Tensor | Sequence[int]) -> list[int]:
    if isinstance(seeds, torch.Tensor):
        if seeds.dtype.is_floating_point or seeds.dtype.is_complex or seeds.dtype == torch.bool:
            raise SchedulerInputError(f"seeds must be an integer tensor, got {seeds.dtype}")
        if seeds.ndim != 1:
            raise SchedulerInputError(f"seeds must be 1-D [B], got shape {tuple(seeds.shape)}")
        return [int(s) for s in seeds.tolist()]
    out = list(seeds)
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in out):
        raise SchedulerInputError("seeds must be integers")
    return out


def per_sample_noise(
    seeds: torch.Tensor | Sequence[int],
    step_index: int,
    shape: Sequence[int],
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    generator_device: torch.device | str | None = None,
) -> torch.Tensor:
    """Standard normal noise ``[B, *shape]``; row i depends only on ``(seeds[i], step_index)``.

    Args:
        seeds: int64 ``[B]`` (or a list of ints), one seed per sample.
        step_index: index of the SDE step in the sampling schedule; ``-1`` is the initial noise.
        shape: per-sample shape, e.g. ``(C, H, W)``.
        device: where the result lives (default CPU).
        dtype: result dtype; noise is drawn in float32 and cast.
        generator_device: where the numbers are drawn (default ``device``).
    """
    if isinstance(step_index, bool) or not isinstance(step_index, int) or step_index < -1:
        raise SchedulerInputError(f"step_index must be an int >= -1, got {step_index!r}")
    shape = tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
        raise SchedulerInputError(f"shape must be non-negative, got {shape}")
    seed_values = _seed_list(seeds)
    device = torch.device(device) if device is not None else torch.device("cpu")
    gen_device = torch.device(generator_device) if generator_device is not None else device
    out = torch.empty((len(seed_values), *shape), device=gen_device, dtype=torch.float32)
    gen = torch.Generator(device=gen_device)  # reseeded per sample: one stream per (seed, step)
    for i, seed in enumerate(seed_values):
        gen.manual_seed(stream_key(seed, step_index))
        torch.randn(shape, generator=gen, out=out[i])
    return out.to(device=device, dtype=dtype)


def initial_noise(
    seeds: torch.Tensor | Sequence[int],
    shape: Sequence[int],
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    generator_device: torch.device | str | None = None,
) -> torch.Tensor:
    """The initial latent x_T ``[B, *shape]`` of each sample (stream ``-1``)."""
    return per_sample_noise(
        seeds,
        INITIAL_NOISE_STEP,
        shape,
        device=device,
        dtype=dtype,
        generator_device=generator_device,
    )
