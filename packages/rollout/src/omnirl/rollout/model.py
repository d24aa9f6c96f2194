"""The rollout model of a worker: the registered rollout adapter, built from the Welcome.

Runs only on the sampler thread. torch and the model stack are imported here, lazily, so
that ``rollout --help`` stays light.
"""

from __future__ import annotations

import logging
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omnirl.protocol.messages import Lease, PromptSpec, SamplingParams, Welcome
from omnirl.rollout.weights_inbox import ReadyUpdate

if TYPE_CHECKING:
    import torch

log = logging.getLogger("omnirl.rollout")


def algorithm_of(welcome: Welcome) -> str:
    """The run's algorithm name from the Welcome's config (``algorithm.name``), else ``*``."""
    algorithm = welcome.config.get("algorithm", "*")
    if isinstance(algorithm, dict):
        algorithm = algorithm.get("name", "*")
    return str(algorithm or "*")


def lora_kwargs(welcome: Welcome, update: ReadyUpdate) -> dict[str, Any] | None:
    """PEFT ``LoraConfig`` kwargs for the adapter, or None when weights are full.

    The update's ``adapter_config`` (the training adapter's own) wins; else the trainer
    config's ``model.lora`` (``r``, ``alpha``, ``target_modules``, ``dropout``) is translated.
    """
    if update.format != "lora":
        return None
    if update.adapter_config:
        return dict(update.adapter_config)
    model_cfg = welcome.config.get("model", {})
    lora = model_cfg.get("lora") if isinstance(model_cfg, dict) else None
    if not lora:
        raise ValueError(
            "a LoRA weight update without adapter_config, and no model.lora in the config"
        )
    kwargs: dict[str, Any] = {"r": lora["r"], "lora_alpha": lora.get("alpha", lora["r"])}
    if "target_modules" in lora:
        kwargs["target_modules"] = list(lora["target_modules"])
    if "dropout" in lora:
        kwargs["lora_dropout"] = lora["dropout"]
    return kwargs


LORA_MODES = ("auto", "merged", "adapter")
# LoRA updates a static float8 worker takes between two calibrations (measured drift:
# docs/gpu_sessions.md, "Static float8 scales as the LoRA trains")
DEFAULT_FLOAT8_RECALIBRATE_EVERY = 100


def resolve_lora_mode(
    mode: str,
    lora: dict[str, Any] | None,
    dtype: torch.dtype,
    *,
    float8: bool = False,
    can_merge: bool = True,
) -> str:
    """How the rollout runs a LoRA adapter: ``"merged"`` into the base weights (forward
    passes only pay for the base layers) or as a separate ``"adapter"`` branch.

    ``"auto"``: merged for a float32 model without float8 layers and without DoRA, where the
    merge is exact to float32 rounding, if the adapter ``can_merge`` (its class's
    ``supports_lora_merge``); an adapter otherwise (a bf16 or float8 weight would round a
    young adapter's small delta away). ``"none"`` for full-weight runs. Raises
    ``ValueError`` for an unknown mode, or ``"merged"`` with DoRA or an adapter that cannot.
    """
    import torch

    if mode not in LORA_MODES:
        raise ValueError(f"unknown LoRA mode {mode!r}; known: {list(LORA_MODES)}")
    if lora is None:
        return "none"
    dora = bool(lora.get("use_dora"))
    if mode == "merged" and (dora or not can_merge):
        what = "a DoRA adapter" if dora else "this model family's adapter"
        raise ValueError(f"--lora-mode merged: {what} cannot be merged; use adapter")
    if mode == "auto":
        merge = can_merge and dtype == torch.float32 and not float8 and not dora
        return "merged" if merge else "adapter"
    return mode


def warmup_lease(welcome: Welcome, *, capacity: int = 1) -> tuple[list[PromptSpec], SamplingParams]:
    """Prompts and sampling parameters shaped like the run's leases (from the Welcome's
    ``sampling`` and ``data`` sections; a lease holds ``min(capacity, prompts_per_lease)``
    groups), for compiling before the first real lease."""
    cfg = welcome.config
    sampling_cfg = cfg.get("sampling", {}) if isinstance(cfg.get("sampling"), dict) else {}
    data = cfg.get("data", {}) if isinstance(cfg.get("data"), dict) else {}
    fields = ("num_steps", "guidance_scale", "height", "width", "negative_prompt")
    kwargs = {k: sampling_cfg[k] for k in fields if sampling_cfg.get(k) is not None}
    sampling = SamplingParams(
        group_size=int(data.get("group_size", 1)),
        sde_type="ode",  # shapes only: no noise, nothing recorded
        record_images=bool(sampling_cfg.get("record_images", True)),
        **kwargs,
    )
    n = max(1, min(capacity, int(data.get("prompts_per_lease", 1))))
    return [PromptSpec(group_id=f"warmup-{i}", text="warm-up") for i in range(n)], sampling


class RolloutModel:
    """Holds the adapter and the version it holds.

    ``float8_recalibrate_every``: after this many LoRA updates the static float8 scales are
    calibrated again on the next lease (one eager lease; 0: never). A full-weight update
    always recalibrates (the adapter's own rule).
    """

    def __init__(
        self,
        adapter: Any,
        *,
        format: str,
        float8_recalibrate_every: int = DEFAULT_FLOAT8_RECALIBRATE_EVERY,
    ) -> None:
        if float8_recalibrate_every < 0:
            raise ValueError(
                f"float8_recalibrate_every must be >= 0, got {float8_recalibrate_every}"
            )
        self.adapter = adapter
        self.format = format
        self.version = -1
        self.float8_recalibrate_every = float8_recalibrate_every
        self._lora_updates_since_calibration = 0
        self.peak_memory: dict[str, float] = {}  # the last lease's, GB (empty on a CPU)

    @classmethod
    def build(
        cls,
        welcome: Welcome,
        first: ReadyUpdate,
        *,
        device: str,
        dtype: str,
        compile: bool = False,
        compile_mode: str | None = None,
        compile_scope: str = "blocks",
        compile_cache: str | None = None,
        compile_decoder: bool = False,
        float8: str | None = None,
        float8_fast_accum: bool = False,
        float8_fuse_projections: bool = False,
        float8_recalibrate_every: int = DEFAULT_FLOAT8_RECALIBRATE_EVERY,
        lora_mode: str = "auto",
        capacity: int = 1,
        decode_batch: int = 0,
    ) -> RolloutModel:
        """Load ``welcome.model_path`` with the adapter shape the first update needs.

        ``compile``: the compiled backend, warmed up here on one lease of the run's shapes
        (so the first real lease does not wait for compilation), ``compile_scope`` what one
        graph covers (:data:`omnirl.models.compile.COMPILE_SCOPES`). ``compile_cache``: a
        directory shared by workers; its ``artifacts.bin`` (torch's mega-cache) is loaded
        before compiling and written after the warm-up when absent. ``compile_decoder``: the
        adapter's image decoder compiled too (its ``compile_decoder``). ``float8``: the
        denoiser's block linear layers in float8 with ``"rowwise"`` or ``"static"`` activation
        scales, ``float8_fast_accum`` their accumulation mode (the adapter's
        ``enable_float8``; ``float8_fuse_projections``: its fused q/k/v matmuls),
        ``float8_recalibrate_every`` see the class.
        ``lora_mode``: see :func:`resolve_lora_mode`. ``decode_batch``: images per VAE call
        (the adapter's ``set_decode_batch``; 0: a lease's images in one call).
        """
        from omnirl.models.device import resolve_dtype
        from omnirl.models.registry import get_rollout_adapter

        torch_dtype = resolve_dtype(dtype)
        adapter_cls = get_rollout_adapter(welcome.architecture, algorithm_of(welcome))
        lora = lora_kwargs(welcome, first)
        adapter = adapter_cls.from_pretrained(
            welcome.model_path, device=device, dtype=torch_dtype, lora=lora
        )
        log.info(
            "built %s for %s on %s (%s, weights %s)",
            adapter_cls.__name__,
            welcome.model_path,
            device,
            dtype,
            first.format,
        )
        model = cls(adapter, format=first.format, float8_recalibrate_every=float8_recalibrate_every)
        if decode_batch:
            adapter.set_decode_batch(decode_batch)
            log.info("decoding at most %d images per VAE call", decode_batch)
        can_merge = bool(getattr(adapter_cls, "supports_lora_merge", False))
        mode = resolve_lora_mode(
            lora_mode, lora, torch_dtype, float8=bool(float8), can_merge=can_merge
        )
        if mode == "merged":
            adapter.merge_lora()
            log.info("LoRA merged into the base weights after every update")
        if float8:
            count = adapter.enable_float8(
                activation=float8,
                fast_accum=float8_fast_accum,
                fuse_projections=float8_fuse_projections,
            )
            log.info(
                "float8 linear layers: %d converted (activations %s%s%s)",
                count,
                float8,
                ", fast accumulation" if float8_fast_accum else "",
                ", q/k/v fused" if float8_fuse_projections else "",
            )
        if compile:
            model.compile_and_warm_up(
                welcome,
                mode=compile_mode,
                scope=compile_scope,
                cache=compile_cache,
                capacity=capacity,
                decoder=compile_decoder,
            )
        return model

    def compile_and_warm_up(
        self,
        welcome: Welcome,
        *,
        mode: str | None = None,
        scope: str = "blocks",
        cache: str | None = None,
        capacity: int = 1,
        backend: str = "inductor",
        decoder: bool = False,
    ) -> float:
        """Compile the adapter and sample one throw-away lease of the run's shapes; returns
        the seconds it took (compilation included). Static float8 scales calibrated on that
        lease's stand-in prompt are dropped again: the first real lease calibrates them
        (a stand-in prompt's inputs can be half a real prompt's, and real ones would
        saturate). ``backend``: torch.compile's (``"aot_eager"`` traces without inductor).
        ``decoder``: the image decoder compiled too; the warm-up lease compiles it when the run
        records images (otherwise the first lease that decodes does)."""
        from omnirl.models.compile import CompileConfig, regional_scope
        from omnirl.models.compile_cache import load_artifacts, save_artifacts

        artifacts = Path(cache) / "artifacts.bin" if cache else None
        if artifacts is not None and artifacts.is_file():
            load_artifacts(artifacts)
        start = time.perf_counter()
        config = CompileConfig(
            mode=mode, backend=backend, cache_dir=cache, regional=regional_scope(scope)
        )
        self.adapter.compile(config)
        if decoder:
            self.adapter.compile_decoder(config)
            log.info("the image decoder is compiled too (one graph per decode batch size)")
        prompts, sampling = warmup_lease(welcome, capacity=capacity)
        # a first call that calibrates float8 scales runs eagerly: the second one compiles
        calibrates = self.adapter.float8_needs_calibration()
        for _ in range(2 if calibrates else 1):
            self.adapter.sample(
                prompts, sampling, lease_id="warmup", worker_id="warmup", policy_version=-1
            )
        if calibrates:
            self.adapter.recalibrate_float8()
            log.info("float8: the first lease calibrates the static scales on its prompts")
        took = time.perf_counter() - start
        log.info("compiled backend warmed up in %.1f s", took)
        if artifacts is not None and not artifacts.exists():
            save_artifacts(artifacts)
        return took

    def apply(self, update: ReadyUpdate) -> int:
        """Apply a whole version atomically (the adapter validates before it copies)."""
        if update.format != self.format:
            raise ValueError(f"weights of format {update.format!r} for a {self.format!r} model")
        self.adapter.load_weights(update.format, update.tensors)
        self.version = update.version
        if update.format == "lora" and self.float8_recalibrate_every:
            self._lora_updates_since_calibration += 1
            if self._lora_updates_since_calibration >= self.float8_recalibrate_every:
                self._lora_updates_since_calibration = 0
                if self.adapter.recalibrate_float8():
                    log.info(
                        "float8: recalibrating the static scales on the next lease (%d LoRA "
                        "updates since the last calibration)",
                        self.float8_recalibrate_every,
                    )
        return update.version

    def sample(self, lease: Lease, worker_id: str, version: int) -> list:
        """Sample every prompt group of ``lease`` at the held ``version``. After running out
        of device memory, what the failed lease held is freed and the allocator's cache handed
        back before the error propagates (a trainer may share the GPU). :attr:`peak_memory`
        holds the lease's device-memory peaks (:func:`omnirl.models.device.peak_memory_gb`)."""
        from omnirl.models.device import peak_memory_gb, reset_peak_memory

        device = getattr(self.adapter, "device", None)
        if device is not None:
            reset_peak_memory(device)
        try:
            groups = self.adapter.sample(
                lease.prompts,
                lease.sampling,
                lease_id=lease.lease_id,
                worker_id=worker_id,
                policy_version=version,
            )
            self.peak_memory = peak_memory_gb(device) if device is not None else {}
            return groups
        except Exception as err:
            if type(err).__name__ == "OutOfMemoryError":  # torch's
                # the traceback's frames hold the lease's activations
                traceback.clear_frames(err.__traceback__)
                self.release_memory()
                decode = getattr(type(self.adapter), "supports_decode_batch", False)
                log.error(
                    "the lease ran out of device memory: %s--capacity 1 lowers the denoiser's peak",
                    "--decode-batch N (N images per VAE call) lowers the decode's peak, "
                    if decode
                    else "",
                )
            raise

    def release_memory(self) -> None:
        """Collect what failed work left and return the device's cached blocks."""
        from omnirl.models.device import release_memory

        release_memory(getattr(self.adapter, "device", None))
