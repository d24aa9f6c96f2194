"""The multi-process loop on one GPU machine (issue 9, item 5): end-to-end images/s.

One ``omnirl launch``: the trainer and one rollout worker on the same GPU, reward workers on
the machine's CPUs, everything over loopback ZeroMQ, exactly as a user runs it. The model
is SD3.5-Medium-shaped with random weights (no hub on the device): a real
``StableDiffusion3Pipeline`` folder written by this script, whose transformer and VAE are the
real architectures of ``gpu_sd35m_setup.py`` and whose three text encoders have the real
widths (CLIP-L 768, CLIP-G 1280, T5 4096) and sequence lengths (77 + 256 = 333 tokens) but
two layers each instead of 12 / 32 / 24 (they run once per prompt, not per step; the full
ones would only add disk and load time). Work per update as in ``gpu_sd35m.py``'s "same
work" row: FlowGRPO, LoRA r 32, 512 x 512, 10 steps with CFG 4.5, 9 trained steps with the
KL reference pass (``kl_beta`` 0.04), groups of 8; the reward is JPEG compressibility (CPU).

    python benchmarks/gpu_loop.py --out runs/gpu_loop --minutes 5          # on the GPU
    uv run python benchmarks/gpu_loop.py --tiny --device cpu --out runs/gpu_loop_tiny --minutes 1

Writes ``<out>/gpu_loop.json`` (the summary below), the run's metrics, config and logs.
Steady state is every optimiser step after the first ``--warmup-steps`` (compilation and
the first weight load land there): images/s = samples trained / trainer wall time over
those steps. Also from the logs: the rollout's seconds per lease, the trainer's publish
time and the rollout's apply time for each LoRA version. Two runs on one ``--compile-cache``
make the second a warm start: its summary's ``rollout_model_ready_s``, ``rollout_warmup_s``,
``rollout_first_group_s`` (from the worker's first log line) and
``rollout_first_group_after_launch_s`` (from the launcher's start, imports included) say how
soon a worker with a filled cache sampled (issue 9, item 7).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_sd35m_setup import SETUPS, build_scheduler, build_transformer, build_vae

# Text encoders: the real widths and lengths, two layers (see the module docstring).
TEXT_ENCODERS = {
    "sd35m": {
        "clip_l": {"hidden": 768, "heads": 12, "ffn": 3072},
        "clip_g": {"hidden": 1280, "heads": 20, "ffn": 5120},
        "t5": {"d_model": 4096, "d_kv": 64, "d_ff": 10240, "heads": 64},
        "clip_len": 77,
        "t5_len": 256,
        "layers": 2,
    },
    "tiny": {
        "clip_l": {"hidden": 16, "heads": 2, "ffn": 32},
        "clip_g": {"hidden": 16, "heads": 2, "ffn": 32},
        "t5": {"d_model": 32, "d_kv": 8, "d_ff": 64, "heads": 2},
        "clip_len": 8,
        "t5_len": 16,
        "layers": 2,
    },
}


def write_model(path: Path, preset: str, device: str, dtype: torch.dtype) -> Path:
    """Write the random pipeline folder (once; an existing folder is reused)."""
    from diffusers import StableDiffusion3Pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from omnirl.models.sd3.tiny import build_tokenizers

    if (path / "model_index.json").exists():
        return path
    setup, text = SETUPS[preset], TEXT_ENCODERS[preset]
    if text["clip_len"] + text["t5_len"] != setup.text_len:
        raise ValueError(f"text lengths do not add up to the setup's {setup.text_len}")
    clip_tok, t5_tok = build_tokenizers(text["clip_len"], text["t5_len"])

    def clip(spec, seed):
        torch.manual_seed(seed)
        config = CLIPTextConfig(
            vocab_size=len(clip_tok),
            hidden_size=spec["hidden"],
            intermediate_size=spec["ffn"],
            projection_dim=spec["hidden"],
            num_hidden_layers=text["layers"],  # SD3 reads the penultimate hidden state
            num_attention_heads=spec["heads"],
            max_position_embeddings=text["clip_len"],
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
            hidden_act="gelu",
        )
        with torch.device(device):
            return CLIPTextModelWithProjection(config).to(dtype)

    t5 = text["t5"]
    torch.manual_seed(3)
    with torch.device(device):
        t5_model = T5EncoderModel(
            T5Config(
                vocab_size=len(t5_tok),
                d_model=t5["d_model"],
                d_kv=t5["d_kv"],
                d_ff=t5["d_ff"],
                num_layers=text["layers"],
                num_heads=t5["heads"],
                feed_forward_proj="gated-gelu",  # T5 v1.1, as SD3's T5-XXL
                pad_token_id=0,
                eos_token_id=1,
                decoder_start_token_id=0,
            )
        ).to(dtype)
    pipe = StableDiffusion3Pipeline(
        transformer=build_transformer(setup.transformer, device, dtype),
        scheduler=build_scheduler(),
        vae=build_vae(setup.vae, device, dtype),
        text_encoder=clip(text["clip_l"], 1),
        tokenizer=clip_tok,
        text_encoder_2=clip(text["clip_g"], 2),
        tokenizer_2=clip_tok,
        text_encoder_3=t5_model,
        tokenizer_3=t5_tok,
    )
    tmp = path.with_name(path.name + ".partial")
    pipe.save_pretrained(tmp, safe_serialization=True)
    tmp.rename(path)
    return path


def compile_cache(args, out: Path) -> Path:
    """The trainer's and the worker's compile cache directory: ``--compile-cache``, or one
    of the run's own (a cold start)."""
    return args.compile_cache.resolve() if args.compile_cache else out / "compile_cache"


def write_config(args, model: Path, out: Path) -> Path:
    """The run's YAML (only what differs from the trainer's defaults)."""
    setup = SETUPS[args.preset]
    cache = compile_cache(args, out)
    compile_train = "true" if args.compile else "false"
    lines = f"""\
run:
  name: gpu_loop
  output_dir: {out / "run"}
  device: {args.device}
  dtype: {args.dtype}
model:
  path: {model}
  lora:
    r: {setup.lora_r}
    alpha: {setup.lora_alpha}
algorithm:
  name: flow_grpo
  overrides:
    micro_batch_size: {args.micro or setup.micro}
    timestep_fraction: 0.99
data:
  prompts: {args.prompts}
  group_size: {args.group_size}
sampling:
  num_steps: {setup.steps}
  guidance_scale: {setup.guidance}
  height: {setup.side}
  width: {setup.side}
reward:
  scorer: jpeg_compressibility
train:
  groups_per_step: {args.groups_per_step}
  max_staleness: {args.max_staleness}
  lr: 1.0e-4
  kl_beta: {setup.kl_beta}
  compile: {compile_train}
  compile_cache: {cache if args.compile else "null"}
  attention: {args.attention}
{_activation_budget(args)}{_train_float8(args)}runtime:
  control_port: 0
  lease_timeout_s: 900
  heartbeat_timeout_s: 300
logging:
  tensorboard: false
  progress_bar: false
checkpoint:
  every: 0
max_steps: {args.max_steps}
max_minutes: {args.minutes}
"""
    path = out / "gpu_loop.yaml"
    path.write_text(lines)
    return path


def _activation_budget(args) -> str:
    """``train.activation_memory_budget`` (indented under ``train:``), or nothing."""
    if args.activation_memory_budget is None:
        return ""
    return f"  activation_memory_budget: {args.activation_memory_budget}\n"


def _train_float8(args) -> str:
    """The trainer's float8 keys (indented under ``train:``), or nothing."""
    if not args.train_float8:
        return ""
    lines = [
        "float8: true",
        f"float8_activation: {args.train_float8}",
        f"float8_fast_accum: {'true' if args.float8_fast_accum else 'false'}",
        f"float8_fuse_projections: {'true' if args.float8_fuse_projections else 'false'}",
    ]
    if args.float8_recalibrate_every is not None:
        lines.append(f"float8_recalibrate_every: {args.float8_recalibrate_every}")
    return "".join(f"  {line}\n" for line in lines)


def launch(args, config: Path, out: Path) -> int:
    """``omnirl launch`` the run; its interleaved output goes to ``<out>/launch.log``."""
    rollout = ["--dtype", args.dtype, "--attention", args.attention]
    if not args.device.startswith("cuda"):
        # on a GPU run the launcher gives the worker its GPU (``rollout_devices``); the
        # summary's ``rollout_device`` says which one it took
        rollout = ["--device", args.device, *rollout]
    if args.compile:
        rollout += ["--compile", "--compile-cache", str(compile_cache(args, out))]
        if args.rollout_compile_mode:
            rollout += ["--compile-mode", args.rollout_compile_mode]
        if args.compile_decoder:
            rollout += ["--compile-decoder"]
    if args.float8:
        rollout += ["--float8", args.float8]
        if args.float8_fast_accum:
            rollout += ["--float8-fast-accum"]
        if args.float8_fuse_projections:
            rollout += ["--float8-fuse-projections"]
        if args.float8_recalibrate_every is not None:
            rollout += ["--float8-recalibrate-every", str(args.float8_recalibrate_every)]
    if args.decode_batch is not None:
        rollout += ["--decode-batch", str(args.decode_batch)]
    cmd = [
        sys.executable,
        "-c",
        "import sys; from omnirl.tools.cli import main; sys.exit(main())",
        "launch",
        str(config),
        "--rollout",
        "1",
        "--reward",
        str(args.reward_workers),
        f"--rollout-args={shlex.join(rollout)}",  # the "=" form: the value starts with a dash
    ]
    # when the launcher started, for the worker's first group counted from it (its imports,
    # the model's build and compile, its first lease); read back by ``--summarize-only``
    (out / "launched_at").write_text(f"{time.time():.3f}\n")
    with open(out / "launch.log", "w") as log:
        return subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)


_LEASE = re.compile(r"lease \S+ done at version \d+ in ([0-9.]+) s")
_BUILT = re.compile(r"built \S+ for \S+ on (\S+) \(")
_APPLIED = re.compile(r"applied weights version=(\d+) format=(\w+) .* in ([0-9.]+) s")
_GREW = re.compile(r"largest input grew up to ([0-9.]+)x")
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ", re.M)
_READY = re.compile(r"model ready in ([0-9.]+) s")
_WARMED = re.compile(r"compiled backend warmed up in ([0-9.]+) s")
_PEAK = re.compile(r"device memory peak ([0-9.]+) GB allocated, ([0-9.]+) GB reserved")


def summarize(args, out: Path, started: float) -> dict:
    """Steady-state throughput and the weight-push times from the run's files."""
    metrics = [
        json.loads(line)
        for line in (out / "run" / "metrics.jsonl").read_text().splitlines()
        if line.startswith("{")
    ]
    steps = [m for m in metrics if "num_samples" in m and "elapsed_s" in m]
    summary: dict = {"preset": args.preset, "device": args.device, "steps": len(steps)}
    if torch.cuda.is_available() and args.device.startswith("cuda"):
        summary["gpu"] = torch.cuda.get_device_name(0)
    steady = steps[args.warmup_steps :]
    if len(steady) >= 2:
        samples = sum(m["num_samples"] for m in steady[1:])
        wall = steady[-1]["elapsed_s"] - steady[0]["elapsed_s"]
        summary.update(
            steady_steps=len(steady) - 1,
            steady_samples=samples,
            steady_wall_s=round(wall, 2),
            images_per_s=round(samples / wall, 3),
            s_per_image=round(wall / samples, 4),
            train_step_s_median=round(statistics.median(m["time_s"] for m in steady), 3),
            publish_s_median=round(statistics.median(m["publish_s"] for m in steady), 4),
            weight_bytes=steady[-1].get("weight_bytes"),
            staleness_mean=round(statistics.mean(m["staleness_mean"] for m in steady), 3),
            logp_absdiff_mean=statistics.mean(m["behav_prox_logp_absdiff_mean"] for m in steady),
            logp_absdiff_max=max(m["behav_prox_logp_absdiff_max"] for m in steady),
        )
    snapshots = [m["snapshot_s"] for m in steady if "snapshot_s" in m]
    if snapshots:  # train.step_snapshot: the host copy taken before each step
        summary["snapshot_s_median"] = round(statistics.median(snapshots), 4)
        summary["snapshot_share_of_update"] = round(
            statistics.median(snapshots) / statistics.median(m["step_s"] for m in steady), 4
        )
    fallbacks = sum(m.get("micro_batch_fallbacks", 0) for m in steps)
    if fallbacks:  # the trainer ran out of memory and went on at a smaller micro-batch
        summary["micro_batch_fallbacks"] = fallbacks
        summary["micro_batch_size"] = next(
            m["micro_batch_size"] for m in reversed(steps) if "micro_batch_size" in m
        )
    for kind in ("allocated", "reserved"):  # the trainer's most in any step (not on a CPU)
        peaks = [m[f"device_peak_{kind}_gb"] for m in steps if f"device_peak_{kind}_gb" in m]
        if peaks:
            summary[f"trainer_peak_{kind}_gb"] = max(peaks)
    if steps:
        summary["first_step_elapsed_s"] = round(steps[0]["elapsed_s"], 1)
        summary["reward_first_last"] = [steps[0]["reward_mean"], steps[-1]["reward_mean"]]
    rollout_log = out / "run" / "logs" / "rollout-0.log"
    if rollout_log.exists():
        text = rollout_log.read_text()
        built = _BUILT.search(text)
        if built:
            summary["rollout_device"] = built.group(1)
        leases = [float(x) for x in _LEASE.findall(text)]
        applied = [(int(v), f, float(s)) for v, f, s in _APPLIED.findall(text)]
        if leases:
            tail = leases[len(leases) // 4 :]  # past compilation
            summary["rollout_lease_s_median"] = round(statistics.median(tail), 3)
            summary["rollout_s_per_image"] = round(statistics.median(tail) / args.group_size, 4)
            summary["leases"] = len(leases)
        launched = out / "launched_at"
        launched_at = float(launched.read_text()) if launched.exists() else None
        summary.update(worker_start(text, launched_at))
        peaks = [(float(a), float(r)) for a, r in _PEAK.findall(text)]
        if peaks:  # the worker's most in any lease
            summary["rollout_peak_allocated_gb"] = max(a for a, _ in peaks)
            summary["rollout_peak_reserved_gb"] = max(r for _, r in peaks)
        if len(applied) > 1:
            summary["apply_s_median"] = round(statistics.median(s for _, _, s in applied[1:]), 4)
        if args.float8 == "static":
            summary["float8_calibrations"] = text.count("layers calibrated")
            grew = [float(x) for x in _GREW.findall(text)]
            if grew:
                summary["float8_input_growth_max"] = max(grew)
    trainer_log = out / "run" / "logs" / "trainer.log"
    if args.train_float8 == "static" and trainer_log.exists():
        summary["trainer_float8_calibrations"] = trainer_log.read_text().count("layers calibrated")
    summary["wall_s"] = round(time.time() - started, 1)
    return summary


def worker_start(text: str, launched_at: float | None = None) -> dict:
    """The worker's start-up from its log: model ready (build, compile, warm-up) and warm-up
    alone, as it logs them; ``rollout_first_group_s``, its first lease done, counted from its
    first log line (so after its imports, a few seconds), and with ``launched_at`` (the
    launcher's start, seconds since the epoch, this machine's clock)
    ``rollout_first_group_after_launch_s``, counted from there; whether it loaded a compile
    cache."""
    out: dict = {"rollout_cache_loaded": "loaded compile cache" in text}
    for key, pattern in (("rollout_model_ready_s", _READY), ("rollout_warmup_s", _WARMED)):
        found = pattern.search(text)
        if found:
            out[key] = float(found.group(1))
    first = _STAMP.search(text)
    done = next((line for line in text.splitlines() if _LEASE.search(line)), "")
    done_at = _STAMP.match(done)
    if first and done_at:
        fmt = "%Y-%m-%d %H:%M:%S,%f"
        start = datetime.datetime.strptime(first.group(1), fmt)
        end = datetime.datetime.strptime(done_at.group(1), fmt)
        out["rollout_first_group_s"] = round((end - start).total_seconds(), 1)
        if launched_at is not None:  # the log's times are local, as time.time() reads them
            out["rollout_first_group_after_launch_s"] = round(end.timestamp() - launched_at, 1)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with the preset and dtype it implies."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/gpu_loop"))
    p.add_argument("--model-dir", type=Path, default=None, help="default: <out>/model")
    p.add_argument("--tiny", action="store_true", help="toy sizes (a CPU dry run)")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--dtype", default=None, help="default bfloat16 (float32 with --tiny)")
    p.add_argument("--minutes", type=float, default=5.0, help="the trainer's max_minutes")
    p.add_argument("--max-steps", type=int, default=1000)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--groups-per-step", type=int, default=2)
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--reward-workers", type=int, default=1)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--attention", default="default", help="SDPA kernel, trainer and rollout")
    p.add_argument("--micro", type=int, default=0, help="training micro-batch (samples)")
    p.add_argument("--rollout-compile-mode", default=None)
    p.add_argument(
        "--compile-cache",
        type=Path,
        default=None,
        help="compile cache directory for the trainer and the worker (default: <out>/"
        "compile_cache, a cold start); a second run on the same one measures a warm start",
    )
    p.add_argument(
        "--activation-memory-budget",
        type=float,
        default=None,
        help="train.activation_memory_budget: the share of a compiled block's activations "
        "the trainer keeps for the backward (the rest recomputed)",
    )
    p.add_argument(
        "--float8",
        nargs="?",
        const="rowwise",
        default=None,
        choices=["rowwise", "static"],
        help="the rollout's block linears in float8 (Hopper+), activations scaled per row or "
        "per layer (static, calibrated on the first call)",
    )
    p.add_argument(
        "--train-float8",
        default=None,
        choices=["rowwise", "static"],
        help="the trainer's block linears in float8 too (train.float8, float8_activation)",
    )
    p.add_argument("--float8-fast-accum", action="store_true", help="rollout and trainer")
    p.add_argument(
        "--float8-fuse-projections",
        action="store_true",
        help="rollout and trainer: each attention's q, k and v as one float8 matmul",
    )
    p.add_argument(
        "--float8-recalibrate-every",
        type=int,
        default=None,
        help="the worker's --float8-recalibrate-every and the trainer's "
        "train.float8_recalibrate_every (default: theirs)",
    )
    p.add_argument(
        "--compile-decoder",
        action="store_true",
        help="the worker compiles its VAE decoder too (rollout --compile-decoder)",
    )
    p.add_argument(
        "--decode-batch",
        type=int,
        default=None,
        help="the worker's --decode-batch (images per VAE call; 0: all in one; default: "
        "the launcher's, a few a call for a worker on the trainer's GPU)",
    )
    p.add_argument("--prompts", default="examples/prompts/animals.jsonl")
    p.add_argument(
        "--summarize-only",
        action="store_true",
        help="only summarise the run already in --out (e.g. one cut short before its summary)",
    )
    args = p.parse_args(argv)
    args.preset = "tiny" if args.tiny else "sd35m"
    args.dtype = args.dtype or ("float32" if args.tiny else "bfloat16")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    out = args.out.resolve()
    if args.summarize_only:
        summary = summarize(args, out, started)
        (out / "gpu_loop.json").write_text(json.dumps(summary, indent=1) + "\n")
        print("RESULT " + json.dumps(summary), flush=True)
        return 0 if "images_per_s" in summary else 1
    out.mkdir(parents=True, exist_ok=True)
    model = (args.model_dir or out / "model").resolve()
    build_device = args.device if torch.device(args.device).type == "cuda" else "cpu"
    t0 = time.perf_counter()
    write_model(model, args.preset, build_device, getattr(torch, args.dtype))
    model_s = time.perf_counter() - t0
    if build_device != "cpu":
        torch.cuda.empty_cache()
    config = write_config(args, model, out)
    print(f"model folder in {model_s:.1f} s; launching ({args.minutes} min)", flush=True)
    code = launch(args, config, out)
    summary = {"launch_exit": code, "model_write_s": round(model_s, 1)}
    try:
        summary.update(summarize(args, out, started))
    except (OSError, ValueError, KeyError) as err:
        summary["summary_error"] = repr(err)
    (out / "gpu_loop.json").write_text(json.dumps(summary, indent=1) + "\n")
    print("RESULT " + json.dumps(summary), flush=True)
    return 0 if code == 0 and "images_per_s" in summary else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
