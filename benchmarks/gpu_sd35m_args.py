"""The command line of ``gpu_sd35m.py`` (the benchmark's options and their defaults)."""

from __future__ import annotations

import argparse
import ast
import os

import torch

from omnirl.models.device import ATTENTION_BACKENDS as SDPA_BACKENDS


def parse_args(argv: list[str] | None, *, description: str) -> argparse.Namespace:
    """Parsed options, with ``dtype`` and ``matmul_n`` resolved for the tiny or full setup."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 (float32 with --tiny)")
    p.add_argument("--tiny", action="store_true", help="toy model, for CPU tests")
    p.add_argument("--budget-s", type=float, default=500.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's)")
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument(
        "--activation-memory-budget",
        type=float,
        default=None,
        help="the compiled trainer's train.activation_memory_budget (the share of a block's "
        "activations kept for the backward; default: torch's)",
    )
    p.add_argument(
        "--recompute-attention",
        action="store_true",
        help="under --activation-memory-budget, let torch's partitioner recompute the "
        "attention (train.recompute_attention; default: its outputs stay saved)",
    )
    p.add_argument("--compile-mode", default=None)
    p.add_argument(
        "--compile-decoder",
        action="store_true",
        help="the compiled rollout also compiles its VAE decoder (rollout --compile-decoder); "
        "the baseline keeps its own eager VAE",
    )
    p.add_argument(
        "--float8-fuse-projections",
        action="store_true",
        help="float8 stages: each attention's q, k and v as one float8 matmul, in the rollout "
        "and the trainer (rollout --float8-fuse-projections, train.float8_fuse_projections)",
    )
    p.add_argument(
        "--rollout-compile-mode",
        default=None,
        help="the rollout's torch.compile mode (default: --compile-mode); 'reduce-overhead' "
        "adds CUDA graphs, which the trainer refuses",
    )
    p.add_argument(
        "--compile-scope",
        default="blocks",
        choices=["blocks", "whole"],
        help="omnirl's compiled graphs (rollout and trainer): each block, or the whole model",
    )
    p.add_argument(
        "--train-compile-scope",
        default=None,
        choices=["blocks", "whole"],
        help="the trainer's compile scope (default: --compile-scope); a whole-model training "
        "graph takes minutes to compile",
    )
    p.add_argument(
        "--micro",
        type=int,
        default=0,
        help="omnirl's training micro-batch in samples (default: the setup's, the baseline's)",
    )
    p.add_argument(
        "--prompts",
        type=int,
        default=0,
        help="prompts per rollout call (x the group of 4 images; default: the setup's 2)",
    )
    p.add_argument(
        "--sdpa",
        default="default",
        choices=sorted(SDPA_BACKENDS),
        help="attention kernel for the omnirl stages (the baseline keeps torch's default)",
    )
    p.add_argument("--cache-dir", default=None, help="persistent compile cache directory")
    p.add_argument(
        "--inductor",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set torch._inductor.config KEY (dotted, e.g. triton.enable_pdl=1) before anything "
        "compiles; repeatable",
    )
    p.add_argument("--matmul-n", type=int, default=None)
    p.add_argument("--stages", default="all", help="comma-separated stage names, or 'all'")
    p.add_argument("--out", default=os.environ.get("OUT", "runs/gpu_sd35m"))
    p.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    p.add_argument("--from-jsonl", default=None, help="only render this JSONL (with --write-docs)")
    p.add_argument("--warm-start-child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.inductor = dict(_inductor_setting(item) for item in args.inductor)
    args.train_compile_scope = args.train_compile_scope or args.compile_scope
    args.dtype = args.dtype or ("float32" if args.tiny else "bfloat16")
    args.matmul_n = args.matmul_n or (512 if args.tiny else 8192)
    return args


def _inductor_setting(item: str) -> tuple[str, object]:
    """``"triton.enable_pdl=1"`` -> ``("triton.enable_pdl", 1)`` (Python literals; anything
    else stays a string)."""
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise SystemExit(f"--inductor wants KEY=VALUE, got {item!r}")
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = text
    return key.strip(), value


def apply_inductor_settings(settings: dict[str, object]) -> None:
    """Set each dotted ``torch._inductor.config`` key; an unknown key ends the run (a typo
    would otherwise measure the default and call it the variant)."""
    from torch._inductor import config

    for key, value in settings.items():
        *path, leaf = key.split(".")
        target = config
        for part in path:
            target = getattr(target, part, None)
            if target is None:
                raise SystemExit(f"--inductor {key}: torch._inductor.config has no {part!r}")
        if not hasattr(target, leaf):
            raise SystemExit(f"--inductor {key}: torch._inductor.config has no {key!r}")
        setattr(target, leaf, value)
