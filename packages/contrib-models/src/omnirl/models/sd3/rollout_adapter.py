"""SD3 rollout adapter: samples trajectory groups with log-prob recording on diffusers.

Per lease: the prompts are encoded once with the pipeline's own ``encode_prompt`` (CLIP x2 +
T5, negatives when ``guidance_scale > 1``), all ``N x G`` samples denoise together in one
batch (``2 N G`` rows through the transformer with CFG), and each group records its SDE
window. Seeds: :func:`omnirl.models.base.sample_seeds` ``(sampling.seed, group_id, i)``;
initial noise from each sample's seed (``same_initial_noise``: from the group's sample 0),
step noise from ``per_sample_noise(seed, step_index)``.

Backends: ``"diffusers"`` (eager PyTorch, the default and the parity reference) and
``"compiled"`` (:meth:`SD3RolloutAdapter.compile`: each transformer block compiled, see
:mod:`omnirl.models.compile`). Both run the same loop and the same float32 scheduler.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from omnirl.models.base import (
    DiffusionRolloutAdapter,
    WeightFormat,
    WeightLoadError,
    sample_seeds,
)
from omnirl.models.compile import CompileConfig, compile_module, repeated_blocks, step_begin
from omnirl.models.device import synchronize
from omnirl.models.float8 import (
    DEFAULT_MARGIN,
    Float8Error,
    check_float8_device,
    configure_float8,
    convert_to_float8,
    refresh_float8,
)
from omnirl.models.float8_static import (
    float8_calibration,
    needs_float8_calibration,
    request_float8_calibration,
)
from omnirl.models.host_steps import HostSteps
from omnirl.models.lora_merge import MergedLora
from omnirl.models.registry import register_rollout_adapter
from omnirl.models.schedulers import (
    FlowMatchSDEScheduler,
    initial_noise,
    noise_levels,
    per_sample_noise,
    window_mask,
)
from omnirl.models.sd3.encoder import (
    compile_vae_decoder,
    default_max_sequence_length,
    encode_sd3_prompts,
    vae_decode,
)
from omnirl.models.sd3.fused_attention import fuse_projections as fuse_sd3_projections
from omnirl.models.sd3.lora import add_lora
from omnirl.models.sd3.sampling_rules import check_sd3_sampling
from omnirl.models.sd3.step import SD3Conditioning, sd3_step, set_schedule
from omnirl.models.transitions import SharedInputs
from omnirl.models.weights import apply_named_tensors, full_targets, lora_targets
from omnirl.protocol.messages import DiffusionTrajectoryGroup, PromptSpec, SamplingParams

ARCHITECTURE = "StableDiffusion3Pipeline"


@register_rollout_adapter(ARCHITECTURE)
class SD3RolloutAdapter(DiffusionRolloutAdapter):
    """``StableDiffusion3Pipeline`` behind the rollout contract.

    ``pipeline`` is the loaded diffusers pipeline (its own scheduler untouched);
    ``scheduler`` the :class:`FlowMatchSDEScheduler` built from its config.
    """

    architecture = ARCHITECTURE
    supports_lora = True
    supports_full = True
    supports_cfg = True
    supports_lora_merge = True
    supports_decode_batch = True

    def __init__(
        self,
        pipeline,
        *,
        device: torch.device | str,
        lora: dict[str, Any] | None = None,
        max_sequence_length: int | None = None,
    ):
        self.pipeline = pipeline
        self.transformer = pipeline.transformer
        self.model_dtype = self.transformer.dtype
        self.device = torch.device(device)
        self.scheduler = FlowMatchSDEScheduler.from_config(pipeline.scheduler.config)
        self.max_sequence_length = max_sequence_length or default_max_sequence_length(pipeline)
        self.lora_config: dict[str, Any] | None = None
        if lora is not None:
            self.lora_config = add_lora(self.transformer, lora)
            self.transformer.to(self.device)
        self.transformer.eval()
        self.backend = "diffusers"
        self.compile_config: CompileConfig | None = None
        self.float8 = False
        self.float8_margin = DEFAULT_MARGIN
        self.merged_lora: MergedLora | None = None

    def compile(self, config: CompileConfig) -> list[str]:
        """Switch to the ``"compiled"`` backend: each transformer block compiled.

        Graphs are built at the first lease of each shape (batch rows, resolution); text
        length is fixed by the tokenizers. Weight updates copy into the same parameters,
        so they never recompile; a LoRA adapter created by the first update does, once.
        """
        names = compile_module(self.transformer, config)
        self.compile_config = config
        self.backend = "compiled"
        return names

    def compile_decoder(self, config: CompileConfig) -> list[str]:
        """The VAE decoder compiled whole (:func:`compile_vae_decoder`)."""
        return compile_vae_decoder(self.pipeline.vae, config)

    def merge_lora(self) -> None:
        """Run the LoRA adapter folded into the base weights (:mod:`omnirl.models.lora_merge`):
        now if one exists, and after every LoRA update from here on (including the update
        that creates it). Meant for float32 models; a bf16 merge rounds small deltas away."""
        if self.lora_config is not None and self.lora_config.get("use_dora"):
            raise WeightLoadError("a DoRA adapter cannot be merged; run it as an adapter")
        self.merged_lora = MergedLora(self.transformer)
        if self.lora_config is not None:
            self.merged_lora.refresh()

    def enable_float8(
        self,
        *,
        activation: str = "rowwise",
        fast_accum: bool = False,
        margin: float = DEFAULT_MARGIN,
        fuse_projections: bool = False,
    ) -> int:
        """Convert the transformer blocks' linear layers to scaled float8 matmuls
        (:mod:`omnirl.models.float8`); returns how many. Call before :meth:`compile` (a later
        call recompiles once); calling again re-configures the converted layers.
        ``fuse_projections``: each attention's q, k and v (per stream) as one float8 matmul
        (:mod:`omnirl.models.float8_fused`).
        ``activation="static"``: the next :meth:`sample` call runs eagerly and calibrates the
        layers' input scales (``margin`` x the largest input seen), the ones after it use
        them. Full-weight updates re-quantise the weights (and recalibrate static scales on
        the next call); LoRA updates leave both alone (the adapter branch runs in the model
        dtype). Raises :class:`~omnirl.models.float8.Float8Error` on a device without float8
        matmuls or for an unknown scaling.
        """
        check_float8_device(self.device)
        blocks = repeated_blocks(self.transformer)
        if not blocks:
            raise Float8Error(f"{type(self.transformer).__name__} names no repeated blocks")
        if margin < 1:
            raise Float8Error(f"float8 calibration margin must be >= 1, got {margin}")
        convert_to_float8(blocks, activation=activation, fast_accum=fast_accum)
        count = configure_float8(self.transformer, activation=activation, fast_accum=fast_accum)
        fuse_sd3_projections(self.transformer, fuse_projections)
        self.float8 = True
        self.float8_margin = margin
        return count

    def float8_needs_calibration(self) -> bool:
        return self.float8 and needs_float8_calibration(self.transformer)

    def recalibrate_float8(self) -> int:
        return request_float8_calibration(self.transformer) if self.float8 else 0

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        lora: dict[str, Any] | None = None,
        max_sequence_length: int | None = None,
    ) -> SD3RolloutAdapter:
        from diffusers import StableDiffusion3Pipeline

        pipe = StableDiffusion3Pipeline.from_pretrained(path, dtype=dtype)
        pipe.to(device)
        pipe.set_progress_bar_config(disable=True)
        return cls(pipe, device=device, lora=lora, max_sequence_length=max_sequence_length)

    # ------------------------------------------------------------------------------ weights

    def load_weights(
        self,
        format: WeightFormat,
        tensors: dict[str, Tensor],
        *,
        adapter_config: dict[str, Any] | None = None,
    ) -> None:
        """Apply a ``"lora"`` (PEFT keys) or ``"full"`` (state-dict keys) update atomically.

        A LoRA update to a model without an adapter creates one from ``adapter_config``
        (``WeightUpdate.adapter_config``) first. Raises :class:`WeightLoadError`.
        """
        if format == "lora":
            if self.lora_config is None:
                if not adapter_config:
                    raise WeightLoadError(
                        "LoRA update for a model without a LoRA adapter and no adapter_config"
                    )
                if self.merged_lora is not None and adapter_config.get("use_dora"):
                    raise WeightLoadError("a DoRA adapter cannot be merged; run it as an adapter")
                self.lora_config = add_lora(self.transformer, adapter_config)
                self.transformer.to(self.device)
            targets = lora_targets(self.transformer)
        elif format == "full":
            targets = full_targets(self.transformer)
        else:
            raise WeightLoadError(f"unknown weight format {format!r}; known: 'lora', 'full'")
        apply_named_tensors(targets, tensors, strict=True)
        if format == "lora" and self.merged_lora is not None:
            self.merged_lora.refresh()
        if format == "full" and self.float8:
            refresh_float8(self.transformer)

    # ----------------------------------------------------------------------------- sampling

    def _check(self, prompts: list[PromptSpec], sampling: SamplingParams) -> tuple[int, int]:
        check_sd3_sampling(
            sampling,
            sde_types=self.sde_types,
            size_multiple=self.pipeline.vae_scale_factor * self.transformer.config.patch_size,
        )
        ids = [p.group_id for p in prompts]
        if len(set(ids)) != len(ids):
            # the lease's content, not the run's parameters: a reissue (one group a lease) works
            raise ValueError(f"duplicate group_id in one lease: {ids}")
        f = self.pipeline.vae_scale_factor
        return sampling.height // f, sampling.width // f

    def _encode(self, texts: list[str], sampling: SamplingParams, do_cfg: bool) -> SD3Conditioning:
        return encode_sd3_prompts(
            self.pipeline,
            texts,
            device=self.device,
            do_cfg=do_cfg,
            negative_prompt=sampling.negative_prompt,
            max_sequence_length=self.max_sequence_length,
        )

    @torch.no_grad()
    def sample(
        self,
        prompts: list[PromptSpec],
        sampling: SamplingParams,
        *,
        lease_id: str,
        worker_id: str,
        policy_version: int,
    ) -> list[DiffusionTrajectoryGroup]:
        """Sample one group of ``sampling.group_size`` trajectories per prompt (the first
        call after static float8 scaling is enabled also calibrates it; see
        :meth:`enable_float8`)."""
        if not prompts:
            return []
        calibration = (
            float8_calibration(self.transformer, margin=self.float8_margin)
            if self.float8_needs_calibration()
            else contextlib.nullcontext()
        )
        with calibration:
            t_start = time.perf_counter()
            latent_h, latent_w = self._check(prompts, sampling)
            n, g, dev = len(prompts), sampling.group_size, self.device
            do_cfg = sampling.guidance_scale > 1.0
            num_steps = sampling.num_steps
            window = tuple(sampling.sde_window) if sampling.sde_window is not None else None
            trained = window_mask(num_steps, window)  # [T] bool
            levels = noise_levels(num_steps, sampling.noise_level, window)  # [T] float32
            recorded = [int(i) for i in torch.nonzero(trained).flatten()]
            if sampling.sde_type == "ode":
                recorded = []

            # conditioning once per prompt; rows of the batch index into it
            group_cond = self._encode([p.text for p in prompts], sampling, do_cfg)
            row_group = torch.arange(n, device=dev).repeat_interleave(g)  # [N*G]
            cond = group_cond.index_select(row_group)
            synchronize(dev)  # so that each phase's time is its own (phases in `timings`)
            t_encoded = time.perf_counter()

            seeds = torch.cat(
                [sample_seeds(sampling.seed, p.group_id, g) for p in prompts]
            )  # [N*G]
            shape = (self.transformer.config.in_channels, latent_h, latent_w)
            x_seeds = (
                seeds.view(n, g)[:, :1].expand(n, g).reshape(-1)
                if sampling.same_initial_noise
                else seeds
            )
            x = initial_noise(x_seeds, shape, device=dev)  # float32 [N*G, C, h, w]

            timesteps, sigmas = set_schedule(
                self.scheduler,
                num_steps,
                (latent_h, latent_w),
                self.transformer.config.patch_size,
                dev,
            )
            sigma_max = float(sigmas[1])
            rows = n * g
            # A group's samples from one initial noise stay identical until their first
            # stochastic step: the transformer runs once per group there.
            shared = sampling.same_initial_noise and g > 1
            group_shared = SharedInputs.of_groups(n, g, dev) if shared else None
            record = sampling.record_latents and bool(recorded)
            steps = HostSteps(len(recorded) if record else 0, dev)
            k = 0
            for i in range(num_steps):
                stochastic = bool(trained[i]) and sampling.sde_type != "ode"
                noise = per_sample_noise(seeds, i, shape, device=dev) if stochastic else None
                step_begin(self.compile_config)
                out = sd3_step(
                    self.transformer,
                    self.scheduler,
                    x,
                    timesteps[i].expand(rows),
                    sigmas[i].expand(rows),
                    sigmas[i + 1].expand(rows),
                    cond,
                    sampling.guidance_scale,
                    sde_type=sampling.sde_type if stochastic else "ode",
                    noise_level=float(levels[i]),
                    sigma_max=sigma_max,
                    noise=noise,
                    model_dtype=self.model_dtype,
                    shared=group_shared,
                )
                if stochastic:
                    group_shared = None
                if stochastic and record:
                    steps.record("latents", k, x)
                    steps.record("next_latents", k, out.prev_sample)
                    steps.record("log_probs", k, out.log_prob)
                    k += 1
                x = out.prev_sample
            synchronize(dev)  # the loop and the copies of its recorded steps are done
            final = x.cpu()  # float32 [N*G, C, h, w]
            t_denoised = time.perf_counter()

            images = (
                self._decode_batched(x) if sampling.record_images else None
            )  # uint8 [N*G, H, W, 3]
            t_decoded = time.perf_counter()

            if record:
                lat = steps.get("latents")  # [N*G, K, C, h, w]
                nxt = steps.get("next_latents")
                logp = steps.get("log_probs")  # [N*G, K]
                idx = torch.tensor(recorded, dtype=torch.int64)
                rec_timesteps = timesteps[idx].cpu()  # [K], one host copy for every group
                rec_sigmas, rec_next = sigmas[idx].cpu(), sigmas[idx + 1].cpu()
            embeds = group_cond.prompt_embeds.cpu()  # [N, L, D]
            pooled = group_cond.pooled_prompt_embeds.cpu()  # [N, D']
            neg = _host(group_cond.negative_prompt_embeds)
            neg_pooled = _host(group_cond.negative_pooled_prompt_embeds)
            groups = []
            for j, prompt in enumerate(prompts):
                sl = slice(j * g, (j + 1) * g)
                groups.append(
                    DiffusionTrajectoryGroup(
                        group_id=prompt.group_id,
                        lease_id=lease_id,
                        worker_id=worker_id,
                        prompt=prompt,
                        sampling=sampling,
                        policy_version=policy_version,
                        architecture=self.architecture,
                        seeds=seeds[sl].clone(),
                        step_indices=idx.clone() if record else None,
                        timesteps=rec_timesteps.clone() if record else None,
                        sigmas=rec_sigmas.clone() if record else None,
                        next_sigmas=rec_next.clone() if record else None,
                        noise_levels=levels[idx].clone() if record else None,
                        latents=_own(lat[sl]) if record else None,
                        next_latents=_own(nxt[sl]) if record else None,
                        log_probs=_own(logp[sl]) if record else None,
                        final_latents=_own(final[sl]),
                        prompt_embeds=_own(embeds[j]),
                        pooled_prompt_embeds=_own(pooled[j]),
                        negative_prompt_embeds=_own(neg[j]) if neg is not None else None,
                        negative_pooled_prompt_embeds=(
                            _own(neg_pooled[j]) if neg_pooled is not None else None
                        ),
                        images=_own(images[sl]) if images is not None else None,
                    )
                )
            t_packed = time.perf_counter()
            timings = {
                "encode_s": t_encoded - t_start,
                "denoise_s": t_denoised - t_encoded,
                "decode_s": t_decoded - t_denoised,
                "pack_s": t_packed - t_decoded,
                "total_s": t_packed - t_start,
            }
            for group in groups:
                group.timings = dict(timings)
            return groups

    def _decode(self, latents: Tensor) -> Tensor:
        """VAE-decode float32 latents ``[B, C, h, w]`` to uint8 images ``[B, H, W, 3]``."""
        return vae_decode(self.pipeline.vae, latents)

    def _decode_batched(self, latents: Tensor) -> Tensor:
        """:meth:`_decode` over at most ``decode_batch`` images a call (0: all in one)."""
        n = self.decode_batch or latents.shape[0]
        if n >= latents.shape[0]:
            return self._decode(latents)
        return torch.cat([self._decode(part) for part in latents.split(n)])


def _host(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.cpu()


def _own(t: Tensor) -> Tensor:
    """A contiguous copy: a group must not keep its lease's whole batch (or a page-locked
    buffer) alive, and the wire wants contiguous memory."""
    return t.clone(memory_format=torch.contiguous_format)
