"""Message kinds: a msgspec tagged union (tag field ``kind``).

Every message carries the protocol version ``v = (major, minor)``. Tensor fields are
annotated :class:`~omnirl.protocol.tensor_type.Tensor`; they hold ``torch.Tensor`` values
in Python and travel as raw frames (see :mod:`omnirl.protocol.codec`).

Shapes below use ``G`` = samples in the group, ``K`` = recorded (trained) denoising steps,
``L`` = text tokens, ``D`` = embedding width, ``C, H, W`` (or ``C, F, H, W`` for video) =
latent dims, ``Lp`` / ``Lr`` = prompt / response tokens.

Group-level fields (prompt, prompt embeddings, masks) are sent once per group, never once
per sample.

Fields listed in a class's ``finite_fields`` must hold only finite numbers; the codec
checks them on encode and decode and raises :class:`~omnirl.protocol.errors.NonFiniteValue`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import msgspec

from omnirl.protocol.tensor_type import Tensor
from omnirl.protocol.version import PROTOCOL_VERSION

Role = Literal["trainer", "rollout", "reward", "tap", "client"]
WeightFormat = Literal["lora", "full"]


class Message(msgspec.Struct, tag_field="kind", kw_only=True, omit_defaults=False):
    """Base of every message kind."""

    finite_fields: ClassVar[tuple[str, ...]] = ()
    v: tuple[int, int] = PROTOCOL_VERSION


# ----------------------------------------------------------------------------- registration


class Capabilities(msgspec.Struct, kw_only=True):
    """What a worker can do; the trainer leases only work a worker can take."""

    architectures: list[str] = []
    backends: list[str] = []
    device: str = "cpu"
    max_group_size: int = 0  # 0: no limit
    trajectory_kinds: list[str] = msgspec.field(default_factory=lambda: ["diffusion"])
    extra: dict[str, str] = {}


class Topology(msgspec.Struct, kw_only=True):
    """Addresses a worker learns from the trainer's welcome."""

    control: str  # ROUTER on the trainer: leases, heartbeats, acks
    intake: str  # PULL on the trainer: scored trajectory groups
    weights: str  # ROUTER on the trainer: weight requests and weight update chunks
    reward: list[str] = []  # PULL of each reward worker (rollout workers send groups here)


class Hello(Message, tag="hello", kw_only=True):
    role: Role
    worker_id: str
    capabilities: Capabilities = msgspec.field(default_factory=Capabilities)
    address: str = ""  # where this worker listens, if it does (reward workers)


class Welcome(Message, tag="welcome", kw_only=True):
    worker_id: str
    run_id: str
    topology: Topology
    policy_version: int
    model_path: str = ""
    architecture: str = ""
    heartbeat_interval_s: float = 2.0
    config: dict[str, Any] = {}


# ---------------------------------------------------------------------------------- leases


class PromptSpec(msgspec.Struct, kw_only=True):
    """One prompt to be sampled ``group_size`` times; ``group_id`` names the result."""

    group_id: str
    text: str
    metadata: dict[str, Any] = {}


class SamplingParams(msgspec.Struct, kw_only=True):
    """How to sample; carried by the lease and echoed by every trajectory group."""

    group_size: int
    seed: int = 0
    # diffusion
    num_steps: int = 10
    guidance_scale: float = 4.5
    height: int = 512
    width: int = 512
    num_frames: int = 1
    sde_type: str = "sde"  # "sde", "cps", "dance_sde", "ode"
    noise_level: float = 0.7
    sde_window: tuple[int, int] | None = None  # [start, end) step indices; None: all steps
    negative_prompt: str = ""
    record_images: bool = True
    record_latents: bool = True  # False for log-prob-free algorithms (DiffusionNFT)
    same_initial_noise: bool = False  # DanceGRPO: one x_T per prompt
    # tokens
    max_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0


class LeaseRequest(Message, tag="lease_request", kw_only=True):
    worker_id: str
    capacity: int = 1  # prompt groups the worker can take


class Lease(Message, tag="lease", kw_only=True):
    lease_id: str
    worker_id: str
    prompts: list[PromptSpec]
    sampling: SamplingParams
    deadline: float  # unix time, seconds
    policy_version: int  # the version the worker must hold before it samples
    reward_address: str = ""


class LeaseReturn(Message, tag="lease_return", kw_only=True):
    """A worker gives back a lease it could not finish (its sampling failed): its groups
    are issued again at once instead of at the lease's deadline. No reply.

    ``bad_sampling``: the model refused the lease's sampling parameters (a size, SDE type or
    group size it cannot honour): the run's configuration, not the worker, so no worker
    can sample it and the trainer ends the run with ``reason`` instead of issuing it again.
    """

    lease_id: str
    worker_id: str
    reason: str = ""
    bad_sampling: bool = False


# ---------------------------------------------------------------------------- trajectories


class Rewards(Message, tag="rewards", kw_only=True):
    """Per-sample rewards of one group, every component named.

    ``total[i] = sum_k weights[k] * components[k][i]``.
    """

    finite_fields: ClassVar[tuple[str, ...]] = ("components", "total")
    group_id: str
    total: list[float]
    components: dict[str, list[float]] = {}
    weights: dict[str, float] = {}
    scorer: str = ""  # reward worker id
    details: dict[str, Any] = {}  # e.g. strict pass / fail per sample


class DiffusionTrajectoryGroup(Message, tag="diffusion_group", kw_only=True):
    """G trajectories of one prompt from one policy version.

    Only the recorded steps (the SDE window) are carried.
    """

    finite_fields: ClassVar[tuple[str, ...]] = (
        "latents",
        "next_latents",
        "log_probs",
        "timesteps",
        "sigmas",
        "next_sigmas",
        "final_latents",
    )
    group_id: str
    lease_id: str
    worker_id: str
    prompt: PromptSpec
    sampling: SamplingParams
    policy_version: int
    architecture: str = ""
    seeds: Tensor  # int64 [G]
    # recorded transitions x_{k} -> x_{k+1}; absent (None) for log-prob-free algorithms
    step_indices: Tensor | None = None  # int64 [K] indices into the sampling schedule
    timesteps: Tensor | None = None  # float32 [K] model timesteps (sigma * 1000)
    sigmas: Tensor | None = None  # float32 [K]
    next_sigmas: Tensor | None = None  # float32 [K]
    noise_levels: Tensor | None = None  # float32 [K] per-step noise level
    latents: Tensor | None = None  # float32 [G, K, C, H, W]
    next_latents: Tensor | None = None  # float32 [G, K, C, H, W]
    log_probs: Tensor | None = None  # float32 [G, K] behaviour log-probs
    final_latents: Tensor | None = None  # float32 [G, C, H, W] x_0
    # conditioning, once per group (model dtype)
    prompt_embeds: Tensor | None = None  # [L, D]
    prompt_embeds_mask: Tensor | None = None  # bool [L]
    pooled_prompt_embeds: Tensor | None = None  # [D']
    negative_prompt_embeds: Tensor | None = None  # [L', D]
    negative_prompt_embeds_mask: Tensor | None = None  # bool [L']
    negative_pooled_prompt_embeds: Tensor | None = None  # [D']
    images: Tensor | None = None  # uint8 [G, H, W, 3] (video: [G, F, H, W, 3])
    extra: dict[str, Tensor] = {}  # model-family specific tensors
    rewards: Rewards | None = None
    timings: dict[str, float] = {}  # seconds by phase: encode_s, denoise_s, decode_s, pack_s


class MediaRef(msgspec.Struct, kw_only=True):
    """A multimodal input by reference (a path or URI the trainer can read)."""

    modality: Literal["image", "audio", "video"]
    uri: str
    sha256: str = ""


class TokenTrajectoryGroup(Message, tag="token_group", kw_only=True):
    """G responses to one prompt from a token policy (e.g. an omni model's thinker)."""

    finite_fields: ClassVar[tuple[str, ...]] = ("log_probs",)
    group_id: str
    lease_id: str
    worker_id: str
    prompt: PromptSpec
    sampling: SamplingParams
    policy_version: int
    architecture: str = ""
    stage: str = ""  # the trained stage, e.g. "thinker"
    prompt_ids: Tensor  # int64 [Lp]
    response_ids: Tensor  # int64 [G, Lr]
    response_mask: Tensor  # bool [G, Lr]
    log_probs: Tensor  # float32 [G, Lr]
    multimodal: list[MediaRef] = []
    texts: list[str] = []  # decoded responses, for text rewards
    rewards: Rewards | None = None
    timings: dict[str, float] = {}


# --------------------------------------------------------------------------------- weights


class WeightUpdate(Message, tag="weight_update", kw_only=True):
    """Chunk ``chunk`` of ``num_chunks`` of policy version ``version``.

    ``checksum`` is the hex sha256 over the raw bytes of this chunk's tensors in order;
    ``update_checksum`` the sha256 over all chunks' checksums (hex, concatenated in chunk
    order), so that a receiver knows when it holds the whole, intact update.
    """

    version: int
    format: WeightFormat
    chunk: int
    num_chunks: int
    names: list[str]
    tensors: list[Tensor]
    checksum: str
    update_checksum: str = ""
    total_bytes: int = 0
    adapter_config: dict[str, Any] = {}  # PEFT LoraConfig fields when format == "lora"


class WeightRequest(Message, tag="weight_request", kw_only=True):
    """Ask for the newest version above ``have_version`` (-1: none held, e.g. a late joiner)."""

    worker_id: str
    have_version: int = -1


# ------------------------------------------------------------------------------- liveness


class Heartbeat(Message, tag="heartbeat", kw_only=True):
    worker_id: str
    role: Role
    policy_version: int = -1
    leases: list[str] = []  # lease ids in hand
    time: float = 0.0
    stats: dict[str, float] = {}


class Ack(Message, tag="ack", kw_only=True):
    ref: str  # id of what is acknowledged (lease, group, version)
    detail: str = ""


class Refusal(Message, tag="refusal", kw_only=True):
    """A message was not accepted; ``code`` is machine-readable, ``reason`` for people.
    ``retry_after_s`` > 0: the same request will be refused for that long (a benched rollout
    worker's lease requests); the peer waits instead of polling. 0: no such promise."""

    finite_fields: ClassVar[tuple[str, ...]] = ("retry_after_s",)
    code: str
    reason: str
    ref: str = ""
    retry_after_s: float = 0.0


# --------------------------------------------------------------------------------- status


class StatusRequest(Message, tag="status_request", kw_only=True):
    """Ask the trainer (on ``control``) for a :class:`Status`; used by ``omnirl status``."""

    worker_id: str = ""


class WorkerStatus(msgspec.Struct, kw_only=True):
    worker_id: str
    role: str
    policy_version: int = -1
    last_seen_s: float = 0.0  # seconds since the trainer last heard from it
    leases: list[str] = []
    address: str = ""
    benched_s: float = 0.0  # seconds until it gets leases again (its leases kept failing)


class Status(Message, tag="status", kw_only=True):
    """The trainer's view of the run: fleet, versions, leases in flight, intake rate."""

    run_id: str
    state: str = "running"  # running | stepping | shutdown
    policy_version: int = -1
    step: int = 0
    max_steps: int = 0
    workers: list[WorkerStatus] = []
    leases_in_flight: int = 0
    groups_buffered: int = 0
    intake_rate: float = 0.0  # accepted groups per second, recent window
    counters: dict[str, int] = {}


AnyMessage = (
    Hello
    | Welcome
    | LeaseRequest
    | Lease
    | LeaseReturn
    | Rewards
    | DiffusionTrajectoryGroup
    | TokenTrajectoryGroup
    | WeightUpdate
    | WeightRequest
    | Heartbeat
    | Ack
    | Refusal
    | StatusRequest
    | Status
)

MESSAGE_TYPES: tuple[type[Message], ...] = AnyMessage.__args__  # type: ignore[attr-defined]
