"""The rollout's VAE decode at SD3.5-Medium's shape: eager against compiled and channels-last.

The rollout decodes every image it samples (`vae_decode`: SD3's 16-channel AutoencoderKL
decoder, 64x64 latents -> 512x512 images, bf16). The fp8_best rollout spends about 0.0144
s/image there (sixteenth to eighteenth GPU sessions, `phase_decode_s_per_image`), 13 % of
the rollout and 3.4 % of the same-work iteration, while the decoder's 2.5 TFLOP an image
would take under 4 ms at the card's bf16 matmul rate: it runs in eager NCHW, where cuDNN
converts the layout around every convolution and GroupNorm is a separate kernel.

Variants, each timed in the same process on the same latents (`vae_decode` end to end,
uint8 images on the host, what the adapter returns) at 16 and at 4 images a call (the
fp8_best rollout's and the loop's `--decode-batch 4`):

- `eager`: what runs now (the baseline of every ratio);
- `channels_last`: the VAE's weights and the latents in channels-last memory;
- `compiled`: the decoder compiled whole (`omnirl.models.sd3.encoder.compile_vae_decoder`,
  what `SD3RolloutAdapter.compile_decoder` and `rollout --compile-decoder` run);
- `compiled_channels_last`: both.

Each row has ms per image, the ratio against `eager`, the compile time, and how far its
images are from eager's (max and mean |difference| in uint8 levels); with
`--float32-reference`, also from a float32 eager decode of the same latents (each variant's
own bf16 error).

    python benchmarks/vae_decode_probe.py --device cuda --out $OUT/vae
    python benchmarks/vae_decode_probe.py --tiny      # a CPU dry run at toy sizes
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_sd35m_setup import SD3_VAE, TINY_VAE, build_vae
from probe_timing import seconds_per_call, sync, write_results

VARIANTS = ("eager", "channels_last", "compiled", "compiled_channels_last")


def variant_vae(name: str, config: dict, device, dtype, backend: str):
    """A fresh VAE (same seed, same weights) set up as variant ``name``."""
    from omnirl.models.compile import CompileConfig
    from omnirl.models.sd3.encoder import compile_vae_decoder

    vae = build_vae(config, device, dtype)
    if "channels_last" in name:
        vae.to(memory_format=torch.channels_last)
    if name.startswith("compiled"):
        compile_vae_decoder(vae, CompileConfig(backend=backend))
    return vae


def _differences(images: torch.Tensor, other: torch.Tensor) -> tuple[int, float]:
    """Max and mean |difference| of two uint8 image batches, in levels."""
    diff = (images.int() - other.int()).abs().float()
    return int(diff.max()), round(float(diff.mean()), 4)


def measure(vae, z: torch.Tensor, device, seconds: float) -> tuple[torch.Tensor, float, float]:
    """Decode ``z`` once (the first call: compiles a compiled variant), then time it; returns
    the images, the first call's seconds and the steady seconds per call."""
    from omnirl.models.sd3.encoder import vae_decode

    with torch.no_grad():
        start = time.perf_counter()
        images = vae_decode(vae, z)
        sync(device)
        first = time.perf_counter() - start
        return (
            images,
            first,
            seconds_per_call(
                lambda: vae_decode(vae, z), device, seconds, warmup=2, batch=1, min_calls=3
            ),
        )


def run(args) -> list[dict]:
    from omnirl.models.sd3.encoder import vae_decode

    device = torch.device(args.device)
    dtype = (
        getattr(torch, args.dtype)
        if args.dtype
        else (torch.float32 if args.tiny else torch.bfloat16)
    )
    config = TINY_VAE if args.tiny else SD3_VAE
    side = args.side or (32 if args.tiny else 512)
    latent = side // 2 ** (len(config["block_out_channels"]) - 1)
    batches = [int(b) for b in args.batches.split(",")]
    gen = torch.Generator().manual_seed(0)
    latents = {
        b: torch.randn(b, config["latent_channels"], latent, latent, generator=gen).to(device)
        for b in batches
    }
    exact = {}  # images from a float32 eager VAE (same weights): each variant's own error
    if args.float32_reference and dtype != torch.float32:
        vae32 = build_vae(config, device, torch.float32)
        with torch.no_grad():
            exact = {b: vae_decode(vae32, z) for b, z in latents.items()}
        del vae32
    rows, reference = [], {}
    for name in args.variants.split(","):
        vae = variant_vae(name, config, device, dtype, args.backend)
        for b in batches:
            z = latents[b]
            if "channels_last" in name:
                z = z.contiguous(memory_format=torch.channels_last)
            row: dict = {"stage": name, "images_per_call": b}
            try:
                images, first, per_call = measure(vae, z, device, args.seconds)
                row.update(ms_per_image=round(per_call * 1e3 / b, 3), first_call_s=round(first, 2))
                if name == "eager":
                    reference[b] = (images, per_call)
                if b in exact:
                    row["vs_float32_max"], row["vs_float32_mean"] = _differences(images, exact[b])
                if b in reference:
                    row["speed_vs_eager"] = round(reference[b][1] / per_call, 3)
                    row["absdiff_max"], row["absdiff_mean"] = _differences(images, reference[b][0])
            except Exception as err:  # a failing variant is recorded; the others still run
                row["error"] = f"{type(err).__name__}: {err}"[:400]
            rows.append(row)
            print("RESULT", json.dumps(row), flush=True)
        torch._dynamo.reset()
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="toy VAE, for CPU tests")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--batches", default="16,4", help="images per decode call")
    p.add_argument("--dtype", default=None, help="default: bfloat16 (float32 with --tiny)")
    p.add_argument("--side", type=int, default=0, help="image side (default: 512; 32 --tiny)")
    p.add_argument("--seconds", type=float, default=3.0, help="timing per variant and batch")
    p.add_argument("--backend", default="inductor", help="torch.compile backend")
    p.add_argument(
        "--float32-reference",
        action="store_true",
        help="also compare every variant's images with a float32 eager decode (its own error)",
    )
    p.add_argument("--out", default=None, help="directory for vae_decode.jsonl")
    args = p.parse_args(argv)
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    rows = run(args)
    if args.out:
        write_results(args.out, "vae_decode", torch.device(args.device), rows)
    return rows


if __name__ == "__main__":
    main()
