"""``trainer --deterministic``: ask torch for run-to-run bitwise reproducible kernels.

On a CPU the trainer is already deterministic for a fixed seed, config and input order
(tested with a recording in tests/recording). On a GPU several things are not; see
docs/recording.md, "Determinism", for what each switch below buys and what it costs.
Call :func:`enable_determinism` before any CUDA work (cuBLAS reads its workspace setting
when its handle is created).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("omnirl.trainer")


def enable_determinism() -> None:
    """Deterministic algorithms (an error where none exists), fixed cuBLAS workspace, no
    cuDNN autotuning, no TF32, and the math SDPA backend only."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    # flash / memory-efficient attention backward passes use atomics; math does not
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_math_sdp(True)
    log.info("deterministic kernels requested (CUBLAS_WORKSPACE_CONFIG=%s)",
             os.environ["CUBLAS_WORKSPACE_CONFIG"])  # fmt: skip
