"""SD3 training adapter: the transformer (LoRA or full), recomputing recorded transitions.

Only the transformer and the scheduler config are loaded: prompt embeddings arrive with the
trajectories, so the trainer holds no text encoder and no VAE. Log-probs are recomputed
with :func:`omnirl.models.sd3.step.sd3_step`, the function the rollout sampled with.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from omnirl.models.base import DiffusionTrainingAdapter, SampleEncoder, WeightFormat
from omnirl.models.clean_batch import CleanSampleBatch
from omnirl.models.compile import CompileConfig, compile_module, repeated_blocks
from omnirl.models.float8 import (
    Float8Error,
    Float8Training,
    check_float8_device,
    convert_to_float8,
    float8_layers,
)
from omnirl.models.float8_static import (
    float8_active,
    float8_calibration,
    float8_scales,
    load_float8_scales,
    needs_float8_calibration,
    request_float8_calibration,
    set_float8_active,
)
from omnirl.models.registry import register_training_adapter
from omnirl.models.schedulers import FlowMatchSDEScheduler, SDEStepOutput
from omnirl.models.sd3.fused_attention import fuse_projections
from omnirl.models.sd3.lora import add_lora
from omnirl.models.sd3.sampling_rules import check_sd3_sampling, folder_vae_scale_factor
from omnirl.models.sd3.step import SD3Conditioning, guided_velocity, sd3_step, set_schedule
from omnirl.models.transitions import TransitionBatch, shared_inputs
from omnirl.models.weights import full_state, lora_state, lora_targets
from omnirl.protocol.messages import SamplingParams

ARCHITECTURE = "StableDiffusion3Pipeline"


@register_training_adapter(ARCHITECTURE)
class SD3TrainingAdapter(DiffusionTrainingAdapter):
    """The SD3 transformer as a policy over recorded transitions.

    ``transformer`` is the trained module; ``scheduler`` a :class:`FlowMatchSDEScheduler`
    from the model's scheduler config.
    """

    architecture = ARCHITECTURE
    supports_lora = True
    supports_full = True
    supports_cfg = True
    supports_gradient_checkpointing = True

    def __init__(
        self,
        transformer: torch.nn.Module,
        scheduler: FlowMatchSDEScheduler,
        *,
        device: torch.device | str,
        lora: dict[str, Any] | None = None,
        gradient_checkpointing: bool = False,
        path: str | Path | None = None,
    ):
        self.transformer = transformer
        self.model_dtype = transformer.dtype  # before LoRA: adapter weights may be float32
        self.scheduler = scheduler
        self.device = torch.device(device)
        self.path = Path(path) if path is not None else None
        self.lora_config: dict[str, Any] | None = None
        if lora is not None:
            self.lora_config = add_lora(transformer, lora)
        else:
            transformer.requires_grad_(True)
        transformer.to(self.device)
        if gradient_checkpointing:
            transformer.enable_gradient_checkpointing()
        self._reference_model: torch.nn.Module | None = None
        self._in_reference = False
        self.float8: Float8Training | None = None
        self._sigma_max: dict[tuple[int, int, int], float] = {}

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        lora: dict[str, Any] | None = None,
        gradient_checkpointing: bool = False,
    ) -> SD3TrainingAdapter:
        from diffusers import SD3Transformer2DModel

        transformer = SD3Transformer2DModel.from_pretrained(
            path, subfolder="transformer", dtype=dtype
        )
        scheduler = FlowMatchSDEScheduler.from_pretrained(path, subfolder="scheduler")
        return cls(
            transformer,
            scheduler,
            device=device,
            lora=lora,
            gradient_checkpointing=gradient_checkpointing,
            path=path,
        )

    def compile(self, config: CompileConfig) -> list[str]:
        """Compile each transformer block (forward and backward; see
        :mod:`omnirl.models.compile`). Works with gradient checkpointing and inside
        :meth:`reference` (the adapter-disabled forward is one more graph per block variant).
        CUDA graphs (``mode="reduce-overhead"``) are refused: backward replays would need
        static inputs for every micro-batch; they are a rollout option.
        """
        if config.cudagraphs:
            raise ValueError(
                "the training adapter does not run under CUDA graphs (mode='reduce-overhead'); "
                "use mode=None or 'max-autotune-no-cudagraphs'"
            )
        return compile_module(self.transformer, config)

    def enable_float8(self, options: Float8Training | None = None) -> int:
        """The transformer blocks' frozen linear layers as float8 matmuls
        (:mod:`omnirl.models.float8`, "Training"; ``options`` default: row-wise scales,
        float8 input gradient, every pass); the LoRA branches, the adaLN modulation and
        everything outside the blocks stay in the model dtype. Call before :meth:`compile`
        (again to change the options). LoRA runs only: a full fine-tune needs weight
        gradients. Returns how many layers were converted; raises
        :class:`~omnirl.models.float8.Float8Error` on a device without float8 matmuls.
        """
        options = options or Float8Training()
        check_float8_device(self.device)
        if self.lora_config is None:
            raise Float8Error(
                "float8 training needs a LoRA run: a full fine-tune trains every weight, and "
                "a float8 forward computes no weight gradient"
            )
        blocks = repeated_blocks(self.transformer)
        if not blocks:
            raise Float8Error(f"{type(self.transformer).__name__} names no repeated blocks")
        convert_to_float8(blocks)
        layers = float8_layers(self.transformer)
        for layer in layers:
            layer.configure(activation=options.activation, fast_accum=options.fast_accum)
            layer.enable_backward(options.input_grad)
        set_float8_active(self.transformer, options.scope == "all")
        fuse_projections(self.transformer, options.fuse_projections)
        self.float8 = options
        return len(layers)

    def float8_needs_calibration(self) -> bool:
        return self.float8 is not None and needs_float8_calibration(self.transformer)

    def recalibrate_float8(self) -> int:
        return request_float8_calibration(self.transformer) if self.float8 is not None else 0

    def float8_state(self) -> dict[str, Any] | None:
        return float8_scales(self.transformer) if self.float8 is not None else None

    def load_float8_state(self, state: dict[str, Any]) -> int:
        """The checkpoint's scales when this run's layers are static too (the config's
        scaling wins: a row-wise run ignores them)."""
        if self.float8 is None or self.float8.activation != "static":
            return 0
        return load_float8_scales(self.transformer, state)

    def on_update(self, num_updates: int) -> None:
        """Static float8 scales calibrate again every ``recalibrate_every`` updates: the LoRA
        moves the activations (and the samples the reference pass sees), and the margin
        covers only so much."""
        every = self.float8.recalibrate_every if self.float8 is not None else 0
        if every and num_updates % every == 0:
            self.recalibrate_float8()

    @contextlib.contextmanager
    def float8_calibration(self) -> Iterator[None]:
        """Calibrate the static float8 scales on the passes made inside the block (eager,
        row-wise meanwhile); layers of scope ``"reference"`` are switched on for it."""
        if self.float8 is None:
            raise Float8Error("float8 calibration needs enable_float8() first")
        with float8_calibration(self.transformer, margin=self.float8.margin):
            if self.float8.scope == "all":
                yield
            else:
                with float8_active(self.transformer):
                    yield

    def float8_in_policy(self) -> bool:
        return self.float8 is None or self.float8.scope == "all"

    @property
    def weight_format(self) -> WeightFormat:
        return "lora" if self.lora_config is not None else "full"

    def adapter_config(self) -> dict[str, Any]:
        return dict(self.lora_config) if self.lora_config is not None else {}

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        if self.lora_config is not None:
            return list(lora_targets(self.transformer).values())
        return [p for p in self.transformer.parameters() if p.requires_grad]

    # ---------------------------------------------------------------------------- forward

    def _schedule_sigma_max(self, batch: TransitionBatch) -> float:
        """``sigmas[1]`` of the schedule the rollout used (rebuilt the same way, cached)."""
        h, w = batch.latents.shape[-2:]
        key = (batch.num_steps, int(h), int(w))
        if key not in self._sigma_max:
            _, sigmas = set_schedule(
                self.scheduler, batch.num_steps, (h, w), self.transformer.config.patch_size, "cpu"
            )
            self._sigma_max[key] = float(sigmas[1])
        return self._sigma_max[key]

    def transition(self, batch: TransitionBatch, *, sde_type: str) -> SDEStepOutput:
        model = self._reference_model if self._in_reference else self.transformer
        dev = self.device
        cond = SD3Conditioning(
            prompt_embeds=batch.prompt_embeds.to(dev),
            pooled_prompt_embeds=batch.pooled_prompt_embeds.to(dev),
            negative_prompt_embeds=_to(batch.negative_prompt_embeds, dev),
            negative_pooled_prompt_embeds=_to(batch.negative_pooled_prompt_embeds, dev),
        )
        return sd3_step(
            model,
            self.scheduler,
            batch.latents.to(dev),
            batch.timesteps.to(dev),
            batch.sigmas.to(dev),
            batch.next_sigmas.to(dev),
            cond,
            batch.guidance_scale,
            sde_type=sde_type,
            noise_level=batch.noise_levels.to(dev),
            sigma_max=self._schedule_sigma_max(batch),
            prev_sample=batch.next_latents.to(dev),
            model_dtype=self.model_dtype,
            shared=shared_inputs(_to(batch.input_id, dev)),
        )

    # ------------------------------------------------------- forward-process objectives

    def velocity(self, latents: Tensor, timesteps: Tensor, batch: CleanSampleBatch) -> Tensor:
        """The policy's guided velocity float32 ``[B, C, H, W]`` at noisy ``latents``.

        ``latents`` float32 ``[B, C, H, W]`` (``x_t``), ``timesteps`` float32 ``[B]``
        (``1000 * t``); conditioning and guidance scale from ``batch``. The same function as
        the rollout's step (:func:`guided_velocity`); differentiable w.r.t. the trainable
        parameters; inside :meth:`reference`, the reference policy's.
        """
        model = self._reference_model if self._in_reference else self.transformer
        dev = self.device
        cond = SD3Conditioning(
            prompt_embeds=batch.prompt_embeds.to(dev),
            pooled_prompt_embeds=batch.pooled_prompt_embeds.to(dev),
            negative_prompt_embeds=_to(batch.negative_prompt_embeds, dev),
            negative_pooled_prompt_embeds=_to(batch.negative_pooled_prompt_embeds, dev),
        )
        return guided_velocity(
            model,
            latents.to(dev),
            timesteps.to(dev),
            cond,
            batch.guidance_scale,
            model_dtype=self.model_dtype,
        )

    def check_sampling(self, sampling: SamplingParams) -> None:
        """The rollout's rules (:func:`~omnirl.models.sd3.sampling_rules.check_sd3_sampling`);
        the size rule needs the VAE's scale factor, read from the model folder's config
        (skipped for a transformer built without a folder)."""
        vae_factor = folder_vae_scale_factor(self.path) if self.path is not None else None
        check_sd3_sampling(
            sampling,
            sde_types=self.sde_types,
            size_multiple=None
            if vae_factor is None
            else vae_factor * self.transformer.config.patch_size,
        )

    def sampling_sigmas(self, num_steps: int, latent_hw: tuple[int, int]) -> Tensor:
        """The rollout's schedule ``sigmas`` float32 ``[T]`` (without the terminal 0), CPU."""
        _, sigmas = set_schedule(
            self.scheduler, num_steps, latent_hw, self.transformer.config.patch_size, "cpu"
        )
        return sigmas[:-1].clone()

    def sample_encoder(self) -> SampleEncoder:
        """The folder's text encoders and VAE (:class:`SD3SampleEncoder`), on this device."""
        from omnirl.models.sd3.encoder import SD3SampleEncoder

        if self.path is None:
            raise RuntimeError("sample_encoder() needs the model path (from_pretrained)")
        return SD3SampleEncoder.from_pretrained(
            self.path, device=self.device, dtype=self.model_dtype
        )

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """LoRA: the adapter disabled. Full: the pretrained weights, loaded from disk on first
        use (so the copy costs memory only when a KL to the reference is asked for)."""
        if self.lora_config is not None:
            self.transformer.disable_adapters()
            try:
                if self.float8 is not None and self.float8.scope == "reference":
                    with float8_active(self.transformer):
                        yield
                else:
                    yield
            finally:
                self.transformer.enable_adapters()
            return
        if self._reference_model is None:
            self._reference_model = self._load_reference()
        self._in_reference = True
        try:
            yield
        finally:
            self._in_reference = False

    def _load_reference(self) -> torch.nn.Module:
        from diffusers import SD3Transformer2DModel

        if self.path is None:
            raise RuntimeError("full fine-tuning reference needs the model path (from_pretrained)")
        ref = SD3Transformer2DModel.from_pretrained(
            self.path, subfolder="transformer", dtype=self.transformer.dtype
        )
        return ref.to(self.device).requires_grad_(False).eval()

    # ---------------------------------------------------------------------------- weights

    def export_weights(self) -> dict[str, Tensor]:
        if self.lora_config is not None:
            return lora_state(self.transformer)
        return full_state(self.transformer)

    def save_pretrained(self, directory: str | Path) -> None:
        """LoRA: ``pytorch_lora_weights.safetensors`` loadable by
        ``StableDiffusion3Pipeline.load_lora_weights(directory)``; full: the transformer folder."""
        directory = Path(directory)
        if self.lora_config is None:
            self.transformer.save_pretrained(directory / "transformer")
            return
        from diffusers import StableDiffusion3Pipeline
        from peft.utils import get_peft_model_state_dict

        layers = get_peft_model_state_dict(self.transformer)
        StableDiffusion3Pipeline.save_lora_weights(
            directory, transformer_lora_layers=layers, safe_serialization=True
        )


def _to(t: Tensor | None, device: torch.device) -> Tensor | None:
    return None if t is None else t.to(device)
