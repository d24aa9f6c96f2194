"""Abstract bases of the two adapters every diffusion model family provides.

The rollout adapter samples trajectories and records what the trainer needs; the training
adapter recomputes the policy's distribution of those recorded transitions. The two must
agree exactly: on-policy, ``exp(logp_train - logp_rollout) == 1`` within 1e-5 in float32.
A family achieves that by sharing one function for the guided velocity between both.

Capabilities are class attributes, read by the runtime before it builds anything.
Shapes: ``G`` samples per group, ``K`` recorded steps, ``B`` rows of a
:class:`~omnirl.models.transitions.TransitionBatch`, ``C, H, W`` latent dims.
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from torch import Tensor

if TYPE_CHECKING:
    from omnirl.models.compile import CompileConfig
    from omnirl.models.float8 import Float8Training
    from omnirl.models.schedulers import SDEStepOutput
    from omnirl.models.transitions import TransitionBatch
    from omnirl.protocol.messages import DiffusionTrajectoryGroup, PromptSpec, SamplingParams

WeightFormat = Literal["lora", "full"]


def sample_seeds(seed: int, group_id: str, group_size: int) -> Tensor:
    """The per-sample seeds int64 ``[G]`` of a group, a pure function of its inputs.

    ``seeds[i]`` = the first 8 bytes (little endian) of ``blake2b("{seed}/{group_id}/{i}")``,
    masked to 63 bits. A sample's noise (initial and per step) is drawn from its own seed
    only, so it does not depend on the lease, the worker, or which samples share its batch;
    a reissued lease reproduces the same trajectories.
    """
    values = []
    for i in range(group_size):
        digest = hashlib.blake2b(f"{seed}/{group_id}/{i}".encode(), digest_size=8).digest()
        values.append(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    return torch.tensor(values, dtype=torch.int64)


class SamplingParamsError(ValueError):
    """The model cannot honour a lease's sampling parameters (a size, an SDE type, a group
    size): a property of the run's configuration, so every worker would fail the same way.
    A rollout adapter raises it (or a subclass) before it samples anything."""


def check_common_sampling(
    sampling: SamplingParams,
    sde_types: tuple[str, ...],
    error: type[SamplingParamsError] = SamplingParamsError,
) -> None:
    """The rules every family shares: a group of at least one sample, an SDE variant the
    family has. Raises ``error`` naming the first one ``sampling`` breaks."""
    if sampling.group_size < 1:
        raise error(f"group_size must be >= 1, got {sampling.group_size}")
    if sampling.sde_type not in sde_types:
        raise error(f"unknown sde_type {sampling.sde_type!r}; known: {sde_types}")


class WeightLoadError(ValueError):
    """A weight update does not fit the model (unknown name, wrong shape or dtype)."""


class DiffusionRolloutAdapter(abc.ABC):
    """Samples groups of trajectories with log-prob recording (the behaviour policy)."""

    architecture: ClassVar[str] = ""  # registry key, e.g. "StableDiffusion3Pipeline"
    supports_lora: ClassVar[bool] = False
    supports_full: ClassVar[bool] = False
    supports_cfg: ClassVar[bool] = False
    supports_lora_merge: ClassVar[bool] = False  # :meth:`merge_lora` (a forward-only rollout)
    supports_decode_batch: ClassVar[bool] = False  # :meth:`set_decode_batch`
    decode_batch: int = 0  # images per VAE call (0: a lease's images in one call)
    sde_types: ClassVar[tuple[str, ...]] = ("sde", "cps", "dance_sde", "ode")

    @classmethod
    @abc.abstractmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        lora: dict[str, Any] | None = None,
    ) -> DiffusionRolloutAdapter:
        """Load the model folder at ``path`` onto ``device`` in ``dtype``.

        ``lora``: PEFT ``LoraConfig`` keyword arguments (``r``, ``lora_alpha``,
        ``target_modules``, ``init_lora_weights``); when given, an adapter of that shape is
        added so that ``load_weights("lora", ...)`` has somewhere to go.
        """

    @abc.abstractmethod
    def sample(
        self,
        prompts: list[PromptSpec],
        sampling: SamplingParams,
        *,
        lease_id: str,
        worker_id: str,
        policy_version: int,
    ) -> list[DiffusionTrajectoryGroup]:
        """Sample ``sampling.group_size`` trajectories for each prompt; one group per prompt.

        Each group records, for its ``K`` window steps: ``step_indices [K]``,
        ``timesteps/sigmas/next_sigmas/noise_levels [K]`` (float32), ``latents`` and
        ``next_latents [G, K, C, H, W]`` and ``log_probs [G, K]`` (float32), plus
        ``final_latents [G, C, H, W]``, ``images`` uint8 ``[G, H, W, 3]`` when
        ``sampling.record_images``, and its conditioning once (``prompt_embeds [L, D]`` ...).
        A sample's trajectory depends only on its seed, never on its batch neighbours
        (up to the model's own batch-composition effects in the low bits).
        """

    @abc.abstractmethod
    def load_weights(self, format: WeightFormat, tensors: dict[str, Tensor]) -> None:
        """Apply a weight update atomically: validate every name, shape and dtype first,
        then copy; a bad update raises :class:`WeightLoadError` and leaves the model as it was.
        """

    def compile(self, config: CompileConfig) -> list[str]:
        """Switch to the compiled backend (:mod:`omnirl.models.compile`); return what was
        compiled. A family without one raises ``NotImplementedError``."""
        raise NotImplementedError(f"{type(self).__name__} has no compiled backend")

    def compile_decoder(self, config: CompileConfig) -> list[str]:
        """Compile the image decoder (a VAE's) whole, beside the denoiser's compiled backend:
        the rollout decodes every image it samples. Same images up to kernel rounding; one
        graph per decode batch size. A family without one raises ``NotImplementedError``."""
        raise NotImplementedError(f"{type(self).__name__} has no compiled decoder")

    def merge_lora(self) -> None:
        """Fold the LoRA adapter into the base weights, now and after every LoRA update
        (:mod:`omnirl.models.lora_merge`). A family without it raises ``NotImplementedError``."""
        raise NotImplementedError(f"{type(self).__name__} cannot merge its LoRA adapter")

    def enable_float8(
        self,
        *,
        activation: str = "rowwise",
        fast_accum: bool = False,
        margin: float = 2.0,
        fuse_projections: bool = False,
    ) -> int:
        """Run the denoiser's block linear layers in float8 (:mod:`omnirl.models.float8`:
        ``activation`` scaling ``"rowwise"`` or ``"static"`` with calibration ``margin``,
        ``fast_accum``; ``fuse_projections``: sibling projections of one input, such as an
        attention's q, k and v, as one float8 matmul, :mod:`omnirl.models.float8_fused`);
        return how many were converted. A family without it raises
        ``NotImplementedError``."""
        raise NotImplementedError(f"{type(self).__name__} has no float8 linear layers")

    def float8_needs_calibration(self) -> bool:
        """Whether the next :meth:`sample` calibrates static float8 scales (and so runs
        eagerly, whatever the backend)."""
        return False

    def set_decode_batch(self, images: int) -> None:
        """Decode at most ``images`` images per VAE call (0: a lease's images in one call).
        The decoder's activations at full resolution are what peaks a rollout's memory; a
        smaller batch lowers the peak and gives the same images. A family whose ``sample``
        does not honour :attr:`decode_batch` (``supports_decode_batch`` false) raises
        ``NotImplementedError`` for a positive value."""
        if images < 0:
            raise ValueError(f"decode batch must be >= 0 images, got {images}")
        if images and not self.supports_decode_batch:
            raise NotImplementedError(f"{type(self).__name__} has no decode batch")
        self.decode_batch = images

    def recalibrate_float8(self) -> int:
        """Have the next :meth:`sample` calibrate the static float8 scales again; returns how
        many layers will (0: a model without static float8 layers)."""
        return 0


class SampleEncoder(abc.ABC):
    """Turns prompts and finished images into what a trajectory group carries.

    The trainer's offline modes (a preference file of images) need the conditioning and the
    clean latents ``x0`` that a rollout of the family would have recorded; the training
    adapter holds neither text encoders nor an image encoder, so it hands out one of these
    (:meth:`DiffusionTrainingAdapter.sample_encoder`). Prompt encoding must be the rollout
    adapter's own, byte for byte (DESIGN.md, "Numerics").
    """

    @abc.abstractmethod
    def encode_prompts(
        self, texts: list[str], *, guidance_scale: float, negative_prompt: str = ""
    ) -> list[dict[str, Tensor]]:
        """Per text, its group's conditioning fields as the rollout records them
        (``prompt_embeds [L, D]``, ``pooled_prompt_embeds [D']``, and the negatives when
        ``guidance_scale > 1``); CPU tensors."""

    @abc.abstractmethod
    def encode_images(self, images: Tensor) -> Tensor:
        """uint8 images ``[B, H, W, 3]`` -> clean latents float32 ``[B, C, h, w]`` (CPU), the
        inverse of the rollout's decoding (exact in pixel space; up to the autoencoder's
        error with a VAE)."""


class DiffusionTrainingAdapter(abc.ABC):
    """Holds the trainable module and recomputes the distribution of recorded transitions."""

    architecture: ClassVar[str] = ""
    supports_lora: ClassVar[bool] = False
    supports_full: ClassVar[bool] = False
    supports_cfg: ClassVar[bool] = False
    supports_gradient_checkpointing: ClassVar[bool] = False
    sde_types: ClassVar[tuple[str, ...]] = ("sde", "cps", "dance_sde", "ode")

    @classmethod
    @abc.abstractmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        lora: dict[str, Any] | None = None,
        gradient_checkpointing: bool = False,
    ) -> DiffusionTrainingAdapter:
        """Load only what training needs (no text encoders: embeddings come recorded).

        ``lora``: PEFT ``LoraConfig`` kwargs for LoRA training; ``None``: full fine-tuning.
        """

    @property
    @abc.abstractmethod
    def weight_format(self) -> WeightFormat:
        """``"lora"`` or ``"full"``: what :meth:`export_weights` returns."""

    def adapter_config(self) -> dict[str, Any]:
        """PEFT ``LoraConfig`` fields of the adapter (``{}`` for full fine-tuning)."""
        return {}

    @abc.abstractmethod
    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters the optimiser updates (adapter weights only under LoRA)."""

    @abc.abstractmethod
    def transition(self, batch: TransitionBatch, *, sde_type: str) -> SDEStepOutput:
        """Recompute ``log p(next_latents | latents)`` under the current policy.

        Uses the same guided-velocity function as the rollout (CFG included). Returns the
        scheduler's output: ``log_prob [B]``, ``prev_sample_mean [B, C, H, W]``,
        ``std_dev_t [B]``, ``step_std [B]``, all float32, differentiable w.r.t.
        :meth:`trainable_parameters`.
        """

    @abc.abstractmethod
    def reference(self) -> contextlib.AbstractContextManager[None]:
        """Context in which :meth:`transition` computes the reference policy.

        LoRA: the adapter disabled. Full: a frozen copy of the initial weights, made lazily.
        """

    def check_sampling(self, sampling: SamplingParams) -> None:
        """Raise :class:`SamplingParamsError` for sampling parameters the model cannot
        honour, as its rollout adapter would on the first lease: the trainer checks the run's
        before it issues any. The base checks the group size and the SDE variant; a family
        adds its own rules (SD3: the image size)."""
        check_common_sampling(sampling, self.sde_types)

    def velocity(self, latents: Tensor, timesteps: Tensor, batch: Any) -> Tensor:
        """The policy's velocity float32 ``[B, C, H, W]`` at noisy ``latents`` ``[B, C, H, W]``
        and ``timesteps`` ``[B]``, conditioned on a
        :class:`~omnirl.models.clean_batch.CleanSampleBatch`. Forward-process objectives
        (DiffusionNFT, Diffusion-DPO) need it; a family that lacks it cannot run them."""
        raise NotImplementedError(
            f"{type(self).__name__} has no velocity(); forward-process objectives "
            "(diffusion_nft, diffusion_dpo) need it"
        )

    def sampling_sigmas(self, num_steps: int, latent_hw: tuple[int, int]) -> Tensor:
        """The rollout's sampling schedule ``sigmas`` float32 ``[T]`` (no terminal 0)."""
        raise NotImplementedError(
            f"{type(self).__name__} has no sampling_sigmas(); forward-process objectives need it"
        )

    def sample_encoder(self) -> SampleEncoder:
        """A :class:`SampleEncoder` of this model (loads its text and image encoders; the
        trainer's offline preference mode needs it)."""
        raise NotImplementedError(
            f"{type(self).__name__} has no sample_encoder(); offline preference training needs it"
        )

    def compile(self, config: CompileConfig) -> list[str]:
        """Compile the trained module (:mod:`omnirl.models.compile`); return what was
        compiled. A family without it raises ``NotImplementedError``."""
        raise NotImplementedError(f"{type(self).__name__} cannot be compiled")

    def enable_float8(self, options: Float8Training | None = None) -> int:
        """Run the denoiser's frozen block linear layers in float8 as ``options`` say
        (:mod:`omnirl.models.float8`, "Training"); return how many were converted. A family
        without it raises ``NotImplementedError``."""
        raise NotImplementedError(f"{type(self).__name__} has no float8 training")

    def float8_needs_calibration(self) -> bool:
        """Whether static float8 scales must be calibrated (:meth:`float8_calibration`)
        before the next pass that computes log-probs."""
        return False

    def recalibrate_float8(self) -> int:
        """Have :meth:`float8_needs_calibration` ask again; returns how many layers will
        calibrate (0: no static float8 layers)."""
        return 0

    def float8_state(self) -> dict[str, Any] | None:
        """The calibrated static float8 scales, for a checkpoint (``None``: none to keep)."""
        return None

    def load_float8_state(self, state: dict[str, Any]) -> int:
        """Put :meth:`float8_state`'s ``state`` back; returns how many layers took a scale
        (0: this trainer runs no static float8 layers, and calibrates its own if it does)."""
        return 0

    def on_update(self, num_updates: int) -> None:
        """Called after each optimiser update (``num_updates`` so far); by default nothing."""
        return None

    def float8_calibration(self) -> contextlib.AbstractContextManager[None]:
        """A context whose passes calibrate the static float8 scales."""
        raise NotImplementedError(f"{type(self).__name__} has no float8 training")

    def float8_in_policy(self) -> bool:
        """Whether the policy's own passes run in float8 (so calibrate on them); False when
        float8 covers only the KL reference pass (``train.float8_scope: reference``)."""
        return True

    @torch.no_grad()
    def calibrate_float8(
        self, batches: Sequence[TransitionBatch], *, sde_type: str, reference: bool
    ) -> None:
        """Fix the static float8 scales on one no-grad pass over ``batches`` (a trainer: the
        first micro-batch of every trained step), and over :meth:`reference` with
        ``reference`` (a loss with a KL term). A trainer calls it before any log-prob of a
        step, so the proximal, policy and reference passes of the step quantise alike; with
        the same rows on every data-parallel rank the replicas share their scales. A
        trainer whose float8 covers the reference pass alone calibrates on that pass alone
        (the inputs its layers will see; the policy pass would cost a pass and widen the
        range by the adapter's share)."""
        policy = self.float8_in_policy()
        with self.float8_calibration():
            for batch in batches:
                if policy:
                    self.transition(batch, sde_type=sde_type)
                if reference:
                    with self.reference():
                        self.transition(batch, sde_type=sde_type)

    @abc.abstractmethod
    def export_weights(self) -> dict[str, Tensor]:
        """What a weight update carries: LoRA tensors only, or every transformer weight.

        Tensors are detached, contiguous and on the CPU; names match what the rollout
        adapter's :meth:`DiffusionRolloutAdapter.load_weights` expects.
        """

    @abc.abstractmethod
    def save_pretrained(self, directory: str | Path) -> None:
        """Save the trainable weights in the model family's native format."""
