"""Pretrain a ShapesT2I model with flow matching on renders of ShapesEval train prompts.

    uv run python -m omnirl.tools.pretrain_shapes OUT_DIR [--minutes 60] [--device cpu]
        [--batch 64] [--lr 5e-4] [--preset base] [--eval-every 5] [--eval-prompts 120]
        [--snapshots]

Latent presets first train their VAE for ``--vae-minutes`` (``omnirl.tools.shapes_vae``) and
freeze it; ``x0`` is then the VAE's scaled latent of the render. Rectified flow:
``x_t = (1 - t) x0 + t eps``, target ``v = eps - x0``, ``t`` logit-normal
(SD3's ``logit_normal(0, 1)``), the model called at timestep ``1000 t`` as SD3's sampler
calls it. Each batch draws train-split prompts (categories balanced) and renders them with
fresh random seeds; 10 % of the texts are replaced by the empty prompt (the negative prompt
of classifier-free guidance). The transformer and the text encoder train jointly (AdamW);
an EMA of both is what is evaluated and saved. Every ``--eval-every`` minutes the EMA model
is scored on held-out prompts and on train prompts (strict accuracy,
``omnirl.tools.eval_shapes``) and written to ``OUT_DIR`` (a ShapesT2I folder);
``OUT_DIR/pretrain_log.jsonl`` holds the curve. With ``--snapshots`` every evaluated model
is also kept as ``OUT_DIR/snapshots/step_NNNNNNN``, so that a base model of a chosen
accuracy can be picked afterwards.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from omnirl.models.shapes_t2i import PRESETS, ShapesT2IRolloutAdapter, build_pipeline
from omnirl.reward.shapes import CATEGORIES, generate_prompts, render_batch, specs_in_split
from omnirl.reward.shapes.world import all_specs
from omnirl.tools.eval_shapes import evaluate, summarise
from omnirl.tools.shapes_caption_noise import ALL_KINDS, check_kinds, drawn_specs

CFG_DROPOUT = 0.1


def shapes_vocabulary() -> list[str]:
    """Every word of every ShapesEval prompt (all categories, both splits), sorted."""
    return sorted({w for c in CATEGORIES for s in all_specs(c) for w in s.text.split()})


class TrainBatches(torch.utils.data.IterableDataset):
    """Endless batches of train-split renders: ``(texts, images uint8 [B, 32, 32, 3])``.

    Categories are balanced; every image gets a fresh random seed. With ``caption_noise``
    > 0 that fraction of the images is drawn from a mislabelled spec
    (:mod:`omnirl.tools.shapes_caption_noise`, errors of ``caption_noise_kinds``) under its
    unchanged caption. Each DataLoader worker
    draws from its own generator (``seed``, worker id), so workers never repeat each other.
    """

    def __init__(
        self,
        batch: int,
        seed: int,
        caption_noise: float = 0.0,
        caption_noise_kinds: tuple[str, ...] = ALL_KINDS,
    ):
        self.batch_size = batch
        self.seed = seed
        self.caption_noise = caption_noise
        self.caption_noise_kinds = tuple(caption_noise_kinds)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        rng = np.random.default_rng([self.seed, info.id if info is not None else 0])
        pools = [specs_in_split(c, "train") for c in CATEGORIES]
        while True:
            cats = rng.integers(0, len(pools), size=self.batch_size)
            specs = [pools[c][rng.integers(0, len(pools[c]))] for c in cats]
            seeds = rng.integers(0, 2**62, size=self.batch_size).tolist()
            drawn = drawn_specs(specs, self.caption_noise, rng, self.caption_noise_kinds)
            yield [s.text for s in specs], torch.from_numpy(render_batch(drawn, 32, seeds))


def train_batches(
    batch: int,
    seed: int,
    workers: int,
    caption_noise: float = 0.0,
    caption_noise_kinds: tuple[str, ...] = ALL_KINDS,
):
    """An iterator over :class:`TrainBatches`, rendered in ``workers`` processes (0: inline)."""
    loader = torch.utils.data.DataLoader(
        TrainBatches(batch, seed, caption_noise, caption_noise_kinds),
        batch_size=None,
        num_workers=workers,
        prefetch_factor=4 if workers else None,
        persistent_workers=workers > 0,
    )
    return iter(loader)


@torch.no_grad()
def ema_update(ema: torch.nn.Module, model: torch.nn.Module, decay: float) -> None:
    """``ema <- decay * ema + (1 - decay) * model``, one fused op over all parameters."""
    torch._foreach_lerp_(
        list(ema.parameters()), [p.detach() for p in model.parameters()], 1.0 - decay
    )


def save_atomic(pipe, out_dir: Path) -> None:
    """Write the pipeline to ``out_dir`` via a sibling temp folder (a reader never sees half)."""
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.save_pretrained(tmp)
    keep = {"pretrain_log.jsonl", "eval_grid.png", "snapshots"}
    out_dir.mkdir(parents=True, exist_ok=True)
    for child in out_dir.iterdir():
        if child.name not in keep:
            shutil.rmtree(child) if child.is_dir() else child.unlink()
    for child in tmp.iterdir():
        child.rename(out_dir / child.name)
    tmp.rmdir()


def load_trained_vae(path: Path, fresh: torch.nn.Module | None) -> torch.nn.Module:
    """The frozen float32 ``AutoencoderKL`` of ``path`` (a ShapesT2I folder or its ``vae/``),
    checked against ``fresh``, the preset's untrained VAE: same architecture, a fitted latent
    scaling. ``ValueError`` names what does not fit."""
    from diffusers import AutoencoderKL

    if fresh is None:
        raise ValueError("the preset is a pixel-space model; it has no VAE to reuse")
    folder = path / "vae" if (path / "vae" / "config.json").is_file() else path
    if not (folder / "config.json").is_file():
        raise ValueError(f"{path} holds no VAE (no config.json there or in vae/)")
    vae = AutoencoderKL.from_pretrained(folder, dtype=torch.float32)
    for key in ("block_out_channels", "latent_channels", "in_channels", "sample_size"):
        # json gives lists where the fresh config holds tuples: compare as JSON
        ours, needed = vae.config[key], fresh.config[key]
        if json.dumps(ours) != json.dumps(needed):
            raise ValueError(f"the VAE in {folder} has {key}={ours}, the preset needs {needed}")
    if vae.config.scaling_factor == 1.0 and not vae.config.shift_factor:
        raise ValueError(f"the VAE in {folder} has no fitted latent scaling (was it trained?)")
    return vae.requires_grad_(False).eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m omnirl.tools.pretrain_shapes", description=__doc__.split("\n")[0]
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument(
        "--minutes", type=float, default=60.0, help="wall-clock budget of the flow-matching stage"
    )
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    # one intra-op thread: on the shared 2-core machine (load 6-9) two OpenMP threads spin
    # against each other and ran 1.5-8x slower than one (measured)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--warmup", type=int, default=100, help="linear LR warm-up steps")
    parser.add_argument("--ema", type=float, default=0.999, help="EMA decay")
    parser.add_argument("--preset", default="base", choices=sorted(PRESETS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=float, default=5.0, help="minutes between evals")
    parser.add_argument("--eval-prompts", type=int, default=120, help="held-out prompts")
    parser.add_argument("--eval-cfg", type=float, default=3.0)
    parser.add_argument("--eval-steps", type=int, default=10)
    parser.add_argument(
        "--eval-train-prompts", type=int, default=0, help="train prompts scored too (0: none)"
    )
    parser.add_argument(
        "--snapshots", action="store_true", help="keep every evaluated model in OUT_DIR/snapshots"
    )
    parser.add_argument("--workers", type=int, default=0, help="render processes (0: inline)")
    parser.add_argument(
        "--vae-minutes", type=float, default=1.5, help="latent presets: VAE stage first"
    )
    parser.add_argument("--vae-lr", type=float, default=1e-3)
    parser.add_argument(
        "--vae-from",
        type=Path,
        default=None,
        help="latent presets: a ShapesT2I folder (or its vae/) whose trained VAE is reused, "
        "frozen, instead of the VAE stage (examples/checkpoints/shapes_t2i)",
    )
    parser.add_argument(
        "--caption-noise",
        type=float,
        default=0.0,
        help="fraction of images drawn with one caption error (shapes_caption_noise)",
    )
    parser.add_argument(
        "--caption-noise-kinds",
        default=",".join(ALL_KINDS),
        help="comma-separated error kinds --caption-noise may draw (default: all: "
        + ",".join(ALL_KINDS)
        + ")",
    )
    parser.add_argument("--log-every", type=int, default=20, help="steps between log lines")
    args = parser.parse_args(argv)
    if args.batch < 1 or args.minutes <= 0:
        parser.error("--batch must be >= 1 and --minutes > 0")
    if not 0.0 <= args.caption_noise <= 1.0:
        parser.error(f"--caption-noise must be in [0, 1], got {args.caption_noise}")
    try:
        kinds = check_kinds(tuple(k for k in args.caption_noise_kinds.split(",") if k))
    except ValueError as err:
        parser.error(f"--caption-noise-kinds: {err}")

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dev = torch.device(args.device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    pipe = build_pipeline(shapes_vocabulary(), PRESETS[args.preset], seed=args.seed)
    if args.vae_from is not None:
        try:
            pipe.vae = load_trained_vae(args.vae_from, pipe.vae)
        except (OSError, ValueError) as err:
            parser.error(f"--vae-from: {err}")
    pipe.to(dev)
    data = train_batches(args.batch, args.seed, args.workers, args.caption_noise, kinds)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    log_path = args.out_dir / "pretrain_log.jsonl"
    log_path.write_text("")

    def log(row: dict) -> None:
        with log_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)

    if pipe.vae is not None:  # stage 1: the VAE (trained here or reused), then frozen
        from omnirl.tools.shapes_vae import roundtrip_accuracy, train_vae

        if args.vae_from is None:
            train_vae(pipe, data, minutes=args.vae_minutes, lr=args.vae_lr, log=log)
        else:
            log({"event": "vae_reused", "path": str(args.vae_from)})
        check = generate_prompts(120, "heldout", seed=args.seed + 3)
        log({"event": "vae_roundtrip", "heldout_strict": roundtrip_accuracy(pipe, check)})
    ema = copy.deepcopy(pipe)
    ema.transformer.requires_grad_(False).eval()
    ema.text_encoder.requires_grad_(False).eval()
    modules = torch.nn.ModuleList([pipe.transformer, pipe.text_encoder])
    ema_modules = torch.nn.ModuleList([ema.transformer, ema.text_encoder])
    modules.train()
    n_params = sum(p.numel() for p in pipe.transformer.parameters())
    n_text = sum(p.numel() for p in pipe.text_encoder.parameters())
    opt = torch.optim.AdamW(
        modules.parameters(), lr=args.lr, weight_decay=0.0, fused=dev.type == "cuda"
    )
    heldout = generate_prompts(args.eval_prompts, "heldout", seed=args.seed + 1)
    train_eval = generate_prompts(args.eval_train_prompts, "train", seed=args.seed + 2)
    empty_ids = pipe.tokenize([""])  # [1, L]
    print(
        f"transformer {n_params / 1e6:.2f} M params, text encoder {n_text / 1e6:.2f} M; "
        f"batch {args.batch}, device {dev}, {args.threads} threads",
        flush=True,
    )

    def run_eval(step: int, train_s: float, samples: int) -> None:
        adapter = ShapesT2IRolloutAdapter(ema, device=dev)
        row = {
            "event": "eval",
            "step": step,
            "samples": samples,
            "train_minutes": round(train_s / 60, 2),
        }
        t0 = time.perf_counter()
        for split, specs in (("heldout", heldout), ("train", train_eval)):
            if not specs:
                continue
            run = evaluate(
                adapter, specs, seeds=1, guidance_scale=args.eval_cfg, num_steps=args.eval_steps
            )
            s = summarise(run)
            row[f"{split}_strict"] = round(s["overall"]["strict"], 4)
            row[f"{split}_partial"] = round(s["overall"]["partial"], 4)
            cats = {c: round(e["strict"], 3) for c, e in s["categories"].items()}
            row["per_category" if split == "heldout" else "train_per_category"] = cats
        row["eval_s"] = round(time.perf_counter() - t0, 1)
        log(row)
        save_atomic(ema, args.out_dir)
        if args.snapshots:
            ema.save_pretrained(args.out_dir / "snapshots" / f"step_{step:07d}")

    t_start = time.perf_counter()
    train_s, samples, step = 0.0, 0, 0
    next_eval = args.eval_every * 60
    window_t, window_n, window_loss = time.perf_counter(), 0, 0.0
    while True:
        t0 = time.perf_counter()
        texts, images = next(data)
        with torch.no_grad():  # pixels [B, 3, 32, 32] in [-1, 1], or scaled VAE latents
            x0 = pipe.images_to_latents(images)
        ids = pipe.tokenize(texts)  # [B, L]
        drop = torch.rand(args.batch, device=dev) < CFG_DROPOUT
        ids = torch.where(drop[:, None], empty_ids.expand_as(ids), ids)
        t = torch.sigmoid(torch.randn(args.batch, device=dev))  # logit-normal(0, 1)
        eps = torch.randn_like(x0)
        xt = (1 - t)[:, None, None, None] * x0 + t[:, None, None, None] * eps
        pe, pooled = pipe.encode_ids(ids)
        v = pipe.transformer(
            hidden_states=xt,
            timestep=t * 1000,
            encoder_hidden_states=pe,
            pooled_projections=pooled,
            return_dict=False,
        )[0]
        loss = (v.float() - (eps - x0)).pow(2).mean()
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, (step + 1) / args.warmup)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(modules.parameters(), 1.0)
        opt.step()
        decay = min(args.ema, (1 + step) / (10 + step))
        ema_update(ema_modules, modules, decay)
        window_loss += loss.item()  # waits for the device: the step's real end
        step += 1
        samples += args.batch
        train_s += time.perf_counter() - t0
        window_n += args.batch
        if step % args.log_every == 0:
            now = time.perf_counter()
            log(
                {
                    "event": "train",
                    "step": step,
                    "loss": round(window_loss / args.log_every, 5),
                    "samples_per_s": round(window_n / (now - window_t), 1),
                    "train_minutes": round(train_s / 60, 2),
                }
            )
            window_t, window_n, window_loss = now, 0, 0.0
        elapsed = time.perf_counter() - t_start
        done = elapsed >= args.minutes * 60 or (
            args.max_steps is not None and step >= args.max_steps
        )
        if done or train_s >= next_eval:
            run_eval(step, train_s, samples)
            next_eval = train_s + args.eval_every * 60
            window_t = time.perf_counter()  # eval time is not training throughput
        if done:
            break
    log(
        {
            "event": "done",
            "step": step,
            "samples": samples,
            "wall_minutes": round((time.perf_counter() - t_start) / 60, 2),
            "samples_per_s_train": round(samples / max(train_s, 1e-9), 1),
        }
    )
    if not math.isfinite(loss.item()):
        print("loss is not finite", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
