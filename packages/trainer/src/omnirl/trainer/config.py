"""The trainer process's configuration: OmegaConf structured configs (dataclasses).

Defaults live here and only here; a YAML file holds only what it changes. Sampling
defaults are read from :class:`~omnirl.protocol.messages.SamplingParams`, so the lease a
worker receives and this config cannot disagree about a default.

``load_config(path, overrides)`` merges ``defaults <- file <- dotlist``; an unknown key in
the file or in the dotlist raises :class:`ConfigError` naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from omnirl.protocol.messages import SamplingParams


class ConfigError(ValueError):
    """A configuration file or override is invalid; the message names the key."""


def _sampling_default(name: str) -> Any:
    for f in msgspec.structs.fields(SamplingParams):
        if f.name == name:
            return f.default
    raise KeyError(name)


@dataclass
class RunConfig:
    name: str = "run"
    output_dir: str = "outputs/run"
    seed: int = 0
    device: str = "cpu"  # "cpu", "cuda:0", ...
    dtype: str = "float32"  # model dtype: "float32", "bfloat16", "float16"
    threads: int = 0  # torch intra-op CPU threads; 0: torch's default (all cores)


@dataclass
class LoraConfig:
    """PEFT LoRA shape; a null field takes the model family's default."""

    r: int | None = None
    alpha: int | None = None
    target_modules: list[str] | None = None
    dropout: float | None = None

    @staticmethod
    def peft_kwargs(lora: Any) -> dict[str, Any]:
        """PEFT ``LoraConfig`` kwargs of the set fields (what adapters' ``lora=`` takes)."""
        names = {"r": "r", "alpha": "lora_alpha", "target_modules": "target_modules",
                 "dropout": "lora_dropout"}  # fmt: skip
        out = {}
        for key, peft_key in names.items():
            value = lora[key] if isinstance(lora, dict) else getattr(lora, key)
            if value is not None:
                out[peft_key] = list(value) if key == "target_modules" else value
        return out


@dataclass
class ModelConfig:
    path: str = "???"  # a diffusers model directory
    lora: LoraConfig | None = field(default_factory=LoraConfig)  # null: full fine-tuning


@dataclass
class AlgorithmConfig:
    name: str = "flow_grpo"
    overrides: dict[str, Any] = field(default_factory=dict)  # passed to the algorithm spec


@dataclass
class DataConfig:
    prompts: str = "???"  # .jsonl or .parquet of {"prompt": ..., "metadata": {...}}
    group_size: int = 4  # samples per prompt
    prompts_per_lease: int = 1
    shuffle: bool = True
    seed: int | None = None  # the prompt order's seed; null: run.seed
    # a metadata key (e.g. "category"): draw prompts per value of it, less often from values
    # whose recent groups all tied (omnirl.trainer.balanced_data); null: the file's order
    balance_by: str | None = None
    balance_floor: float = 0.2  # the share of its size a stratum keeps when all its groups tie
    balance_memory: int = 32  # a stratum's last N reported groups make its spread rate


@dataclass
class SamplingConfig:
    """Defaults of the :class:`SamplingParams` every lease carries."""

    num_steps: int = _sampling_default("num_steps")
    guidance_scale: float = _sampling_default("guidance_scale")
    height: int = _sampling_default("height")
    width: int = _sampling_default("width")
    noise_level: float | None = None  # null: the algorithm's (flow_grpo 0.7, dance_grpo 0.3)
    sde_window: list[int] | None = None  # [start, end) step indices; null: all steps
    sde_type: str | None = None  # null: the algorithm's SDE variant
    # one initial noise x_T for all samples of a prompt, so that the group's differences come
    # from the trained SDE steps alone; null: the algorithm's (DanceGRPO: true)
    same_initial_noise: bool | None = None
    negative_prompt: str = _sampling_default("negative_prompt")
    record_images: bool = _sampling_default("record_images")


@dataclass
class RewardConfig:
    """What reward workers score; sent to them in the Welcome."""

    # NAME[:WEIGHT],... as ``reward --scorer`` takes it; a worker started with --scorer
    # uses its own spec instead (e.g. a remote judge on one machine)
    scorer: str = "jpeg_compressibility"


# train.step_snapshot (omnirl.trainer.step_snapshot)
SNAPSHOT_POLICIES = ("auto", "always", "never")


@dataclass
class TrainConfig:
    """The loop's batching and staleness, plus the common ``TrainStep.Config`` fields.

    A null hyper-parameter takes the algorithm's default (``AlgorithmSpec.defaults``), else
    ``TrainStep.Config``'s own; any other ``TrainStep.Config`` field is set through
    ``algorithm.overrides``. Precedence: TrainStep.Config < algorithm defaults < these <
    ``algorithm.overrides``.
    """

    groups_per_step: int = 4  # accepted groups per optimisation step
    max_staleness: int = 0  # 0: synchronous (on-policy); K >= 1 asynchronous
    lr: float | None = None
    # factor on lr over the run's progress to its first limit (max_steps or max_minutes):
    # constant, linear or cosine, from 1 down to lr_min_ratio (omnirl.trainer.lr_schedule)
    lr_schedule: str = "constant"
    lr_min_ratio: float = 0.0
    # linear warm-up over the first N optimisation steps, multiplying the schedule
    lr_warmup_steps: int = 0
    # copy what a step changes to host memory before it, to undo a step that fails after an
    # optimiser update (its groups are then issued again): "auto" (a trainable state of at
    # most 2 GiB, parameters and Adam's moments, as a LoRA's; a larger one only when a step
    # makes several updates), "always", "never" (omnirl.trainer.step_snapshot)
    step_snapshot: str = "auto"
    clip_range: float | None = None
    kl_beta: float | None = None
    max_grad_norm: float | None = None
    # how the model runs (not TrainStep.Config fields): see docs/architecture.md, "GPU path"
    gradient_checkpointing: bool = False  # recompute block activations in backward
    compile: bool = False  # each transformer block torch.compiled (omnirl.models.compile)
    compile_mode: str | None = None  # torch.compile mode; null: torch's default
    # "blocks": each transformer block a graph; "whole": the denoiser one graph (slower to
    # compile; fuses across blocks). Not with FSDP (its hooks run around each block)
    compile_scope: str = "blocks"
    compile_cache: str | None = None  # persistent compile cache directory
    # with compile: the fraction (0, 1] of a block's activations its backward may keep
    # saved; the rest is recomputed, cheapest first (omnirl.models.compile.CompileConfig).
    # null: torch's default. Between no recomputation and gradient_checkpointing
    activation_memory_budget: float | None = None
    # under a budget the attention kernels' outputs stay saved (inductor; torch's partitioner
    # alone recomputes cuDNN's attention: +279 ms a step at 0.5, "seventeenth session");
    # true: let the budget recompute them as torch chooses
    recompute_attention: bool = False
    # the blocks' frozen linear layers as float8 matmuls (LoRA runs, Hopper GPUs;
    # omnirl.models.float8, "Training"): activation scales "rowwise" or "static" (calibrated
    # on the step's first micro-batches, again every float8_recalibrate_every updates), the
    # input gradient in "float8" or "model_dtype", scope "all" passes or only the KL
    # "reference" pass; float8_fast_accum: Hopper's fast accumulation. Speed on SD3.5-M with
    # KL (docs/gpu_sessions.md, "GPU, seventh" to "eleventh session"): row-wise 5 % slower
    # than bf16; static 11 % faster (float8 input gradient), 8 % (model_dtype); static 13 %
    # with micro_batch_size 16, where at 8 the host's kernel launches can hold it to 2 %
    # (16 needs more memory than an 80 GB card leaves beside a rollout worker, "twelfth",
    # unless activation_memory_budget is set: 0.5 fits, 9 % slower a step, "seventeenth")
    float8: bool = False
    float8_fast_accum: bool = False
    float8_activation: str = "rowwise"
    float8_input_grad: str = "float8"
    float8_scope: str = "all"
    float8_recalibrate_every: int = 100
    # each attention's q, k and v (per stream) as one float8 matmul, LoRA branches apart;
    # measured 1.9 % slower on SD3.5-M (docs/gpu_sessions.md, "GPU, nineteenth session")
    float8_fuse_projections: bool = False
    # SDPA kernel: "default" (torch's choice), "cudnn", "flash", "efficient", "math"; the
    # rollout's --attention should name the same one (log-prob parity)
    attention: str = "default"
    # under torchrun (several trainer ranks): "auto" or "ddp" (gradients all-reduced)
    parallel: str = "auto"


@dataclass
class RuntimeConfig:
    host: str = "127.0.0.1"  # bind address; workers connect here
    # the host workers on other machines reach the weights and intake sockets at, sent in
    # Welcome (e.g. a Kubernetes Service name); "": host, or the host name for 0.0.0.0
    advertise_host: str = ""
    control_port: int = 5555  # 0: pick a free port (the address is written to trainer.addr)
    weights_port: int = 0  # 0: pick
    intake_port: int = 0  # 0: pick
    lease_timeout_s: float = 300.0
    heartbeat_interval_s: float = 2.0
    heartbeat_timeout_s: float = 30.0  # generous: a loaded CPU host stalls imports for long
    max_message_bytes: int = 1 << 30
    weight_chunk_bytes: int = 64 << 20
    max_reissues: int = 5  # a group reissued more often than this is abandoned (counted)
    # a rollout worker whose last this-many leases all failed (given back, no group common to
    # all) gets no lease for bench_s, doubled on each bench in a row (at most 32 x); 0: never
    worker_failure_limit: int = 3
    bench_s: float = 30.0
    shutdown_grace_s: float = 3.0  # after max_steps, keep answering "shutdown" this long
    insecure: bool = False  # allow a non-loopback bind without CurveZMQ keys
    keys_dir: str | None = None  # CurveZMQ keys (see omnirl.protocol.auth); null: none
    key_name: str = "trainer"  # the trainer's key pair in keys_dir


@dataclass
class LoggingConfig:
    jsonl: bool = True  # <output_dir>/metrics.jsonl
    tensorboard: bool = True  # <output_dir>/tb
    image_grid_every: int = 0  # steps; 0: never
    progress_bar: bool = True
    log_level: str = "INFO"


@dataclass
class CheckpointConfig:
    every: int = 0  # steps; 0: only at the end
    dir: str | None = None  # null: <output_dir>/checkpoints
    keep_last: int = 2


@dataclass
class TrainerConfig:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    max_steps: int = 10
    max_minutes: float = 0.0  # the run's wall-clock budget, summed over resumes; 0: none


def _explain(err: OmegaConfBaseException, source: str) -> ConfigError:
    key = getattr(err, "full_key", None) or getattr(err, "key", None)
    msg = getattr(err, "msg", str(err)).splitlines()[0]
    where = f"key '{key}'" if key else "a key"
    return ConfigError(f"{source}: {where}: {msg}")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> DictConfig:
    """Merge defaults, the YAML file at ``path`` and ``key=value`` overrides.

    Returns a read-only structured ``DictConfig`` (typed as :class:`TrainerConfig`).
    Raises :class:`ConfigError` naming the offending key for an unknown key, a value of
    the wrong type, or a required value (``???``) left missing.
    """
    cfg = OmegaConf.structured(TrainerConfig)
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            file_cfg = OmegaConf.load(path)
        except Exception as err:  # YAML syntax errors come from the yaml package
            raise ConfigError(f"{path}: not valid YAML: {err}") from None
        if not isinstance(file_cfg, DictConfig):
            raise ConfigError(f"{path}: the top level must be a mapping")
        try:
            cfg = OmegaConf.merge(cfg, file_cfg)
        except OmegaConfBaseException as err:
            raise _explain(err, str(path)) from None
    if overrides:
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override {item!r} is not of the form key=value")
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
        except OmegaConfBaseException as err:
            raise _explain(err, "override") from None
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"required key(s) not set: {', '.join(missing)}")
    if cfg.data.seed is None:  # one seed changes the whole run unless the order is pinned
        cfg.data.seed = cfg.run.seed
    _validate(cfg)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def _validate(cfg: DictConfig) -> None:
    checks = [
        ("data.group_size", cfg.data.group_size >= 1),
        ("data.prompts_per_lease", cfg.data.prompts_per_lease >= 1),
        ("data.balance_floor", 0 < cfg.data.balance_floor <= 1),
        ("data.balance_memory", cfg.data.balance_memory >= 1),
        ("train.groups_per_step", cfg.train.groups_per_step >= 1),
        ("train.max_staleness", cfg.train.max_staleness >= 0),
        ("max_steps", cfg.max_steps >= 0),
        ("max_minutes", cfg.max_minutes >= 0),
        ("run.threads", cfg.run.threads >= 0),
        ("runtime.weight_chunk_bytes", cfg.runtime.weight_chunk_bytes >= 1),
        ("runtime.heartbeat_timeout_s", cfg.runtime.heartbeat_timeout_s > 0),
        ("runtime.lease_timeout_s", cfg.runtime.lease_timeout_s > 0),
        ("runtime.max_reissues", cfg.runtime.max_reissues >= 0),
        ("runtime.worker_failure_limit", cfg.runtime.worker_failure_limit >= 0),
        ("runtime.bench_s", cfg.runtime.bench_s > 0),
    ]
    for key, ok in checks:
        if not ok:
            raise ConfigError(f"key '{key}': value {OmegaConf.select(cfg, key)!r} is out of range")
    window = cfg.sampling.sde_window
    if window is not None and (len(window) != 2 or not 0 <= window[0] < window[1]):
        raise ConfigError(f"key 'sampling.sde_window': {list(window)!r} is not [start, end)")
    if cfg.run.dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"key 'run.dtype': unknown dtype {cfg.run.dtype!r}")
    if cfg.train.step_snapshot not in SNAPSHOT_POLICIES:
        raise ConfigError(
            f"key 'train.step_snapshot': unknown policy {cfg.train.step_snapshot!r}; "
            f"known: {list(SNAPSHOT_POLICIES)}"
        )
    if cfg.train.parallel not in ("auto", "none", "ddp", "fsdp"):
        raise ConfigError(
            f"key 'train.parallel': unknown mode {cfg.train.parallel!r}; "
            "known: auto, none, ddp, fsdp"
        )
    from omnirl.trainer.lr_schedule import check_schedule

    try:
        check_schedule(cfg.train.lr_schedule, cfg.train.lr_min_ratio, cfg.train.lr_warmup_steps)
    except ValueError as err:
        raise ConfigError(f"key 'train.{str(err).split()[0]}': {err}") from None
    from omnirl.models.compile import COMPILE_SCOPES
    from omnirl.models.device import ATTENTION_BACKENDS

    if cfg.train.compile_scope not in COMPILE_SCOPES:
        raise ConfigError(
            f"key 'train.compile_scope': unknown compile scope {cfg.train.compile_scope!r}; "
            f"known: {list(COMPILE_SCOPES)}"
        )
    budget = cfg.train.activation_memory_budget
    if cfg.train.recompute_attention and budget is None:
        raise ConfigError(
            "key 'train.recompute_attention': applies only under "
            "train.activation_memory_budget (without one nothing is recomputed)"
        )
    if budget is not None:
        if not cfg.train.compile:
            raise ConfigError(
                "key 'train.activation_memory_budget': needs train.compile=true (the "
                "compiler decides what to recompute)"
            )
        from omnirl.models.compile import CompileConfig

        try:
            CompileConfig(activation_memory_budget=budget)
        except ValueError as err:
            raise ConfigError(f"key 'train.activation_memory_budget': {err}") from None
    if cfg.train.float8 and cfg.model.lora is None:
        raise ConfigError(
            "key 'train.float8': float8 training needs model.lora (a full fine-tune trains "
            "every weight, and a float8 forward computes no weight gradient)"
        )
    float8_training_options(cfg.train)  # names a bad float8_* key
    if cfg.train.compile_scope == "whole" and cfg.train.parallel == "fsdp":
        raise ConfigError(
            "key 'train.compile_scope': 'whole' cannot run under train.parallel=fsdp (FSDP2 "
            "gathers each block's weights in hooks around it); use 'blocks'"
        )

    if cfg.train.attention not in ATTENTION_BACKENDS:
        raise ConfigError(
            f"key 'train.attention': unknown attention backend {cfg.train.attention!r}; "
            f"known: {list(ATTENTION_BACKENDS)}"
        )
    _check_noise_sharing(cfg)


def float8_training_options(train: Any) -> Any:
    """The ``train.float8_*`` keys as :class:`omnirl.models.float8.Float8Training`; raises
    :class:`ConfigError` naming a bad value."""
    from omnirl.models.float8 import Float8Error, Float8Training

    try:
        return Float8Training(
            activation=train.float8_activation,
            input_grad=train.float8_input_grad,
            scope=train.float8_scope,
            fast_accum=bool(train.float8_fast_accum),
            recalibrate_every=int(train.float8_recalibrate_every),
            fuse_projections=bool(train.float8_fuse_projections),
        )
    except Float8Error as err:
        raise ConfigError(f"key 'train.float8_*': {err}") from None


def _check_noise_sharing(cfg: DictConfig) -> None:
    """One x_T per group with an ODE sampler leaves nothing to differ inside the group."""
    if cfg.sampling.same_initial_noise is not True:
        return
    from omnirl.trainer.algorithms.registry import get_algorithm

    try:
        spec = get_algorithm(cfg.algorithm.name)
    except LookupError:
        return  # named with the list of known algorithms when the backend is built
    sde_type = cfg.sampling.sde_type or spec.sde_type
    if sde_type == "ode":
        raise ConfigError(
            f"key 'sampling.same_initial_noise': true with {cfg.algorithm.name!r}'s 'ode' "
            "sampler makes every sample of a group identical (no noise after x_T); set it "
            "to null (the algorithm's choice) or false"
        )


def to_container(cfg: DictConfig) -> dict[str, Any]:
    """A plain, JSON-able dict of the resolved config (for checkpoints and the Welcome)."""
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


def checkpoint_dir(cfg: DictConfig) -> Path:
    return (
        Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.run.output_dir) / "checkpoints"
    )
