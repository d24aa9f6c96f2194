"""Float8 matmuls with their element-wise neighbours: inductor's Triton templates, persistent
TMA ones included, fusing them in, against cuBLAS and a separate kernel.

Every large float8 matmul of the SD3.5-Medium step runs in cuBLAS, and the element-wise work
around it (bias, GELU, the next layer's static quantisation, the gated residual, the adaLN
modulation before it) in inductor kernels of its own, which read and write the matmul's whole
output again. Inductor can fuse such work into a matmul only when the matmul is one of its
Triton templates; the eighteenth GPU session's max-autotune kept cuBLAS everywhere because the
templates it tried ran at half cuBLAS's rate (0.84 against 0.44 ms at 32,768 x 1,536 ->
6,144). Those were the plain templates: the persistent TMA ones
(``triton.enable_persistent_tma_matmul``, off by default) were not among them. Timed here,
case by case, at the step's shapes (micro-batch 16 with CFG: 32,768 image-token rows, 10,656
text-token rows):

- `plain`: ``y = a8 @ w8`` (row-wise scales, bf16 out), the template's own rate;
- `gelu_quant`: the feed-forward's up projection as the trainer runs it: ``y = a8 @ w8 + b``,
  ``q = e4m3(clamp(gelu_tanh(y) / s))`` for the down projection, ``y`` kept for the backward;
- `gated`: an output projection and its gated residual, ``out = res + gate[b] * (a8 @ w8 + b)``;
- `modulate`: the prologue side, ``(e4m3(clamp((x * (1 + scale[b]) + shift[b]) / s))) @ w8``.

Variants (`--variants`): `eager`; `default` (``torch.compile``, what the model runs: cuBLAS
and one fused kernel); `autotune` (``max-autotune-no-cudagraphs`` with the persistent TMA
templates, cuBLAS and Triton both candidates: what inductor would pick); `autotune_triton`
(the same with Triton templates only, so the element-wise work is fused into one whatever
the cost). Each row: ms, the matmul's FLOPs over that time (TFLOP/s), compile s, the kernels the compiled
code launches (which matmul, what got fused), the largest difference from `eager`; then per
case the best compiled variant against `default`.

    python benchmarks/gemm_epilogue_probe.py --device cuda --out $OUT/epilogue --budget-s 420
    python benchmarks/gemm_epilogue_probe.py --tiny --variants eager,default   # CPU dry run
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from probe_timing import seconds_per_call, write_results

from omnirl.models.float8 import FLOAT8, quantize_static, scaled_matmul

# name: (kind, rows, in, out, tokens a sample); in priority order (the budget cuts the tail)
CASES = {
    "ff_up_gelu_quant": ("gelu_quant", 32768, 1536, 6144, 1024),
    "ff_down_gated": ("gated", 32768, 6144, 1536, 1024),
    "attn_out_gated": ("gated", 32768, 1536, 1536, 1024),
    "qkv_modulated": ("modulate", 32768, 1536, 1536, 1024),
    "ff_up_plain": ("plain", 32768, 1536, 6144, 1024),
    "text_out_gated": ("gated", 10656, 1536, 1536, 333),
}
TINY_CASES = {
    "ff_up_gelu_quant": ("gelu_quant", 96, 32, 128, 24),
    "ff_down_gated": ("gated", 96, 128, 32, 24),
    "qkv_modulated": ("modulate", 96, 32, 32, 24),
    "ff_up_plain": ("plain", 96, 32, 128, 24),
}
VARIANTS = ("eager", "default", "autotune", "autotune_triton")
AUTOTUNE = {"triton.enable_persistent_tma_matmul": True}


# The float8 layers' own calls (``omnirl.models.float8``), fast accumulation as in the step.
def plain(a8, w8t, sa, sw):
    return scaled_matmul(a8, w8t, sa, sw, True)


def gelu_quant(a8, w8t, sa, sw, bias, qs):
    """Returns ``(q e4m3 [M, N], y bf16 [M, N])``."""
    y = scaled_matmul(a8, w8t, sa, sw, True) + bias
    return quantize_static(F.gelu(y.float(), approximate="tanh"), qs)[0], y


def gated(a8, w8t, sa, sw, bias, gate, res):
    """``gate`` bf16 ``[B, N]``, ``res`` bf16 ``[B, T, N]``; returns bf16 ``[B, T, N]``."""
    y = (scaled_matmul(a8, w8t, sa, sw, True) + bias).view(res.shape)
    return res + gate[:, None, :] * y


def modulate(x, shift, scale, qs, w8t, sw):
    """``x`` bf16 ``[B, T, K]`` (normalised), ``shift``/``scale`` ``[B, K]``; returns bf16
    ``[B*T, N]``."""
    h = x * (1 + scale[:, None, :]) + shift[:, None, :]
    q, q_scale = quantize_static(h.flatten(0, 1), qs)
    return scaled_matmul(q, w8t, q_scale, sw, True)


KINDS = {"plain": plain, "gelu_quant": gelu_quant, "gated": gated, "modulate": modulate}


def make_inputs(kind: str, rows: int, k: int, n: int, tokens: int, device) -> tuple:
    """The case's arguments: e4m3 activations and column-major weights with float32 scales
    (row-wise ``[M, 1]`` and ``[1, N]``, as the float8 layers call cuBLAS), bf16 the rest."""
    gen = torch.Generator().manual_seed(rows + k + n)
    samples = rows // tokens

    def rand(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen) * std).to(device, torch.bfloat16)

    w8t = torch.randn(n, k, generator=gen).to(device=device, dtype=FLOAT8).t()
    sw = torch.full((1, n), 0.02, device=device)
    if kind == "modulate":
        qs = torch.full((1, 1), 0.05, device=device)
        return (
            rand(samples, tokens, k),
            rand(samples, k, std=0.3),
            rand(samples, k, std=0.3),
            qs,
            w8t,
            sw,
        )
    a8 = torch.randn(rows, k, generator=gen).to(device=device, dtype=FLOAT8)
    sa = torch.full((rows, 1), 0.05, device=device)
    if kind == "plain":
        return a8, w8t, sa, sw
    bias = rand(n, std=0.1)
    if kind == "gelu_quant":
        return a8, w8t, sa, sw, bias, torch.full((1, 1), 0.02, device=device)
    return a8, w8t, sa, sw, bias, rand(samples, n, std=0.5), rand(samples, tokens, n)


def _largest_difference(out, ref) -> float:
    outs = out if isinstance(out, tuple) else (out,)
    refs = ref if isinstance(ref, tuple) else (ref,)
    return max(float((o.float() - r.float()).abs().max()) for o, r in zip(outs, refs, strict=True))


_KERNEL = re.compile(r"^(triton_\w+) = async_compile\.triton\(", re.M)


def kernels_of(code: str) -> dict:
    """What the compiled code launches: its Triton kernels by name and whether cuBLAS's
    ``_scaled_mm`` is still called (``extern``)."""
    names = _KERNEL.findall(code)
    return {
        "kernels": names,
        "cublas": "extern_kernels._scaled_mm" in code or "aten._scaled_mm" in code,
        "template": [name for name in names if name.startswith("triton_tem")],
    }


def compiled(fn, variant: str):
    """``fn`` under the variant's compile settings (as it is for ``eager``), and the config
    patch to call it in."""
    from torch._inductor import config

    if variant == "eager":
        return fn, contextlib.nullcontext()
    torch._dynamo.reset()
    if variant == "default":
        return torch.compile(fn, dynamic=False), contextlib.nullcontext()
    backends = "ATEN,TRITON" if variant == "autotune" else "TRITON"
    patch = config.patch({**AUTOTUNE, "max_autotune_gemm_backends": backends})
    return torch.compile(fn, mode="max-autotune-no-cudagraphs", dynamic=False), patch


def time_case(name: str, case: tuple, variants: list[str], device, seconds: float, deadline: float):
    """Rows for one case: each variant (skipped once past ``deadline``), then the best
    compiled one against ``default``."""
    from torch._inductor.utils import run_and_get_code

    kind, rows, k, n, tokens = case
    fn, args = KINDS[kind], make_inputs(kind, rows, k, n, tokens, device)
    reference = fn(*args)
    flops = 2.0 * rows * k * n
    out = []
    for variant in variants:
        row = {"stage": "case", "case": name, "kind": kind, "rows": rows, "in": k, "out": n}
        row["variant"] = variant
        if time.monotonic() > deadline:
            out.append({**row, "skipped": "budget"})
            continue
        info = {}
        try:
            call, patch = compiled(fn, variant)
            with patch:
                if variant == "eager":
                    result = reference
                else:
                    start = time.perf_counter()
                    result, codes = run_and_get_code(call, *args)
                    info = {"compile_s": round(time.perf_counter() - start, 1)}
                    info.update(kernels_of("\n".join(codes)))
                per = seconds_per_call(functools.partial(call, *args), device, seconds, batch=10)
        except Exception as exc:  # a variant this torch or card cannot build: say so, go on
            out.append({**row, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            continue
        out.append(
            {
                **row,
                "ms": round(per * 1e3, 4),
                "matmul_tflops": round(flops / per / 1e12, 1),
                "max_abs_diff": _largest_difference(result, reference),
                **info,
            }
        )
    timed = {r["variant"]: r["ms"] for r in out if "ms" in r}
    if "default" in timed:
        rest = {v: ms for v, ms in timed.items() if v not in ("eager", "default")}
        if rest:
            best = min(rest, key=rest.get)
            out.append(
                {
                    "stage": "best",
                    "case": name,
                    "variant": best,
                    "ms": rest[best],
                    "default_ms": timed["default"],
                    "speedup": round(timed["default"] / rest[best], 3),
                }
            )
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="toy sizes, for CPU tests")
    p.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--seconds", type=float, default=0.3, help="timing per variant")
    p.add_argument("--budget-s", type=float, default=1e9, help="start no variant after this")
    p.add_argument("--out", default=None, help="directory for gemm_epilogue_probe.jsonl")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    table = TINY_CASES if args.tiny else CASES
    names = args.cases.split(",") if args.cases else list(table)
    unknown = [name for name in names if name not in table]
    variants = args.variants.split(",")
    if unknown or not set(variants) <= set(VARIANTS):
        p.error(
            f"unknown case or variant: {unknown or variants}; cases {list(table)}, variants {VARIANTS}"
        )
    deadline = time.monotonic() + args.budget_s
    rows: list[dict] = []
    for name in names:
        for row in time_case(name, table[name], variants, device, args.seconds, deadline):
            rows.append(row)
            print("RESULT", json.dumps(row), flush=True)
            if args.out:  # as it goes: a command cut short keeps what it measured
                write_results(args.out, "gemm_epilogue_probe", device, rows)
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
