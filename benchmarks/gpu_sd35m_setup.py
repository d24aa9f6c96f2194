"""Models, fake text conditioning and measuring helpers for ``gpu_sd35m.py``.

The SD3.5-Medium architecture (diffusers ``SD3Transformer2DModel``: 24 layers, 24 heads x 64,
dual attention in layers 0-12, q/k RMSNorm, caption projection 1536, joint attention 4096,
pooled 2048, ``pos_embed_max_size`` 384) and SD3's VAE (16 latent channels, 8x), with random
weights built on the device; no text encoders: prompt embeddings are random tensors of the
real shapes (``[B, 333, 4096]``: CLIP's 77 + T5's 256 tokens, pooled ``[B, 2048]``). The
``tiny`` preset has the same structure at toy sizes, for CPU tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import time
from typing import Any

import torch

from omnirl.models.device import synchronize

SD35M_TRANSFORMER: dict[str, Any] = {
    "sample_size": 128,
    "patch_size": 2,
    "in_channels": 16,
    "out_channels": 16,
    "num_layers": 24,
    "attention_head_dim": 64,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "caption_projection_dim": 1536,
    "pooled_projection_dim": 2048,
    "pos_embed_max_size": 384,
    "dual_attention_layers": tuple(range(13)),
    "qk_norm": "rms_norm",
}
SD3_VAE: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4,
    "block_out_channels": (128, 256, 512, 512),
    "layers_per_block": 2,
    "latent_channels": 16,
    "norm_num_groups": 32,
    "sample_size": 1024,
    "scaling_factor": 1.5305,
    "shift_factor": 0.0609,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}
TINY_TRANSFORMER: dict[str, Any] = dict(
    SD35M_TRANSFORMER,
    sample_size=16,
    num_layers=3,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    caption_projection_dim=32,
    pooled_projection_dim=32,
    pos_embed_max_size=16,
    dual_attention_layers=(0,),
)
TINY_VAE: dict[str, Any] = dict(
    SD3_VAE,
    down_block_types=("DownEncoderBlock2D",) * 2,
    up_block_types=("UpDecoderBlock2D",) * 2,
    block_out_channels=(8, 8),
    layers_per_block=1,
    norm_num_groups=4,
    sample_size=32,
)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Setup:
    """Sizes of one benchmark run. An iteration samples ``prompts x group`` images."""

    transformer: dict[str, Any]
    vae: dict[str, Any]
    side: int  # image height = width
    text_len: int  # prompt-embedding tokens
    steps: int = 10
    guidance: float = 4.5
    noise_level: float = 0.7
    prompts: int = 2
    group: int = 4
    micro: int = 4  # training micro-batch (samples; 2 rows each with CFG)
    lora_r: int = 32
    lora_alpha: int = 64
    kl_beta: float = 0.04  # the "with KL" runs (flow_grpo's SD3 configs use 0.04)

    @property
    def images(self) -> int:
        return self.prompts * self.group

    @property
    def trained_steps(self) -> int:  # flow_grpo: timestep_fraction 0.99 of 10 -> 9
        return max(1, int(self.steps * 0.99))

    @property
    def lora(self) -> dict[str, Any]:
        return {"r": self.lora_r, "lora_alpha": self.lora_alpha}


SETUPS = {
    "sd35m": Setup(transformer=SD35M_TRANSFORMER, vae=SD3_VAE, side=512, text_len=333),
    "tiny": Setup(
        transformer=TINY_TRANSFORMER,
        vae=TINY_VAE,
        side=32,
        text_len=24,
        steps=4,
        group=2,
        micro=2,
        lora_r=4,
        lora_alpha=8,
    ),
}


def build_transformer(config: dict[str, Any], device, dtype, seed: int = 0):
    """A random ``SD3Transformer2DModel`` built directly on ``device`` (fast on a GPU)."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(seed)
    with torch.device(device):
        model = SD3Transformer2DModel(**config)
    return model.to(dtype).eval()


def build_vae(config: dict[str, Any], device, dtype, seed: int = 1):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    with torch.device(device):
        vae = AutoencoderKL(**config)
    return vae.to(dtype).eval().requires_grad_(False)


def build_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)


class FakeTextPipeline:
    """Just what ``SD3RolloutAdapter`` reads from a ``StableDiffusion3Pipeline``, with random
    prompt embeddings in place of the three text encoders (a deterministic function of the
    prompt text, so every call and every process agrees)."""

    def __init__(self, transformer, vae, setup: Setup, device, dtype):
        self.transformer, self.vae, self.setup = transformer, vae, setup
        self.scheduler = build_scheduler()
        self.vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1)
        self.device, self.dtype = torch.device(device), dtype

    def embed(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """``prompt_embeds [B, L, D]`` and ``pooled [B, D']`` in the model dtype."""
        cfg = self.transformer.config
        rows, pooled = [], []
        for text in texts:
            seed = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=6).digest(), "little")
            gen = torch.Generator().manual_seed(seed)
            rows.append(torch.randn(self.setup.text_len, cfg.joint_attention_dim, generator=gen))
            pooled.append(torch.randn(cfg.pooled_projection_dim, generator=gen))
        to = {"device": self.device, "dtype": self.dtype}
        return torch.stack(rows).to(**to), torch.stack(pooled).to(**to)

    def encode_prompt(self, prompt, *, do_classifier_free_guidance, negative_prompt=None, **_):
        pe, pooled = self.embed(list(prompt))
        if not do_classifier_free_guidance:
            return pe, None, pooled, None
        npe, npooled = self.embed(list(negative_prompt))
        return pe, npe, pooled, npooled


def phases_per_image(groups, images: int) -> dict[str, float]:
    """The rollout's own phase timings of one ``sample`` call (encode, denoise, decode, pack:
    the device synchronised at each boundary), in seconds per image."""
    timings = groups[0].timings
    return {f"phase_{k[:-2]}_s_per_image": v / images for k, v in timings.items()}


class Clock:
    """Wall time with the device synchronised at both ends."""

    def __init__(self, device):
        self.device = device

    @contextlib.contextmanager
    def __call__(self, out: dict[str, float], key: str):
        synchronize(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            synchronize(self.device)
            out[key] = out.get(key, 0.0) + time.perf_counter() - start


def matmul_ceiling(device, dtype, *, n: int = 8192, seconds: float = 2.0) -> float:
    """Measured dense matmul rate (TFLOP/s) of ``[n, n] @ [n, n]`` in ``dtype``."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    synchronize(device)
    iters, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or iters < 3:
        for _ in range(5):
            a @ b
        iters += 5
        synchronize(device)
    elapsed = time.perf_counter() - start
    return 2 * n**3 * iters / elapsed / 1e12


def count_flops(fn) -> float:
    """FLOPs of ``fn()`` by ``torch.utils.flop_counter`` (matmuls, attention, convolutions)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return float(counter.get_total_flops())


def model_flops(pipe: FakeTextPipeline, setup: Setup, lora_transformer) -> dict[str, float]:
    """FLOPs of one image's work: a CFG forward (2 rows) of the transformer, a CFG forward
    plus backward with LoRA (one trained sample-timestep), one VAE decode."""
    dev, dtype = pipe.device, pipe.dtype
    h = setup.side // pipe.vae_scale_factor
    x = torch.randn(2, 16, h, h, device=dev, dtype=dtype)
    t = torch.full((2,), 500.0, device=dev)
    pe, pooled = pipe.embed(["a", "b"])

    def forward():
        return lora_transformer(
            hidden_states=x,
            timestep=t,
            encoder_hidden_states=pe,
            pooled_projections=pooled,
            return_dict=False,
        )[0]

    with torch.no_grad():
        fwd = count_flops(forward)
    train = count_flops(lambda: forward().float().square().mean().backward())
    lora_transformer.zero_grad(set_to_none=True)
    z = torch.randn(1, 16, h, h, device=dev, dtype=pipe.vae.dtype)
    with torch.no_grad():
        decode = count_flops(lambda: pipe.vae.decode(z, return_dict=False))
    return {"cfg_forward": fwd, "cfg_train": train, "decode": decode}


class Budget:
    """The run's wall-clock budget; ``scale`` shrinks the stage estimates (tiny runs)."""

    def __init__(self, seconds: float, scale: float):
        self.start, self.seconds, self.scale = time.perf_counter(), seconds, scale

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.start)


def dynamo_counts() -> dict[str, int]:
    """Graphs compiled, graph breaks, and frames dynamo could not compile (run eagerly)."""
    from torch._dynamo.utils import counters

    frames = counters["frames"]
    return {
        "unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "frames_not_compiled": int(frames.get("total", 0) - frames.get("ok", 0)),
    }
