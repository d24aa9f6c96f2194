"""What the server trains with: the model family's training adapter and a ``TrainStep``.

:class:`TrainerServer` only needs the small surface below, so tests and benchmarks can
hand it something lighter (a backend with no model) while the real run uses
:class:`AdapterBackend`::

    architecture: str, model_path: str, sde_type: str
    weight_format: "lora" | "full", adapter_config: dict
    export_weights() -> dict[str, Tensor]           # what a WeightUpdate carries
    step(groups, *, policy_version) -> dict[str, float]
    adapter      # save_pretrained(dir), trainable_parameters()  (checkpoints), or None
    train_step   # state_dict() / load_state_dict()                (checkpoints), or None
    load_checkpoint(path) -> LoadedCheckpoint         # optional (resume)

Under ``torchrun`` every rank builds an :class:`AdapterBackend` with its :class:`DistInfo`;
rank 0's is wrapped in :class:`omnirl.trainer.replicas.LeaderBackend`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from omnirl.trainer.config import (
    ConfigError,
    LoraConfig,
    float8_training_options,
    to_container,
)

log = logging.getLogger("omnirl.trainer.backend")


def train_step_config(cfg: Any) -> Any:
    """``TrainStep.Config`` from ``train`` (set fields) and ``algorithm.overrides``.

    Of ``train`` only the fields ``TrainStep.Config`` has are taken: the rest are the loop's
    and the model's options, read where they apply. Raises :class:`ConfigError` naming any
    key of ``algorithm.overrides`` that ``TrainStep.Config`` does not have.
    """
    from omnirl.trainer.step import TrainStep

    step_fields = {f.name for f in dataclasses.fields(TrainStep.Config)}
    values = {
        k: v for k, v in to_container(cfg.train).items() if k in step_fields and v is not None
    }
    values.setdefault("seed", cfg.run.seed)
    values.update(to_container(cfg.algorithm)["overrides"])
    if isinstance(values.get("betas"), list):
        values["betas"] = tuple(values["betas"])
    try:
        return TrainStep.Config.from_dict(values)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"key 'algorithm.overrides' / 'train': {err}") from None


class AdapterBackend:
    """The registered training adapter of the model's architecture, and its TrainStep."""

    def __init__(self, cfg: Any, dist_info: Any = None):
        """``dist_info``: this rank's :class:`~omnirl.trainer.distributed.DistInfo` under
        ``torchrun`` (the model goes to its device and trains its share of each batch);
        ``None``: one process on ``run.device``."""
        import torch

        from omnirl.models.device import resolve_dtype
        from omnirl.models.registry import architecture_of, get_training_adapter
        from omnirl.trainer.algorithms.registry import (
            build_loss,
            get_algorithm,
            needs_reference_pass,
        )
        from omnirl.trainer.step import TrainStep
        from omnirl.trainer.step_snapshot import (
            StepSnapshot,
            snapshot_steps,
            trainable_state_bytes,
        )

        self.model_path = str(cfg.model.path)
        self.architecture = architecture_of(self.model_path)
        spec = get_algorithm(cfg.algorithm.name)
        if (
            cfg.train.float8
            and cfg.train.float8_activation == "static"
            and not spec.needs_log_probs
        ):
            raise ConfigError(
                "key 'train.float8_activation': 'static' scales are calibrated by a log-prob "
                f"step on its transitions; {spec.name!r} is a forward-process objective, "
                "whose step never calibrates them: use 'rowwise'"
            )
        self.sde_type = spec.sde_type
        step_config = train_step_config(cfg)
        if cfg.train.float8 and cfg.train.float8_scope == "reference":  # before the model loads
            resolved = step_config.resolve(spec)
            if not needs_reference_pass(spec, build_loss(spec, resolved)):
                raise ConfigError(
                    "key 'train.float8_scope': 'reference' runs only the KL term's reference "
                    f"pass in float8, and this loss ({spec.name}, kl_beta {resolved.kl_beta}) "
                    "has no KL term: nothing would run in float8"
                )
        adapter_cls = get_training_adapter(self.architecture, spec.adapter_algorithm)
        lora = LoraConfig.peft_kwargs(cfg.model.lora) if cfg.model.lora is not None else None
        torch.manual_seed(cfg.run.seed)  # LoRA initialisation is part of the run's seed
        dtype = resolve_dtype(cfg.run.dtype)
        self.dist_info = dist_info
        device = dist_info.device if dist_info is not None else cfg.run.device
        self.device = torch.device(device)
        self.adapter = adapter_cls.from_pretrained(
            self.model_path,
            device=device,
            dtype=dtype,
            lora=lora,
            gradient_checkpointing=cfg.train.gradient_checkpointing,
        )
        if cfg.train.float8:  # before compiling: the blocks trace the float8 layers
            options = float8_training_options(cfg.train)
            layers = self.adapter.enable_float8(options)
            log.info("float8 training: %d block linear layers, %s", layers, options)
        if cfg.train.compile:
            from omnirl.models.compile import CompileConfig, regional_scope

            self.adapter.compile(
                CompileConfig(
                    mode=cfg.train.compile_mode,
                    cache_dir=cfg.train.compile_cache,
                    regional=regional_scope(cfg.train.compile_scope),
                    activation_memory_budget=cfg.train.activation_memory_budget,
                    recompute_attention=cfg.train.recompute_attention,
                )
            )
        self.weight_format = self.adapter.weight_format
        self.adapter_config = self.adapter.adapter_config()
        parallel = None
        if dist_info is not None and dist_info.world_size > 1:
            parallel = self._data_parallel(cfg, dist_info)
        self.train_step = TrainStep(self.adapter, spec, step_config, parallel=parallel)
        resolved = self.train_step.config
        snapshot = snapshot_steps(
            cfg.train.step_snapshot,
            state_bytes=trainable_state_bytes(self.train_step.params),
            updates_per_step=resolved.inner_epochs * resolved.num_minibatches,
        )
        # taken before every step, into the same host buffers; not under torchrun, where the
        # leader stops the run on a failed step instead (replicas.LeaderBackend)
        self.snapshot = StepSnapshot() if snapshot and parallel is None else None

    def _data_parallel(self, cfg: Any, info: Any) -> Any:
        """Gradient all-reduce over the ranks (``train.parallel``: ``auto`` / ``ddp``), every
        rank starting from rank 0's trainable parameters."""
        import torch.distributed as dist

        from omnirl.trainer.distributed import DataParallel

        mode = cfg.train.parallel
        if mode not in ("auto", "ddp"):
            raise ConfigError(
                f"key 'train.parallel': {mode!r} across {info.world_size} ranks is not "
                "available to the trainer server (checkpoints of FSDP2-sharded state are not "
                "implemented; TrainStep itself runs it, see benchmarks/fsdp_step.py): use 'ddp'"
            )
        module = getattr(self.adapter, "transformer", None)
        if module is None:
            raise ConfigError(
                f"{type(self.adapter).__name__} names no module to train data-parallel"
            )
        parallel = DataParallel(info, module, mode="ddp")
        for param in self.adapter.trainable_parameters():
            dist.broadcast(param.data, src=0)
        return parallel

    def load_checkpoint(self, path: Any) -> Any:
        """Copy a checkpoint's trainable parameters and optimiser state in; its contents."""
        from omnirl.trainer.checkpoint import load_checkpoint

        return load_checkpoint(path, adapter=self.adapter, train_step=self.train_step)

    def export_weights(self) -> dict[str, Any]:
        return self.adapter.export_weights()

    def step(
        self, groups: list[Any], *, policy_version: int, lr_scale: float = 1.0
    ) -> dict[str, float]:
        """One optimisation step. A step that fails leaves the trainer as it was before it,
        or raises :class:`~omnirl.trainer.step_snapshot.StepNotUndone`
        (:mod:`omnirl.trainer.step_snapshot`). Under ``torchrun`` the ranks' replicas cannot
        be rewound together, so the leader stops the run instead
        (:class:`~omnirl.trainer.replicas.LeaderBackend`). In one process a step that runs out
        of device memory is tried again at half the micro-batch
        (:mod:`omnirl.trainer.memory_fallback`). The metrics carry the step's device-memory
        peaks (``device_peak_allocated_gb``, ``device_peak_reserved_gb``; not on a CPU)."""
        from omnirl.models.device import reset_peak_memory

        reset_peak_memory(self.device)
        if self.dist_info is not None and self.dist_info.world_size > 1:
            metrics = self.train_step.step(groups, policy_version=policy_version, lr_scale=lr_scale)
            return self._with_memory_peaks(metrics)
        from omnirl.trainer.memory_fallback import step_with_memory_fallback
        from omnirl.trainer.step import TrainStepInputError
        from omnirl.trainer.step_snapshot import rewind

        started = time.perf_counter()
        snapshot = self.snapshot.take(self.train_step) if self.snapshot is not None else None
        snapshot_s = time.perf_counter() - started
        updates_before = self.train_step.num_updates
        try:
            metrics = step_with_memory_fallback(
                self.train_step,
                groups,
                policy_version=policy_version,
                lr_scale=lr_scale,
                release=self.release_memory,
                snapshot=snapshot,
            )
            if snapshot is not None:
                metrics["snapshot_s"] = snapshot_s  # its cost, beside the step's time_s
            return self._with_memory_peaks(metrics)
        except TrainStepInputError:
            raise  # refused before anything ran
        except Exception:
            rewind(self.train_step, snapshot, updates_before)
            raise

    def _with_memory_peaks(self, metrics: dict[str, float]) -> dict[str, float]:
        from omnirl.models.device import peak_memory_gb

        for kind, gb in peak_memory_gb(self.device).items():  # nothing on a CPU
            metrics[f"device_peak_{kind}_gb"] = round(gb, 3)
        return metrics

    def release_memory(self) -> None:
        """After a failed step (the server has dropped its references): collect what is left
        of it and hand the device's cached blocks back."""
        from omnirl.models.device import release_memory

        release_memory(self.device)
