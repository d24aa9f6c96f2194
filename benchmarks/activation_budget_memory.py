"""What ``train.activation_memory_budget`` keeps: the bytes a LoRA trainer's compiled
SD3.5-Medium blocks save for the backward, by budget, as AOTAutograd partitions them on the CPU.

One block of each of SD3.5-Medium's three variants (dual attention, plain, the last,
context-pre-only one) at full width, in bf16, with the benchmark's LoRA (r 32 on every
attention projection; base weights frozen), 2 rows (one sample with CFG) of 1,024 image +
333 text tokens (512x512 images; ``--side``), compiled with ``aot_eager`` (AOTAutograd's
partitioner, which reads the budget, without generating kernels); each variant's bytes scaled
to the model's 13 + 10 + 1 blocks. ``--float8``: the float8 trainer's blocks instead (every
block linear a frozen float8 layer, static scales calibrated on the same inputs, a float8
input gradient; torch's CPU emulation of the float8 matmuls).

What budget 1 keeps is the graph's own (the same on a GPU but for the attention kernel's
saved tensors). Below 1 the partition follows the partitioner's cost estimates for the
operators it sees, and the CPU's graph has other ones (its attention kernel, the emulated
float8 matmuls): on an H100 budget 0.5 took 1.9 GB a sample off the float8 trainer's step,
where this count finds nothing to take (``docs/gpu_sessions.md``, "seventeenth"). Plan with
the GPU's figures (``gpu_sd35m.py --activation-memory-budget``); this one says what the
blocks save with no budget, and which block variant holds what.

``--backend inductor`` partitions as the trainer's compile does, with the pass that keeps the
attention's outputs saved under a budget (``omnirl.models.compile_attention``; inductor
only); ``--recompute-attention`` leaves the choice to torch's partitioner alone.

    uv run python benchmarks/activation_budget_memory.py [--budgets 1,0.8,0.5,0.3] [--tiny]
        [--float8] [--side 512] [--backend inductor [--recompute-attention]]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_sd35m_setup import SD35M_TRANSFORMER

from omnirl.models.compile import CompileConfig, compile_module
from omnirl.models.sd3.lora import add_lora

BLOCKS_OF = {"dual": 13, "plain": 10, "last": 1}  # SD3.5-Medium's 24 blocks by variant


def _model(tiny: bool, float8: bool):
    from diffusers import SD3Transformer2DModel

    config = dict(SD35M_TRANSFORMER, num_layers=3, dual_attention_layers=(0,))
    if tiny:
        config.update(num_attention_heads=2, attention_head_dim=16, caption_projection_dim=32)
        config.update(joint_attention_dim=32, pooled_projection_dim=32, sample_size=8)
    torch.manual_seed(0)
    model = SD3Transformer2DModel(**config).to(torch.bfloat16)
    add_lora(model, {"r": 4 if tiny else 32, "lora_alpha": 8 if tiny else 64})
    if float8:
        from omnirl.models.float8 import convert_to_float8, float8_layers

        convert_to_float8(list(model.transformer_blocks), activation="static")
        for layer in float8_layers(model):
            layer.enable_backward("float8")
    return model


def saved_bytes_by_variant(
    budget: float | None,
    *,
    tiny: bool,
    float8: bool,
    side: int = 512,
    backend: str = "aot_eager",
    recompute_attention: bool = False,
) -> dict[str, int]:
    """Bytes autograd saves inside each block variant for one forward of 2 rows: each
    buffer once, the parameters and the modules' buffers (float8 weight copies) not at all.
    ``side``: the image's height and width in pixels (the latent is an eighth of it)."""
    torch._dynamo.reset()
    model = _model(tiny, float8)
    config = CompileConfig(
        backend=backend,
        activation_memory_budget=budget,
        recompute_attention=recompute_attention,
    )
    compile_module(model, config)
    names = ["dual", "plain", "last"]
    current: list[str] = []
    saved = dict.fromkeys(names, 0)

    def leave(module, args, output) -> None:  # returns None: the output stays the block's
        current.pop()

    for name, block in zip(names, model.transformer_blocks, strict=True):
        block.register_forward_pre_hook(lambda m, a, n=name: current.append(n))
        block.register_forward_hook(leave)

    # memory, not references: a saved weight is the parameter itself, and several saved
    # views of one buffer (q, k, v of one projection) hold that buffer once
    held = [*model.parameters(), *model.buffers()]
    counted = {t.untyped_storage().data_ptr() for t in held}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if current and storage.data_ptr() not in counted:
            counted.add(storage.data_ptr())
            saved[current[-1]] += storage.nbytes()
        return t

    cfg = model.config
    gen = torch.Generator().manual_seed(1)
    # the config's sample_size is SD3.5's 1024x1024 default; the step's images are ``side``
    latent, text = (cfg.sample_size if tiny else side // 8), (8 if tiny else 333)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    # autocast as the trainer's (the LoRA weights are float32); on a GPU the trainer's
    # attention is bf16 too, which the CPU's bf16 SDPA stands in for here
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    inputs = {
        "hidden_states": rand(2, cfg.in_channels, latent, latent),
        "encoder_hidden_states": rand(2, text, cfg.joint_attention_dim),
        "pooled_projections": rand(2, cfg.pooled_projection_dim),
        "timestep": torch.tensor([500.0, 500.0]),
        "return_dict": False,
    }
    if float8:  # the static scales, from one eager pass on the same inputs (as the trainer)
        from omnirl.models.float8_static import float8_calibration

        with float8_calibration(model), torch.no_grad(), autocast:
            model(**inputs)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        # a forward with grad: AOTAutograd partitions the joint graph here
        out = model(**inputs)[0]
    del out  # what the forward saved is counted; the backward would only free it
    return saved


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budgets", default="1,0.8,0.5,0.3")
    p.add_argument("--tiny", action="store_true", help="toy widths (a quick dry run)")
    p.add_argument("--side", type=int, default=512, help="image side in pixels (not --tiny)")
    p.add_argument(
        "--float8", action="store_true", help="the float8 trainer's blocks (static scales)"
    )
    p.add_argument("--backend", default="aot_eager", help="inductor: as the trainer compiles")
    p.add_argument(
        "--recompute-attention",
        action="store_true",
        help="under a budget, let torch's partitioner recompute the attention (inductor)",
    )
    p.add_argument("--out", type=Path, default=None, help="write the rows here as JSONL")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = []
    for text in args.budgets.split(","):
        budget = None if float(text) == 1.0 else float(text)
        saved = saved_bytes_by_variant(
            budget,
            tiny=args.tiny,
            float8=args.float8,
            side=args.side,
            backend=args.backend,
            recompute_attention=args.recompute_attention,
        )
        model_gb = sum(saved[v] * n for v, n in BLOCKS_OF.items()) / 1e9
        row = {
            "budget": float(text),
            "float8": args.float8,
            "side": None if args.tiny else args.side,
            "backend": args.backend,
            "recompute_attention": args.recompute_attention,
            **{f"{v}_block_mb": round(b / 1e6, 2) for v, b in saved.items()},
            "model_gb_per_sample": round(model_gb, 3),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    base = rows[0]["model_gb_per_sample"]
    print(
        "| budget | dual block MB | plain block MB | last block MB | 24 blocks, GB a sample | vs budget 1 |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        share = r["model_gb_per_sample"] / base if base else float("nan")
        print(
            f"| {r['budget']} | {r['dual_block_mb']} | {r['plain_block_mb']} | "
            f"{r['last_block_mb']} | {r['model_gb_per_sample']} | {share:.2f} |"
        )
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
