"""``uv run rollout --trainer tcp://HOST:PORT|--trainer-file PATH [--device cpu] [--dtype float32] ...``.

Argument parsing imports nothing heavy; torch and the model stack load after it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys


def build_parser() -> argparse.ArgumentParser:
    from omnirl.protocol.auth import add_security_arguments
    from omnirl.protocol.trainer_link import add_trainer_arguments
    from omnirl.rollout.model import DEFAULT_FLOAT8_RECALIBRATE_EVERY

    parser = argparse.ArgumentParser(
        prog="rollout", description="omnirl rollout worker: sample leased prompt groups"
    )
    add_trainer_arguments(parser)
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="model dtype (the scheduler and log-probs stay float32)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="compiled backend: each transformer block torch.compiled, warmed up at load",
    )
    parser.add_argument(
        "--compile-mode",
        default=None,
        help="torch.compile mode (default: torch's; 'reduce-overhead' adds CUDA graphs)",
    )
    parser.add_argument(
        "--compile-scope",
        default=None,
        choices=["blocks", "whole"],
        help="what one compiled graph covers (implies --compile): each transformer block "
        "('blocks', the default: quick to compile) or the whole denoiser ('whole': fusion "
        "across blocks and, with --compile-mode reduce-overhead, one CUDA graph per model "
        "call; longer to compile)",
    )
    parser.add_argument(
        "--compile-decoder",
        action="store_true",
        help="compile the image decoder (the VAE) too (implies --compile): about 2x faster "
        "decoding on an H100 at 16 images a call, 1.7x at 4, the images within bf16 "
        "rounding of eager's; 20 to 30 s more compile per decode batch size",
    )
    parser.add_argument(
        "--attention",
        default="default",
        choices=["default", "cudnn", "flash", "efficient", "math"],
        help="SDPA kernel (default: torch's); name the trainer's train.attention",
    )
    parser.add_argument(
        "--float8",
        nargs="?",
        const="rowwise",
        default=None,
        choices=["rowwise", "static"],
        help="transformer block linear layers as scaled float8 matmuls (Hopper+), activations "
        "scaled per row ('rowwise', the default) or per layer, calibrated on the first lease "
        "('static': no reduction before each matmul); faster, and log-probs further from the "
        "trainer's (the parity report shows how far)",
    )
    parser.add_argument(
        "--float8-fast-accum",
        action="store_true",
        help="with --float8: the matmuls' fast accumulation mode (Hopper)",
    )
    parser.add_argument(
        "--float8-fuse-projections",
        action="store_true",
        help="with --float8: each attention's q, k and v projections (per stream) as one "
        "float8 matmul, the LoRA branches apart (the same values; on SD3.5-M no faster)",
    )
    parser.add_argument(
        "--float8-recalibrate-every",
        type=int,
        default=DEFAULT_FLOAT8_RECALIBRATE_EVERY,
        metavar="N",
        help="with --float8 static: calibrate the scales again after every N LoRA updates "
        "(one eager lease; the log says how far the inputs grew; 0: never)",
    )
    parser.add_argument(
        "--lora-mode",
        default="auto",
        choices=["auto", "merged", "adapter"],
        help="LoRA folded into the base weights after each update ('merged': forward passes "
        "cost the base model's only) or a separate branch ('adapter'); auto: merged in "
        "float32, an adapter in half precision and float8 (where a merge rounds it away)",
    )
    parser.add_argument(
        "--compile-cache",
        default=None,
        metavar="DIR",
        help="persistent compile cache shared by workers (inductor cache + artifacts.bin)",
    )
    parser.add_argument(
        "--decode-batch",
        type=int,
        default=0,
        metavar="N",
        help="decode at most N images per VAE call (0, the default: a lease's images in one "
        "call); the decoder at full resolution is what peaks a rollout's memory, so a GPU "
        "shared with a trainer, or large images, want a small N; the images are the same",
    )
    parser.add_argument("--worker-id", default="", help="default: rollout-<random>")
    parser.add_argument("--capacity", type=int, default=1, help="prompt groups per lease request")
    parser.add_argument(
        "--trainer-timeout",
        type=float,
        default=30.0,
        help="exit (code 2) after the trainer is unreachable this long (s)",
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="torch CPU threads (0: torch's default)"
    )
    parser.add_argument("--log-level", default="INFO")
    add_security_arguments(parser, default_name="rollout")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stdout,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from omnirl.protocol.memory import retain_freed_memory

    retain_freed_memory()  # large messages reuse mapped pages (omnirl.protocol.memory)
    if args.capacity < 1:
        print("rollout: --capacity must be >= 1", file=sys.stderr)
        return 2
    if args.float8_recalibrate_every < 0:
        print("rollout: --float8-recalibrate-every must be >= 0", file=sys.stderr)
        return 2
    if args.decode_batch < 0:
        print("rollout: --decode-batch must be >= 0", file=sys.stderr)
        return 2
    for flag in ("fast_accum", "fuse_projections"):
        if getattr(args, f"float8_{flag}") and not args.float8:
            print(f"rollout: --float8-{flag.replace('_', '-')} needs --float8", file=sys.stderr)
            return 2
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from omnirl.protocol.auth import SecurityConfig
    from omnirl.rollout.worker import RolloutWorker, RolloutWorkerConfig

    worker = RolloutWorker(
        RolloutWorkerConfig(
            trainer=args.trainer or "",
            trainer_file=args.trainer_file or "",
            device=args.device,
            dtype=args.dtype,
            compile=args.compile
            or args.compile_mode is not None
            or bool(args.compile_scope)
            or args.compile_decoder,
            compile_mode=args.compile_mode,
            compile_scope=args.compile_scope or "blocks",
            compile_cache=args.compile_cache,
            compile_decoder=args.compile_decoder,
            float8=args.float8,
            float8_fast_accum=args.float8_fast_accum,
            float8_fuse_projections=args.float8_fuse_projections,
            float8_recalibrate_every=args.float8_recalibrate_every,
            lora_mode=args.lora_mode,
            decode_batch=args.decode_batch,
            worker_id=args.worker_id,
            capacity=args.capacity,
            security=SecurityConfig.from_args(args),
            trainer_timeout_s=args.trainer_timeout,
        )
    )
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: worker.stop())
    from omnirl.models.device import attention_backend, describe_attention_backends

    # the SDPA kernel for every compile and call of the run (torch-global flags, held open
    # for the whole run: a context entered and dropped would be undone at once)
    with attention_backend(args.attention):
        logging.getLogger("omnirl.rollout").info(
            "%s: attention %s", args.worker_id or "rollout", describe_attention_backends()
        )
        code = worker.run()
    # Leave without interpreter teardown: with torch's thread pools alive it can abort
    # ("terminate called without an active exception", exit -6) after a clean run.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
