"""The adaLN norm, modulation and static float8 quantisation at SD3.5-Medium's shapes: how near
the memory bandwidth inductor's kernel runs, against a hand-written Triton kernel.

Before each float8 attention and feed-forward, SD3's block normalises its input over the
channels (LayerNorm without affine, eps 1e-6), modulates it per sample (``x * (1 + scale) +
shift``, the adaLN terms) and the static float8 layers after it quantise it (one calibrated
scale each: ``clamp(y / s, +-448)`` to e4m3). Inductor fuses the three into one kernel per
stream. In the nineteenth GPU session those kernels ("norm" in `gpu_sd35m.py`'s profile)
took 643 ms of a 4,691 ms training step (with their backward) and 258 of a rollout call's
1,564, about 0.26 ms a call for about 100 to 250 MB of traffic: by that arithmetic a third of
the card's bandwidth or less. Whether a hand-written kernel can halve them (what 3x needs of
every element-wise kernel, `docs/gpu_sessions.md`, "GPU, nineteenth session") is timed here,
forward only (the rollout's and the reference pass's case), each variant at the same shapes:

- `bandwidth`: a compiled element-wise kernel with the same reads and writes and no
  reduction (``y = 2 x``, ``q_i = x * s_i``): what the card gives this traffic;
- `inductor`: the norm, modulation and quantisation in torch, compiled (what the block runs);
- `inductor_cdt`: the same compiled with inductor's coordinate-descent tuning of its kernels'
  launch configurations (``coordinate_descent_tuning``; on a GPU only);
- `triton`: one hand-written Triton kernel, a row per program (`norm_modulate_quantize`).

Outputs (`--outputs`): `y+1q` (the modulated bf16 activation, which the LoRA branches read,
and one float8 copy: fused q/k/v or a feed-forward), `y+3q` (and three: q, k and v quantised
apart, what the unfused layers get), `1q` (a merged or LoRA-free model). Rows: 32,768 (image
tokens, micro-batch 16 with CFG, 1,024 a sample) and 10,656 (text tokens, 333 a sample).
Each row of the output: ms, MB moved, GB/s, the share of `bandwidth`'s GB/s; then `triton`
against `inductor`: speed-up and the largest difference (bf16 ``y``; float8 ``q`` in its own
units).

    python benchmarks/norm_quant_probe.py --device cuda --out $OUT/norm
    TRITON_INTERPRET=1 python benchmarks/norm_quant_probe.py --tiny   # CPU dry run

(On a CPU, ``TRITON_INTERPRET=1`` must be set before anything imports Triton, torch's
inductor included, so only in a fresh process. The interpreter's float8 conversion also
truncates a rounding carry into the next binade, 126.9 -> 64 where a GPU gives 128, so there
a few float8 values differ from torch's.)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from probe_timing import seconds_per_call, write_results

FLOAT8 = torch.float8_e4m3fn
EPS = 1e-6
OUTPUTS = {"y+1q": (True, 1), "y+3q": (True, 3), "1q": (False, 1)}
SHAPES = ((32768, 1024), (10656, 333))  # (rows, tokens a sample)
TINY_SHAPES = ((96, 24), (40, 10))
WIDTH, TINY_WIDTH = 1536, 48


def make_inputs(rows: int, tokens: int, width: int, n_q: int, device) -> dict:
    """``x`` bf16 ``[rows, width]``; ``shift``, ``scale`` bf16 ``[rows // tokens, width]``;
    ``qscale`` float32 ``[n_q]`` (calibrated as a static layer would: 2 x amax / 448)."""
    gen = torch.Generator().manual_seed(rows + n_q)
    samples = rows // tokens
    x = (torch.randn(rows, width, generator=gen) * 3 + 0.5).to(device, torch.bfloat16)
    shift = (torch.randn(samples, width, generator=gen) * 0.5).to(device, torch.bfloat16)
    scale = (torch.randn(samples, width, generator=gen) * 0.5).to(device, torch.bfloat16)
    y = reference(x, shift, scale, torch.ones(1, device=device), tokens, True)[0]
    amax = float(y.float().abs().amax())
    qscale = torch.tensor([2 * amax / 448 * (1 + i / 10) for i in range(n_q)], device=device)
    return {"x": x, "shift": shift, "scale": scale, "qscale": qscale}


def reference(x, shift, scale, qscale, tokens: int, write_y: bool):
    """The block's math: ``y = LayerNorm(x) * (1 + scale[b]) + shift[b]`` in float32 for the
    rows of sample ``b``; returns ``(y bf16 or None, [q_i float8])``, ``q_i`` from the
    float32 ``y``."""
    rows, width = x.shape
    xf = x.float().view(rows // tokens, tokens, width)
    y = torch.nn.functional.layer_norm(xf, (width,), eps=EPS)
    y = (y * (1 + scale.float()[:, None]) + shift.float()[:, None]).view(rows, width)
    qs = [(y / qscale[i]).clamp(-448.0, 448.0).to(FLOAT8) for i in range(qscale.numel())]
    return (y.to(x.dtype) if write_y else None), qs


def _reference_again(*args, **kwargs):
    """:func:`reference` under another code object, so that compiling it with other inductor
    options makes a graph of its own instead of finding :func:`reference`'s in dynamo's
    cache."""
    return reference(*args, **kwargs)


def same_traffic(x, shift, scale, qscale, tokens: int, write_y: bool):
    """The same reads and writes as :func:`reference` without the reduction."""
    xf = x.float()
    qs = [(xf * qscale[i]).clamp(-448.0, 448.0).to(FLOAT8) for i in range(qscale.numel())]
    return ((xf * 2).to(x.dtype) if write_y else None), qs


@functools.cache
def _triton_kernel():
    """The Triton kernel, built at first use (``TRITON_INTERPRET=1`` must be set by then to
    run it on a CPU)."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x_ptr, shift_ptr, scale_ptr, qscale_ptr, y_ptr, q_ptr, rows, width, tokens, eps,
               N_Q: tl.constexpr, WRITE_Y: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < width
        x = tl.load(x_ptr + row * width + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=0) / width
        centred = tl.where(mask, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / width + eps)
        sample = row // tokens
        scale = tl.load(scale_ptr + sample * width + cols, mask=mask, other=0.0).to(tl.float32)
        shift = tl.load(shift_ptr + sample * width + cols, mask=mask, other=0.0).to(tl.float32)
        y = centred * rstd * (1.0 + scale) + shift
        if WRITE_Y:
            tl.store(y_ptr + row * width + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
        for i in tl.static_range(N_Q):
            q = tl.clamp(y / tl.load(qscale_ptr + i), -448.0, 448.0)
            out = q_ptr + i * rows * width + row * width + cols
            tl.store(out, q.to(q_ptr.dtype.element_ty), mask=mask)

    return kernel


def norm_modulate_quantize(x, shift, scale, qscale, tokens: int, write_y: bool):
    """:func:`reference` as one Triton kernel, a row per program."""
    import triton

    rows, width = x.shape
    n_q = qscale.numel()
    y = torch.empty_like(x) if write_y else x  # (an unused pointer when not written)
    q = torch.empty(n_q, rows, width, dtype=FLOAT8, device=x.device)
    block = triton.next_power_of_2(width)
    _triton_kernel()[(rows,)](
        x, shift, scale, qscale, y, q, rows, width, tokens, EPS,
        N_Q=n_q, WRITE_Y=write_y, BLOCK=block, num_warps=4 if block <= 1024 else 8,
    )  # fmt: skip
    return (y if write_y else None), list(q.unbind(0))


def moved_mb(rows: int, width: int, samples: int, write_y: bool, n_q: int) -> float:
    """Bytes read and written at least once: ``x`` and the written outputs, the modulation."""
    return (rows * width * (2 + 2 * write_y + n_q) + samples * width * 4) / 1e6


def _triton_available(device: torch.device) -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def run(args) -> list[dict]:
    device = torch.device(args.device)
    shapes, width = (TINY_SHAPES, TINY_WIDTH) if args.tiny else (SHAPES, WIDTH)
    backend = "inductor" if device.type == "cuda" or args.compile_cpu else "aot_eager"
    variants = {
        "bandwidth": torch.compile(same_traffic, backend=backend),
        "inductor": torch.compile(reference, backend=backend),
    }
    if backend == "inductor" and device.type == "cuda":
        variants["inductor_cdt"] = torch.compile(
            _reference_again, backend=backend, options={"coordinate_descent_tuning": True}
        )
    if _triton_available(device):
        variants["triton"] = norm_modulate_quantize
    rows_out = []
    for rows, tokens in shapes:
        for name in args.outputs.split(","):
            write_y, n_q = OUTPUTS[name]
            inputs = make_inputs(rows, tokens, width, n_q, device)
            mb = moved_mb(rows, width, rows // tokens, write_y, n_q)
            results, times = {}, {}
            for variant, fn in variants.items():
                call = functools.partial(fn, **inputs, tokens=tokens, write_y=write_y)
                with torch.no_grad():
                    results[variant] = call()
                    times[variant] = seconds_per_call(call, device, args.seconds)
            for variant, t in times.items():
                row = {
                    "stage": "kernel",
                    "variant": variant,
                    "rows": rows,
                    "outputs": name,
                    "ms": round(t * 1e3, 4),
                    "mb": round(mb, 1),
                    "gb_per_s": round(mb / 1e3 / t, 1),
                    "of_bandwidth": round(times["bandwidth"] / t, 3),
                }
                rows_out.append(row)
                print("RESULT", json.dumps(row), flush=True)
            if "triton" in results:
                row = compare(results["triton"], results["inductor"])
                row.update(
                    rows=rows,
                    outputs=name,
                    speedup=round(times["inductor"] / times["triton"], 3),
                )
                rows_out.append(row)
                print("RESULT", json.dumps(row), flush=True)
    return rows_out


def compare(got, want) -> dict:
    """The largest differences of the Triton kernel's outputs from inductor's: ``y`` (bf16)
    and the float8 ``q_i`` in their own units (``y / qscale[i]``; an e4m3 step is 32 near
    448, 1 near 10), and the smallest share of float8 values that are equal."""
    (y, qs), (y_ref, qs_ref) = got, want
    y_diff = None if y is None else float((y.float() - y_ref.float()).abs().max())
    pairs = list(zip(qs, qs_ref, strict=True))
    q_diff = max(float((q.float() - r.float()).abs().max()) for q, r in pairs)
    q_equal = min(float((q.float() == r.float()).float().mean()) for q, r in pairs)
    return {
        "stage": "triton_vs_inductor",
        "y_max_diff": y_diff,
        "q_max_diff": q_diff,
        "q_equal_share": round(q_equal, 4),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="toy sizes, for CPU tests")
    p.add_argument(
        "--outputs", default=",".join(OUTPUTS), help="comma-separated, of " + ", ".join(OUTPUTS)
    )
    p.add_argument("--seconds", type=float, default=0.3, help="timing per variant and shape")
    p.add_argument(
        "--compile-cpu", action="store_true", help="inductor on the CPU too (default: aot_eager)"
    )
    p.add_argument("--out", default=None, help="directory for norm_quant_probe.jsonl")
    args = p.parse_args(argv)
    rows = run(args)
    if args.out:
        write_results(args.out, "norm_quant_probe", torch.device(args.device), rows)
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
