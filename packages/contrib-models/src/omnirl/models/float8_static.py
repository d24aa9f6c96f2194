"""Static float8 activation scales (:mod:`omnirl.models.float8`, ``"static"``): calibrating
them on real calls, asking for a new calibration, and switching layers on and off.

A rollout worker calibrates on its first real lease and every so many LoRA updates; a
trainer on a no-grad pass over the step's batches before the step that needs it (so every
pass of one step quantises alike). Both go through :func:`float8_calibration`.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any

import torch
from torch import nn

from omnirl.models.float8 import DEFAULT_MARGIN, Float8Error, float8_layers

log = logging.getLogger("omnirl.models.float8")


def request_float8_calibration(module: nn.Module) -> int:
    """Have every calibrated static float8 layer of ``module`` calibrate again on its next
    rollout call (a rollout worker asks every so many LoRA updates: the adapter moves the
    activations slowly, and the margin covers only so much); returns how many."""
    layers = [layer for layer in float8_layers(module) if layer.activation == "static"]
    for layer in layers:
        layer.calibrated = False
    return len(layers)


def needs_float8_calibration(module: nn.Module) -> bool:
    """Whether a static float8 layer in ``module`` has no calibrated scale yet."""
    return any(layer.needs_calibration for layer in float8_layers(module))


@contextlib.contextmanager
def float8_calibration(module: nn.Module, *, margin: float = DEFAULT_MARGIN):
    """Calibrate the static float8 layers of ``module`` on the calls made inside the block.

    The calls run eagerly (``torch.compiler.set_stance("force_eager")``): a compiled block
    would otherwise trace the calibrating forward as one more graph. They quantise row-wise
    meanwhile, so their outputs are as good as the default's. On a clean exit every layer's
    ``input_scale`` becomes ``margin * amax / 448``; a layer the calls never reached (or
    reached with zeros only) has no range to scale to and goes back to row-wise scales, so
    it neither asks for calibration on every later call nor saturates if it runs later. On
    an exception nothing is fixed.
    """
    if margin < 1:
        raise Float8Error(f"float8 calibration margin must be >= 1, got {margin}")
    layers = [layer for layer in float8_layers(module) if layer.activation == "static"]
    for layer in layers:
        layer.start_calibration()
    try:
        with torch.compiler.set_stance("force_eager"):
            yield
    except BaseException:
        for layer in layers:
            layer.calibrating = False
        raise
    unreached, growth = 0, []
    for layer in layers:
        if float(layer.input_amax) > 0:
            grew = layer.finish_calibration(margin)
            if grew is not None:
                growth.append(grew)
        else:
            layer.calibrating = False
            layer.configure(activation="rowwise", fast_accum=layer.fast_accum)
            unreached += 1
    log.info(
        "float8: %d layers calibrated (margin %g)%s%s",
        len(layers) - unreached,
        margin,
        f"; {unreached} not reached, left row-wise" if unreached else "",
        _growth_summary(growth, margin),
    )


def _growth_summary(growth: list[float], margin: float) -> str:
    """How far the inputs moved since the layers' previous calibration."""
    if not growth:
        return ""
    beyond = sum(g > margin for g in growth)
    return (
        f"; since the last calibration the largest input grew up to {max(growth):.2f}x "
        f"(median {sorted(growth)[len(growth) // 2]:.2f}x)"
        + (f", {beyond} layers beyond the margin: they had been saturating" if beyond else "")
    )


def float8_scales(module: nn.Module) -> dict[str, Any] | None:
    """The calibrated static scales of ``module``'s float8 layers, for a checkpoint: per layer
    (:func:`float8_layers` order) its scaling (a static layer that calibration never reached
    went back to ``"rowwise"``), its ``input_scale`` and the amax it was calibrated on.
    ``None`` when no layer is static or one still waits for its calibration: a resumed run
    then calibrates at its first step, as this one would have."""
    layers = float8_layers(module)
    if not any(layer.activation == "static" for layer in layers):
        return None
    if needs_float8_calibration(module):
        return None
    amax = [
        math.nan if layer.calibrated_amax is None else layer.calibrated_amax for layer in layers
    ]
    return {
        "activation": [layer.activation for layer in layers],
        "input_scale": torch.stack(
            [layer.input_scale.reshape(()).float().cpu() for layer in layers]
        ),
        "amax": torch.tensor(amax, dtype=torch.float64),
    }


@torch.no_grad()
def load_float8_scales(module: nn.Module, state: dict[str, Any]) -> int:
    """Put :func:`float8_scales`' ``state`` back into the same model's float8 layers: they
    quantise as they did when it was taken and calibrate again only when asked. Returns how
    many layers are static; raises :class:`Float8Error` if the layer count differs."""
    layers = float8_layers(module)
    kinds = list(state["activation"])
    if len(kinds) != len(layers):
        raise Float8Error(
            f"the float8 scales are for {len(kinds)} layers, this model has {len(layers)}"
        )
    rows = zip(layers, kinds, state["input_scale"], state["amax"].tolist(), strict=True)
    for layer, kind, scale, amax in rows:
        layer.configure(activation=kind, fast_accum=layer.fast_accum)
        if kind == "static":
            layer.input_scale.copy_(scale.reshape(1, 1))
            layer.calibrated = True
            layer.calibrated_amax = None if math.isnan(amax) else amax
    return kinds.count("static")


def set_float8_active(module: nn.Module, active: bool) -> int:
    """Switch every :class:`~omnirl.models.float8.Float8Linear` of ``module`` on (float8) or
    off (the plain linear layer in the model dtype); returns how many. A compiled block
    recompiles once for each setting it meets, then keeps both graphs."""
    layers = float8_layers(module)
    for layer in layers:
        layer.active = active
    return len(layers)


@contextlib.contextmanager
def float8_active(module: nn.Module):
    """The float8 layers of ``module`` switched on inside the block, off again after it (a
    trainer whose float8 covers its reference pass alone)."""
    set_float8_active(module, True)
    try:
        yield
    finally:
        set_float8_active(module, False)
