"""What SD3 can sample: the rules a lease's ``SamplingParams`` must meet.

The rollout adapter checks them before it samples a lease; the trainer checks the run's
parameters against the same rules before it issues any (the training adapter, which loads no
VAE, reads the VAE's scale factor from the model folder's ``vae/config.json``).
"""

from __future__ import annotations

import json
from pathlib import Path

from omnirl.models.base import SamplingParamsError, check_common_sampling
from omnirl.protocol.messages import SamplingParams


class SamplingError(SamplingParamsError):
    """Sampling parameters the model cannot honour (size, sde type, empty group)."""


def check_sd3_sampling(
    sampling: SamplingParams, *, sde_types: tuple[str, ...], size_multiple: int | None
) -> None:
    """Raise :class:`SamplingError` naming the first rule ``sampling`` breaks.

    ``size_multiple``: the VAE's scale factor times the transformer's patch size (height and
    width must be positive multiples of it); ``None`` skips the size rule.
    """
    check_common_sampling(sampling, sde_types, SamplingError)
    m = size_multiple
    if m is not None and (sampling.height % m or sampling.width % m or sampling.height <= 0):
        raise SamplingError(
            f"height and width must be positive multiples of {m}, "
            f"got {sampling.height}x{sampling.width}"
        )


def folder_vae_scale_factor(path: str | Path) -> int | None:
    """The VAE's spatial down-scaling factor of the SD3 folder at ``path``, from its
    ``vae/config.json`` (``2 ** (len(block_out_channels) - 1)``, as diffusers' pipeline
    computes it); ``None`` without that file."""
    config = Path(path) / "vae" / "config.json"
    if not config.is_file():
        return None
    blocks = json.loads(config.read_text()).get("block_out_channels")
    return 2 ** (len(blocks) - 1) if blocks else None
