"""Kernel time by kind for ``gpu_sd35m.py``: where a step's GPU time goes.

Kinds, by kernel name: ``matmul`` (cuBLAS / CUTLASS / inductor's Triton matmul templates),
``attention`` (FlashAttention, cuDNN, memory-efficient SDPA kernels), ``triton``
(inductor-generated fused element-wise / reduction kernels), ``copy`` (dtype casts and
memory copies), ``other`` (eager element-wise and the rest). On a CPU the same split is
made over the aten operators' CPU time, so the code path runs in tests.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

# First match wins. Inductor names a fused kernel after the ops in it ("triton_poi_fused_addmm_
# gelu_..."), so its kernels are sorted out before the matmul names; its matmul templates
# (max-autotune) are "triton_tem_...".
_KINDS = (
    ("matmul", re.compile(r"^triton_tem_", re.I)),
    ("triton", re.compile(r"^triton_", re.I)),
    ("attention", re.compile(r"flash|fmha|cudnn|attention|sdpa|_efficient_attention", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|xmma|nvjet|sm90_|mm_|addmm|matmul|bmm|linear", re.I)),
    # the CPU profile's plain and float8 matmul operators
    ("matmul", re.compile(r"^aten::(_scaled_)?mm$")),
    ("copy", re.compile(r"copy|memcpy|memset|to_copy|cast|convert", re.I)),
)


# Inductor's own kernels by what their names say they fuse (first match wins; names list the
# fused ops, so this is a reading of the name, not of the code): the row-wise quantisation of
# a float8 input gradient (a row maximum before the cast), a layer or RMS norm (forward or
# backward), GELU (forward or backward), the static quantisation of a float8 input, the
# attention's q / k / v layout (concatenating the two streams), and the rest.
_TRITON_PARTS = (
    ("rowwise_quantize", re.compile(r"amax")),
    ("norm", re.compile(r"layer_norm|rsqrt|_pow_|mean")),
    ("gelu", re.compile(r"gelu")),
    ("static_quantize", re.compile(r"_scaled_mm|clamp")),
    ("attention_layout", re.compile(r"cat|transpose")),
)


def triton_part_of(name: str) -> str | None:
    """What an inductor kernel ``name`` fuses, by :data:`_TRITON_PARTS` (``"other"`` when
    none matches); ``None`` for a kernel that is not inductor's element-wise kind."""
    if kind_of(name) != "triton":
        return None
    return next((part for part, pattern in _TRITON_PARTS if pattern.search(name)), "other")


def kind_of(name: str) -> str:
    for kind, pattern in _KINDS:
        if pattern.search(name):
            return kind
    return "other"


def profile_kernels(device: torch.device, fn: Callable[[], object], *, top: int = 8) -> dict:
    """Run ``fn`` once under the profiler; return :func:`summarize_kernels` of what ran."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize(device)
    kernels = []
    for event in prof.key_averages():
        us = float(event.self_device_time_total if cuda else event.self_cpu_time_total)
        kernels.append((us, event.key, int(event.count)))
    return summarize_kernels(kernels, top=top)


def summarize_kernels(kernels: list[tuple[float, str, int]], *, top: int = 8) -> dict:
    """``kernels``: (microseconds, name, calls) each. Returns ms and share per kind, kernel
    count, the inductor kernels' ms by what they fuse (``triton_parts_ms``,
    :func:`triton_part_of`), and the ``top`` kernels by time (name cut to 90 characters)."""
    kernels = sorted((k for k in kernels if k[0] > 0), reverse=True)
    by_kind: dict[str, float] = {}
    by_part: dict[str, float] = {}
    for us, name, _ in kernels:
        by_kind[kind_of(name)] = by_kind.get(kind_of(name), 0.0) + us
        part = triton_part_of(name)
        if part is not None:
            by_part[part] = by_part.get(part, 0.0) + us
    total = sum(by_kind.values()) or 1.0
    return {
        "total_ms": round(total / 1e3, 2),
        "launches": sum(n for _, _, n in kernels),
        **{f"{k}_ms": round(v / 1e3, 2) for k, v in sorted(by_kind.items())},
        **{f"{k}_share": round(v / total, 3) for k, v in sorted(by_kind.items())},
        "triton_parts_ms": {k: round(v / 1e3, 2) for k, v in sorted(by_part.items())},
        "top": [f"{us / 1e3:.2f} ms x{n} {name[:90]}" for us, name, n in kernels[:top]],
    }
