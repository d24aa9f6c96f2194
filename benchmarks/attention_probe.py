"""Attention kernels at SD3.5-Medium's joint-attention shape: speed and error of each.

Issue 9 names "the attention kernel" as one of the two things left between the compiled
float8 step and 3x the flow_grpo-style loop: cuDNN's bf16 attention is about 28 % of the
step's kernel time at head dim 64. This measures, in one process on one GPU, at the shape of
a micro-batch of 16 with CFG (32 rows, 24 heads, 1024 image + 333 text tokens, head dim 64):

- the baseline, cuDNN's bf16 ``scaled_dot_product_attention`` (what the step runs now),
  forward and forward + backward;
- FlashAttention-2 (torch's built-in), forward and forward + backward;
- FlexAttention (Triton, compiled) in bf16, forward and forward + backward;
- FlexAttention in float8 (e4m3 q / k / v with per-tensor scales; forward only: the
  rollout's and the KL reference pass's attention have no backward);
- cuDNN's float8 forward (``cudnn_fp8_attention.py``; needs the ``nvidia-cudnn-frontend``
  wheel), the kernel alone and with quantising its inputs. Hopper has no float8 backward at
  head dim 64 (``python benchmarks/cudnn_fp8_attention.py`` prints cuDNN's verdicts).

Each variant's time is a ratio against the baseline measured in the same run, and its error
the mean and max |difference| from a float32 attention on the same inputs, beside the
baseline's own. A variant that fails is recorded with its error and the run goes on.

    python benchmarks/attention_probe.py --device cuda --out $OUT/attention
    python benchmarks/attention_probe.py --tiny      # a CPU dry run at toy sizes
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cudnn_fp8_attention import quantize_e4m3
from probe_timing import seconds_per_call as _time


def _sdpa(backend):
    from torch.nn.attention import sdpa_kernel

    def attend(q, k, v):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v)

    return attend


def _flex(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if compiled else flex_attention


def flex_float8_attention(flex):
    """FlexAttention on e4m3 ``q``, ``k``, ``v`` (per-tensor scales): the scores are
    rescaled by ``q_scale * k_scale`` inside the kernel, the output by ``v_scale`` after it."""

    def attend(q8, k8, v8, q_scale, k_scale, v_scale):
        softmax_scale = 1.0 / math.sqrt(q8.shape[-1])

        def rescale(score, b, h, q_idx, k_idx):
            return score * (q_scale * k_scale)

        out = flex(q8, k8, v8, score_mod=rescale, scale=softmax_scale)
        return out.to(torch.bfloat16) * v_scale

    return attend


def _cudnn_fp8_row(name, quantizing, q, k, v, device, seconds, flops, baseline, error) -> dict:
    """cuDNN's float8 forward (``benchmarks/cudnn_fp8_attention.py``; Hopper runs it with an
    e4m3 output and has no float8 backward at head dim 64): the kernel alone on inputs
    already in e4m3, or with quantising q, k, v and dequantising the output (eager)."""
    row: dict = {"stage": name}
    try:
        if device.type != "cuda":
            raise RuntimeError("cuDNN's float8 attention needs a CUDA GPU")
        from cudnn_fp8_attention import CudnnFp8Forward

        attend = CudnnFp8Forward(tuple(q.shape), tuple(q.stride()), device)
        with torch.no_grad():
            row.update(error(attend(q, k, v)))
            if quantizing:
                seconds_per = _time(lambda: attend(q, k, v), device, seconds)
            else:
                inputs = [t for x in (q, k, v) for t in quantize_e4m3(x)]
                q8, dq, k8, dk, v8, dv = inputs
                seconds_per = _time(
                    lambda: attend.quantized(q8, k8, v8, dq, dk, dv), device, seconds
                )
        row.update(ms=round(seconds_per * 1e3, 4), tflops=round(flops / seconds_per / 1e12, 1))
        row["speed_vs_cudnn_bf16"] = round(baseline["fwd"] / seconds_per, 3)
    except Exception as err:
        row["error"] = f"{type(err).__name__}: {err}"[:400]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path, default=Path("runs/attention_probe"))
    p.add_argument("--tiny", action="store_true", help="toy sizes on the CPU (a dry run)")
    p.add_argument("--rows", type=int, default=32, help="batch rows (micro-batch 16 x CFG)")
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--tokens", type=int, default=1024 + 333)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seconds", type=float, default=2.0, help="timing per variant")
    args = p.parse_args(argv)
    if args.tiny:
        args.device, args.rows, args.heads, args.tokens, args.seconds = "cpu", 2, 2, 40, 0.05
    device = torch.device(args.device)
    dtype = torch.bfloat16
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []

    def record(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)

    shape = (args.rows, args.heads, args.tokens, args.head_dim)
    gen = torch.Generator(device="cpu").manual_seed(0)
    # q and k as the RMS-normalised projections are (unit RMS); v as a projection's output
    q, k, v = (torch.randn(shape, generator=gen).to(device, dtype) for _ in range(3))
    grad_out = torch.randn(shape, generator=gen).to(device, dtype)
    flops_fwd = 4.0 * args.rows * args.heads * args.tokens**2 * args.head_dim
    flops_fwd_bwd = flops_fwd * 3.5  # backward: 2.5x the forward's matmuls
    env = {"stage": "env", "torch": torch.__version__, "device": str(device), "shape": shape}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    record(env)
    with torch.no_grad():
        exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float()).to(dtype)

    def error(out: torch.Tensor) -> dict[str, float]:
        diff = (out.float() - exact.float()).abs()
        return {"abs_err_mean": float(diff.mean()), "abs_err_max": float(diff.max())}

    from torch.nn.attention import SDPBackend

    cpu = device.type == "cpu"
    # on a CPU neither cuDNN nor flash exists: the math kernel stands in, so the dry run
    # exercises every path of the script
    base_backend = SDPBackend.MATH if cpu else SDPBackend.CUDNN_ATTENTION
    variants: list[tuple[str, Callable, bool]] = [
        ("cudnn_bf16", _sdpa(base_backend), True),
        ("flash_bf16", _sdpa(SDPBackend.MATH if cpu else SDPBackend.FLASH_ATTENTION), True),
        ("flex_bf16", _flex(compiled=not cpu), True),
    ]
    baseline: dict[str, float] = {}
    for name, attend, has_backward in variants:
        for kind in ("fwd", "fwd_bwd") if has_backward else ("fwd",):
            row = {"stage": f"{name}_{kind}"}
            try:
                if kind == "fwd":
                    with torch.no_grad():
                        row.update(error(attend(q, k, v)))
                        seconds = _time(lambda a=attend: a(q, k, v), device, args.seconds)
                    flops = flops_fwd
                else:
                    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

                    def fwd_bwd(a=attend, qg=qg, kg=kg, vg=vg):
                        a(qg, kg, vg).backward(grad_out)

                    seconds = _time(fwd_bwd, device, args.seconds)
                    flops = flops_fwd_bwd
                row.update(ms=round(seconds * 1e3, 4), tflops=round(flops / seconds / 1e12, 1))
                if name == "cudnn_bf16":
                    baseline[kind] = seconds
                if kind in baseline:
                    row["speed_vs_cudnn_bf16"] = round(baseline[kind] / seconds, 3)
            except Exception as err:  # a kernel this torch or card lacks: say so, go on
                row["error"] = f"{type(err).__name__}: {err}"[:400]
            record(row)

    row = {"stage": "flex_float8_fwd"}
    try:
        if cpu:
            raise RuntimeError("float8 FlexAttention needs a GPU (Triton)")
        attend = torch.compile(flex_float8_attention(_flex(compiled=False)), dynamic=False)
        with torch.no_grad():
            # one scale per tensor, as a 0-d tensor: the score modification multiplies a
            # scalar score by it
            (q8, qs), (k8, ks), (v8, vs) = (
                (x8, descale.reshape(())) for x8, descale in map(quantize_e4m3, (q, k, v))
            )
            row.update(error(attend(q8, k8, v8, qs, ks, vs)))
            seconds = _time(lambda: attend(q8, k8, v8, qs, ks, vs), device, args.seconds)
        row.update(ms=round(seconds * 1e3, 4), tflops=round(flops_fwd / seconds / 1e12, 1))
        row["speed_vs_cudnn_bf16"] = round(baseline["fwd"] / seconds, 3)
        row["note"] = "inputs already in float8: quantising q, k, v is not timed"
    except Exception as err:
        row["error"] = f"{type(err).__name__}: {err}"[:400]
    record(row)

    for name, quantizing in (("cudnn_fp8_fwd", False), ("cudnn_fp8_fwd_quantizing", True)):
        record(
            _cudnn_fp8_row(
                name, quantizing, q, k, v, device, args.seconds, flops_fwd, baseline, error
            )
        )

    (args.out / "attention_probe.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = [
        "| variant | ms / call | TFLOP/s | vs cuDNN bf16 | abs err mean | abs err max |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows[1:]:
        if "error" in r:
            lines.append(f"| {r['stage']} | failed: {r['error'][:80]} | | | | |")
            continue
        err_mean = f"{r['abs_err_mean']:.2e}" if "abs_err_mean" in r else ""
        err_max = f"{r['abs_err_max']:.2e}" if "abs_err_max" in r else ""
        lines.append(
            f"| {r['stage']} | {r['ms']} | {r['tflops']} | {r.get('speed_vs_cudnn_bf16', '')} "
            f"| {err_mean} | {err_max} |"
        )
    (args.out / "attention_probe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return 0 if all("error" not in r for r in rows if r["stage"].startswith("cudnn_bf16")) else 1


if __name__ == "__main__":
    sys.exit(main())
