"""Sibling float8 projections of one input as one matmul (an attention's q, k and v).

Three :class:`~omnirl.models.float8.Float8Linear` layers that read the same activation
(``to_q``, ``to_k``, ``to_v``; the text stream's ``add_q_proj``, ``add_k_proj``,
``add_v_proj``) each quantise it and each call a ``[M, 1536] x [1536, 1536]`` matmul; fused,
the input is quantised once and one ``[M, 1536] x [1536, 4608]`` matmul runs. Measured on
SD3.5-M (the nineteenth GPU session) this is **not a speed-up**: the separate matmuls already
run near the card's float8 rate (1,072 TFLOP/s for the text stream's 10,656 rows), the fused
one saves about 10 % of them, and inductor's kernels around it cost more than that (the
training step 1.9 % slower, the rollout unchanged). Hence opt-in.

:func:`project_fused` does that for any group of sibling layers, PEFT-wrapped or not, and
adds each layer's LoRA branch to its own slice, as PEFT's forward would:

- the fused weight is the members' float8 copies concatenated at the call (a 1-byte-per-
  weight copy, small beside the matmul), so nothing cached can go stale: calibration,
  re-quantisation after a weight update and merged LoRA updates keep working per layer;
- per-output-channel weight scales concatenate exactly; the input scale is the row's
  (``"rowwise"``: the same for every member, since they read the same rows) or the largest
  of the members' calibrated static scales (equal in practice: calibrated on the same input);
- trained, the input gradient is each member's own, as unfused (a float8 ``dy`` quantised per
  member, or the model dtype), summed; only the forward is fused.

Any group it cannot fuse (a member not float8, switched off, calibrating or not calibrated
yet, configured unlike the others, or a LoRA variant such as DoRA) runs each layer as it is.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from omnirl.models.float8 import Float8Linear, input_gradient, quantized_matmul


def base_layer(layer: nn.Module) -> nn.Module:
    """The layer PEFT wraps (``layer`` itself when it is not wrapped)."""
    get_base = getattr(layer, "get_base_layer", None)
    return get_base() if callable(get_base) else layer


def _plain_lora(layer: nn.Module) -> bool:
    """Whether ``layer``'s adapters are PEFT's vanilla LoRA (or absent): no DoRA or other
    variant, no mixed-batch adapters."""
    return not getattr(layer, "lora_variant", None)


def fusable_bases(layers: Sequence[nn.Module]) -> list[Float8Linear] | None:
    """The members' float8 base layers when one fused matmul can stand for them, else
    ``None`` (module docstring)."""
    bases = [base_layer(layer) for layer in layers]
    if len(bases) < 2 or not all(type(b) is Float8Linear for b in bases):
        return None
    first = bases[0]
    key = (first.in_features, first.activation, first.fast_accum, first.input_grad)
    for layer, base in zip(layers, bases, strict=True):
        if not base.active or base.calibrating or base.needs_calibration:
            return None
        if (base.in_features, base.activation, base.fast_accum, base.input_grad) != key:
            return None
        if not _plain_lora(layer) or (getattr(layer, "merged", False) and layer.disable_adapters):
            return None  # a variant; or PEFT would unmerge first
    return bases


def lora_delta(layer: nn.Module, x: Tensor) -> Tensor | None:
    """What ``layer``'s active LoRA adapters add to its base output for input ``x`` (PEFT's
    vanilla LoRA: ``lora_B(lora_A(dropout(x))) * scaling`` per adapter), or ``None`` when it
    has no adapter, they are disabled or merged into the base weight."""
    lora_a = getattr(layer, "lora_A", None)
    if lora_a is None or layer.disable_adapters or layer.merged:
        return None
    delta = None
    for name in layer.active_adapters:
        if name not in lora_a:
            continue
        a = lora_a[name]
        branch_input = layer._cast_input_dtype(x, a.weight.dtype)
        branch = layer.lora_B[name](a(layer.lora_dropout[name](branch_input))) * layer.scaling[name]
        delta = branch if delta is None else delta + branch
    return delta


def _input_scale(bases: list[Float8Linear]) -> Tensor | None:
    if bases[0].activation != "static":
        return None
    scale = bases[0].input_scale
    for base in bases[1:]:
        scale = torch.maximum(scale, base.input_scale)
    return scale


class _FusedFloat8Matmul(torch.autograd.Function):
    """``rows @ [W_1; ...; W_n]^T`` in one float8 matmul, the members' weights frozen; the
    input gradient is each member's own (:func:`~omnirl.models.float8.input_gradient` of its
    ``input_grad_tensors``), summed.

    ``rows`` ``[M, in]``; ``weight_fp8`` ``[sum out, in]``; ``weight_scale`` ``[1, sum out]``;
    ``input_scale`` ``[1, 1]`` or ``None``; ``sizes`` each member's ``out``; ``counts`` how
    many of the flat ``saved`` tensors are each member's (1 or 2). Returns bf16
    ``[M, sum out]``.
    """

    @staticmethod
    def forward(ctx, rows, weight_fp8, weight_scale, input_scale, fast, sizes, counts, *saved):
        ctx.save_for_backward(*saved)
        ctx.sizes, ctx.counts, ctx.fast_accum, ctx.in_dtype = sizes, counts, fast, rows.dtype
        return quantized_matmul(rows, weight_fp8, weight_scale, input_scale, fast)

    @staticmethod
    def backward(ctx, grad):
        saved, dx = list(ctx.saved_tensors), None
        for part, count in zip(grad.split(list(ctx.sizes), dim=-1), ctx.counts, strict=True):
            part_dx = input_gradient(part, tuple(saved[:count]), ctx.fast_accum)
            del saved[:count]
            dx = part_dx if dx is None else dx + part_dx
        return (dx.to(ctx.in_dtype), *[None] * (6 + sum(ctx.counts)))


def fused_base_outputs(bases: list[Float8Linear], x: Tensor) -> list[Tensor]:
    """Each base layer's output for ``x`` ``[..., in]`` (``[..., out_i]``, ``x``'s dtype), from
    one float8 matmul (``bases`` from :func:`fusable_bases`; trained ones when ``x`` needs a
    gradient)."""
    lead = x.shape[:-1]
    rows = x.reshape(-1, bases[0].in_features)
    # autocast's type promotion for cat knows no float8
    with torch.autocast(x.device.type, enabled=False):
        weight_fp8 = torch.cat([b.weight_fp8 for b in bases])
        weight_scale = torch.cat([b.weight_scale for b in bases], dim=1)
    input_scale = _input_scale(bases)
    fast = bases[0].fast_accum
    sizes = tuple(b.out_features for b in bases)
    if torch.is_grad_enabled() and rows.requires_grad:
        saved = [b.input_grad_tensors for b in bases]
        counts = tuple(len(t) for t in saved)
        flat = [t for member in saved for t in member]
        y = _FusedFloat8Matmul.apply(
            rows, weight_fp8, weight_scale, input_scale, fast, sizes, counts, *flat
        )
    else:
        y = quantized_matmul(rows, weight_fp8, weight_scale, input_scale, fast)
    outputs = []
    for base, part in zip(bases, y.split(list(sizes), dim=-1), strict=True):
        if base.bias is not None:
            part = part + base.bias.to(part.dtype)
        outputs.append(part.to(x.dtype).reshape(*lead, base.out_features))
    return outputs


def project_fused(layers: Sequence[nn.Module], x: Tensor) -> list[Tensor]:
    """``[layer(x) for layer in layers]``, with the float8 base matmuls fused into one when
    :func:`fusable_bases` allows (module docstring); the same values either way, up to the
    matmul's accumulation order and, for static scales calibrated apart, the larger scale."""
    bases = fusable_bases(layers)
    if bases is None or (torch.is_grad_enabled() and x.requires_grad and not bases[0].trains):
        return [layer(x) for layer in layers]  # (an untrained layer raises its own error)
    outputs = []
    for layer, base_out in zip(layers, fused_base_outputs(bases, x), strict=True):
        delta = lora_delta(layer, x)
        outputs.append(base_out if delta is None else (base_out + delta).to(base_out.dtype))
    return outputs
