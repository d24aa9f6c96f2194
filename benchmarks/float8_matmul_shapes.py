"""The float8 matmuls of the SD3.5-Medium step, shape by shape: where cuBLAS falls short.

cuBLAS's row-wise scaled e4m3 matmul (what every float8 layer calls,
`omnirl.models.float8.scaled_matmul`, fast accumulation) at each of the step's shapes. The
eighteenth GPU session's max-autotune log had the text stream's 10,656 rows (a micro-batch of
16 with CFG x 333 tokens) x 1,536 -> 1,536 at 0.105 ms, 480 TFLOP/s; timed here alone (the
nineteenth session) it runs in 0.047 ms, 1,072 TFLOP/s, near the wide shapes. Two ways to run
such shapes at the wide shapes' rate, timed beside the shapes as they are:

- `fused`: q, k and v as one 1,536 -> 4,608 matmul (one input quantisation, one kernel)
  against three 1,536 -> 1,536 ones; and their input gradient as one 4,608 -> 1,536 matmul
  (``dx = [dq dk dv] @ [Wq; Wk; Wv]``) against three 1,536 -> 1,536 ones and their sum;
- `padded`: the rows padded to a multiple of 256 (10,656 -> 10,752) in case cuBLAS's
  choice for the odd row count is what is slow (a padded call does more work: it pays when
  its `speedup` over the plain call is above 1).

Rows (`--rows`): 32,768 and 10,656 (micro-batch 16, image and text tokens), 16,384 and 5,328
(micro-batch 8), and each text count padded. Shapes (in -> out): 1,536 -> 1,536 (q, k, v, out;
their input gradients), 1,536 -> 4,608 (fused q, k, v), 1,536 -> 6,144 (feed-forward up; the
down projection's input gradient), 6,144 -> 1,536 (feed-forward down; the up projection's
input gradient), 4,608 -> 1,536 (the fused q, k, v's input gradient). Each row of the
output: ms, TFLOP/s; then per row count, three separate 1,536 -> 1,536 calls against one
fused (forward and input gradient), and each text row count against its padded one.

    python benchmarks/float8_matmul_shapes.py --device cuda --out $OUT/matmuls
    python benchmarks/float8_matmul_shapes.py --tiny      # a CPU dry run (emulated float8)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from probe_timing import seconds_per_call, write_results

SHAPES = ((1536, 1536), (1536, 4608), (1536, 6144), (6144, 1536), (4608, 1536))  # (in, out)
ROWS = "32768,10656,10752,16384,5328,5376"
TINY_SHAPES = ((32, 32), (32, 96), (32, 128), (128, 32), (96, 32))
TINY_ROWS = "256,80"
PAD = 256  # the padded row counts are multiples of this


def time_shape(rows: int, k: int, n: int, device, seconds: float) -> dict:
    """One ``scaled_matmul`` as a float8 layer calls it: e4m3 ``[rows, k]`` with row scales
    against a column-major e4m3 weight ``[k, n]`` with column scales, bf16 out."""
    from omnirl.models.float8 import FLOAT8, scaled_matmul

    gen = torch.Generator(device="cpu").manual_seed(rows * 7 + k + n)
    a = torch.randn(rows, k, generator=gen).to(device=device, dtype=FLOAT8)
    b = torch.randn(n, k, generator=gen).to(device=device, dtype=FLOAT8).t()  # column-major
    scale_a = torch.full((rows, 1), 0.01, device=device)
    scale_b = torch.full((1, n), 0.01, device=device)
    fast = device.type == "cuda"  # the CPU emulation has no fast accumulation mode
    seconds_per = seconds_per_call(
        lambda: scaled_matmul(a, b, scale_a, scale_b, fast), device, seconds, batch=10, min_calls=10
    )
    flops = 2.0 * rows * k * n
    return {
        "stage": "matmul",
        "rows": rows,
        "in": k,
        "out": n,
        "ms": round(seconds_per * 1e3, 4),
        "tflops": round(flops / seconds_per / 1e12, 1),
    }


def _ms(rows: list[dict], m: int, k: int, n: int) -> float | None:
    return next((r["ms"] for r in rows if (r["rows"], r["in"], r["out"]) == (m, k, n)), None)


def comparisons(rows: list[dict], shapes, row_counts: list[int]) -> list[dict]:
    """Three separate square projections against one fused (per row count), and each row
    count that is not a multiple of :data:`PAD` against the next multiple, when it was timed
    (``speedup``: the plain call's ms over the padded one's)."""
    (k, n), (_, fused_n) = shapes[0], shapes[1]
    out = []
    for m in row_counts:
        separate = _ms(rows, m, k, n)
        for stage, fused in (
            ("qkv_fused", _ms(rows, m, k, fused_n)),
            ("qkv_fused_input_grad", _ms(rows, m, fused_n, k)),
        ):
            if separate and fused:
                out.append(
                    {
                        "stage": stage,
                        "rows": m,
                        "separate_ms": round(3 * separate, 4),
                        "fused_ms": fused,
                        "speedup": round(3 * separate / fused, 3),
                    }
                )
    for m in row_counts:
        padded = -(-m // PAD) * PAD
        if padded == m or padded not in row_counts:
            continue
        for k_, n_ in shapes:
            plain, pad = _ms(rows, m, k_, n_), _ms(rows, padded, k_, n_)
            if plain and pad:
                out.append(
                    {
                        "stage": "padded",
                        "rows": m,
                        "padded_rows": padded,
                        "in": k_,
                        "out": n_,
                        "ms": plain,
                        "padded_ms": pad,
                        "speedup": round(plain / pad, 3),
                    }
                )
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="toy sizes, for CPU tests")
    p.add_argument("--rows", default=None, help=f"comma-separated row counts (default {ROWS})")
    p.add_argument("--seconds", type=float, default=0.3, help="timing per shape")
    p.add_argument("--out", default=None, help="directory for float8_matmul_shapes.jsonl")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    shapes = TINY_SHAPES if args.tiny else SHAPES
    row_counts = [int(r) for r in (args.rows or (TINY_ROWS if args.tiny else ROWS)).split(",")]
    rows = []
    for m in row_counts:
        for k, n in shapes:
            row = time_shape(m, k, n, device, args.seconds)
            rows.append(row)
            print("RESULT", json.dumps(row), flush=True)
    for row in comparisons(rows, shapes, row_counts):
        rows.append(row)
        print("RESULT", json.dumps(row), flush=True)
    if args.out:
        write_results(args.out, "float8_matmul_shapes", device, rows)
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
