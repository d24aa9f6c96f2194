"""A LoRA adapter folded into its base weights, for a rollout that only runs forward passes.

An unmerged adapter costs every adapted layer two extra matmuls and an add per call. On a
small model that is most of the layer (the ShapesEval transformer: rank 32 on 64-wide layers
doubles each adapted linear), on a large one a few percent. A rollout never needs the
adapter separate, so it can run ``W = W0 + scale * B @ A`` instead, recomputed after each
LoRA update from a copy of the base weight ``W0`` taken when the adapter is first merged (not
by adding and subtracting deltas, whose rounding would accumulate over thousands of updates).

Precision: in float32 the merged layer agrees with the adapter's ``W0 x + scale B (A x)`` to
float32 rounding. In bf16 it does not: the delta of a young adapter is far below the
resolution of a bf16 weight and would be rounded away, so half-precision rollouts keep the
adapter unmerged (``omnirl.rollout.model``: ``lora_mode="auto"``).

Memory: the base copies double the memory of the adapted layers' weights (small for the
float32 models ``auto`` merges; a forced merge of a large model pays it in full).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from omnirl.models.base import WeightLoadError
from omnirl.models.float8 import Float8Linear
from omnirl.models.weights import DEFAULT_ADAPTER


class MergedLora:
    """Keeps the PEFT adapter ``adapter`` of ``module`` folded into the base weights.

    :meth:`refresh` (after every change of the adapter's tensors) sets each adapted layer's
    base weight to ``W0 + delta`` and marks the adapter merged in PEFT's own state, so the
    layer's forward skips the adapter branch. The adapter's tensors stay where they are: a
    LoRA update is still validated and copied into them, then refreshed from them.
    """

    def __init__(self, module: nn.Module, adapter: str = DEFAULT_ADAPTER):
        self.module = module
        self.adapter = adapter
        self.base: dict[int, Tensor] = {}  # id(layer) -> W0, float copy of the base weight

    def layers(self) -> list[nn.Module]:
        from peft.tuners.lora import LoraLayer

        return [
            m
            for m in self.module.modules()
            if isinstance(m, LoraLayer) and self.adapter in getattr(m, "lora_A", {})
        ]

    @torch.no_grad()
    def refresh(self) -> int:
        """Fold the adapter's current tensors into the base weights; returns how many layers.

        Raises :class:`WeightLoadError` for a DoRA adapter (its merge depends on the weight
        norm, not a plain delta) before changing anything.
        """
        layers = self.layers()
        dora = [type(m).__name__ for m in layers if m.use_dora.get(self.adapter, False)]
        if dora:
            raise WeightLoadError("a DoRA adapter cannot be merged; run it as an adapter")
        for layer in layers:
            base = layer.get_base_layer()
            w0 = self.base.get(id(layer))
            if w0 is None:
                w0 = self.base[id(layer)] = base.weight.detach().clone()
                if self.adapter not in layer.merged_adapters:
                    layer.merged_adapters.append(self.adapter)  # forward: base layer only
            delta = layer.get_delta_weight(self.adapter)
            base.weight.copy_((w0.float() + delta.float()).to(base.weight.dtype))
            if isinstance(base, Float8Linear):  # its float8 copy follows the new weight;
                base.refresh(recalibrate=False)  # static scales stay, as for an adapter
        return len(layers)
