"""Float8 linear layers for the rollout: row-wise scaled e4m3 matmuls (an opt-in speed-up).

On Hopper and newer GPUs an e4m3 matmul runs at about twice the bf16 rate. The rollout may
trade precision for it because the trainer never uses the rollout's numbers as its own: it
recomputes the proximal log-probs itself, and the behaviour log-probs enter the objective
only through the decoupled weight ``exp(prox - behav)`` (``docs/algorithms.md``, "FlowGRPO,
decoupled for stale data"), whose deviation from 1 the parity report logs every step
(``behav_prox_logp_absdiff_mean`` / ``_max``). The trainer itself stays in bf16.

Scaling (what torch's row-wise ``_scaled_mm`` takes):

- weights: one scale per output channel, ``amax(|W[n, :]|) / 448``, quantised once when a
  layer is converted and again after every full-weight update (:func:`refresh_float8`);
- activations, ``"rowwise"`` (the default): one scale per row (token), computed on the fly
  in the forward, so an outlier token costs only its own row precision. The row's maximum
  must be known before the row is quantised: a reduction, and a second pass over the
  activation, before every matmul;
- activations, ``"static"``: one scale per layer, calibrated once on a whole rollout call
  (:func:`omnirl.models.float8_static.float8_calibration`: every timestep, the model's real
  inputs) as ``margin * amax / 448``. Quantising is then element-wise, fused by inductor
  into the kernel that produces the activation. A value beyond the calibrated range
  saturates at +-448 instead of overflowing; ``margin`` (default 2) is the headroom for
  activations that grow after calibration. The scales are kept across LoRA updates and recalibrated after a
  full-weight update (:meth:`Float8Linear.refresh`).

``fast_accum``: the matmul's fast accumulation mode on Hopper (partial sums not promoted to
float32 as often; what float8 inference usually runs with). Opt-in, like float8 itself.

**Training** (``Float8Linear.enable_backward``, the trainer's ``train.float8``): a LoRA
trainer's base weights are frozen, so of a linear layer's three matmuls only two remain, the
forward and the input gradient (``dx = dy @ W``). The forward runs in float8 as above, with
row-wise or static activation scales (a trainer calibrates static scales on a no-grad pass
before the step that needs them, so every pass of a step quantises alike); the input
gradient (``input_grad``) either in float8, ``dy`` quantised per row against a second
float8 copy of the weight quantised per input channel (``weight_t_fp8``), or in the model
dtype against ``weight`` itself (no reduction over ``dy``, no second copy). No weight
gradient is computed, so a layer whose weight requires one refuses to train (full
fine-tuning stays in the model dtype); the LoRA branch beside it is untouched. The input
activation is not saved for the backward (only a weight gradient would need it).

A layer can also be switched off (``active = False``): it then computes the plain
``nn.Linear`` in the model dtype. A trainer whose float8 covers only the KL reference pass
(``train.float8_scope: reference``) keeps its layers off except inside that pass, so the
policy's log-probs and gradients are the model dtype's.

Only the linear layers of the denoiser's repeated blocks are converted, and of those not the
adaLN modulation (one row per sample: no speed to gain, and the whole block's scale and
shift depend on it) nor layers whose sizes are not multiples of 16 (the kernel's
requirement). A converted layer is still an ``nn.Linear`` holding its bf16 weight as the
parameter, so state-dict keys, full-weight updates and PEFT's LoRA wrapping (the adapter
branch stays bf16) work unchanged.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

FLOAT8 = torch.float8_e4m3fn
FLOAT8_MAX = float(torch.finfo(FLOAT8).max)  # 448
_MIN_AMAX = 1e-12  # an all-zero row gets scale 1e-12 / 448 instead of a division by zero
ACTIVATION_SCALINGS = ("rowwise", "static")
INPUT_GRADS = ("float8", "model_dtype")  # how a trained layer computes dx = dy @ W
DEFAULT_MARGIN = 2.0


class Float8Error(ValueError):
    """The model or device cannot run float8 linear layers."""


FLOAT8_SCOPES = ("all", "reference")  # which of a trainer's passes run in float8


@dataclasses.dataclass(frozen=True)
class Float8Training:
    """How a LoRA trainer runs its frozen block linear layers in float8 (the trainer's
    ``train.float8_*`` keys; module docstring, "Training").

    ``activation``: ``"rowwise"`` or ``"static"`` (calibrated before the first step that
    needs it, and again every ``recalibrate_every`` updates; 0: only when asked);
    ``input_grad``: ``"float8"`` or ``"model_dtype"``; ``scope``: ``"all"`` (every pass) or
    ``"reference"`` (only the KL reference pass: the policy's log-probs and gradients stay
    in the model dtype); ``fast_accum``: Hopper's fast accumulation; ``margin``: the static
    scales' headroom over the calibrated range; ``fuse_projections``: sibling projections
    of one input (an attention's q, k, v) as one float8 matmul
    (:mod:`omnirl.models.float8_fused`), where the model family supports it.
    """

    activation: str = "rowwise"
    input_grad: str = "float8"
    scope: str = "all"
    fast_accum: bool = False
    margin: float = DEFAULT_MARGIN
    recalibrate_every: int = 100
    fuse_projections: bool = False

    def __post_init__(self) -> None:
        for value, known, what in (
            (self.activation, ACTIVATION_SCALINGS, "activation scaling"),
            (self.input_grad, INPUT_GRADS, "input gradient"),
            (self.scope, FLOAT8_SCOPES, "scope"),
        ):
            if value not in known:
                raise Float8Error(f"unknown float8 {what} {value!r}; known: {known}")
        if self.margin < 1:
            raise Float8Error(f"float8 calibration margin must be >= 1, got {self.margin}")
        if self.recalibrate_every < 0:
            raise Float8Error(
                f"float8 recalibrate_every must be >= 0, got {self.recalibrate_every}"
            )


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Row-wise e4m3 quantisation.

    ``x`` ``[M, K]`` (any float dtype) -> ``(q, scale)``: ``q`` float8_e4m3fn ``[M, K]``,
    ``scale`` float32 ``[M, 1]`` with ``x ~= q.float() * scale``.
    """
    amax = x.abs().amax(dim=1, keepdim=True).float().clamp(min=_MIN_AMAX)
    scale = amax / FLOAT8_MAX
    q = (x.float() / scale).clamp(-FLOAT8_MAX, FLOAT8_MAX).to(FLOAT8)
    return q, scale


def scaled_matmul(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, fast: bool) -> Tensor:
    """``(a * scale_a) @ (b * scale_b)`` in bf16: float8 ``a`` ``[M, K]`` (row-major) and ``b``
    ``[K, N]`` (column-major), float32 ``scale_a`` ``[M, 1]`` and ``scale_b`` ``[1, N]``.

    Outside autocast: its inputs and output dtype are explicit, and torch's CPU emulation
    under autocast computes something else (about 1e-1 apart at unit scale), which the
    compiled graph does not, so eager and compiled layers would disagree.
    """
    with torch.autocast(a.device.type, enabled=False):
        return torch._scaled_mm(
            a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16, use_fast_accum=fast
        )


def quantize_static(x: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """e4m3 quantisation of ``x`` ``[M, K]`` at one calibrated ``scale`` float32 ``[1, 1]``
    (element-wise: no reduction); values beyond the range saturate. Returns ``q`` ``[M, K]``
    and the scale broadcast to the rows, ``[M, 1]`` (the row-wise kernel's layout)."""
    q = (x.float() / scale).clamp(-FLOAT8_MAX, FLOAT8_MAX).to(FLOAT8)
    return q, scale.expand(x.shape[0], 1).contiguous()


def quantized_matmul(
    rows: Tensor, weight_fp8: Tensor, weight_scale: Tensor, input_scale: Tensor | None, fast: bool
) -> Tensor:
    """``rows @ W^T`` in float8: ``rows`` ``[M, in]`` quantised per row (``input_scale``
    ``None``) or at the static ``input_scale`` ``[1, 1]``; ``weight_fp8`` ``[out, in]`` with
    per-output-channel ``weight_scale`` ``[1, out]``. Returns bf16 ``[M, out]``."""
    q, scale = quantize_rows(rows) if input_scale is None else quantize_static(rows, input_scale)
    return scaled_matmul(q, weight_fp8.t(), scale, weight_scale, fast)  # b column-major


def input_gradient(grad_rows: Tensor, saved: tuple[Tensor, ...], fast_accum: bool) -> Tensor:
    """``dx = dy @ W`` for ``grad_rows`` ``[M, out]``: ``saved`` is ``(weight,)`` ``[out, in]``
    (the model dtype's matmul) or ``(weight_t_fp8, weight_t_scale)``, the weight's
    per-input-channel float8 copy ``[in, out]`` with scales ``[1, in]`` (``dy`` quantised per
    row). Returns ``[M, in]``."""
    if len(saved) == 1:
        (weight,) = saved
        return grad_rows.to(weight.dtype) @ weight
    weight_t_fp8, weight_t_scale = saved
    q, scale = quantize_rows(grad_rows.contiguous())
    return scaled_matmul(q, weight_t_fp8.t(), scale, weight_t_scale, fast_accum)  # b: [out, in]


class _Float8Matmul(torch.autograd.Function):
    """``y = x @ W^T`` with a float8 forward and an input gradient in float8 or in the model
    dtype (``W`` frozen).

    ``rows`` ``[M, in]``; ``input_scale`` float32 ``[1, 1]`` (static) or ``None`` (row-wise);
    ``saved``: what :func:`input_gradient` needs (``Float8Linear.input_grad_tensors``).
    Returns bf16 ``[M, out]``; the gradient w.r.t. ``rows`` is in ``rows``' dtype. Nothing of
    ``rows`` is saved: without a weight gradient it is not needed.
    """

    @staticmethod
    def forward(ctx, rows, weight_fp8, weight_scale, input_scale, fast, *saved):
        ctx.save_for_backward(*saved)
        ctx.fast_accum, ctx.in_dtype = fast, rows.dtype
        return quantized_matmul(rows, weight_fp8, weight_scale, input_scale, fast)

    @staticmethod
    def backward(ctx, grad):
        dx = input_gradient(grad, ctx.saved_tensors, ctx.fast_accum)
        return dx.to(ctx.in_dtype), *[None] * (4 + len(ctx.saved_tensors))


class Float8Linear(nn.Linear):
    """An ``nn.Linear`` whose forward is a row-wise scaled float8 matmul.

    Keeps ``weight`` (and ``bias``) as its parameters, in the model dtype and frozen (a
    float8 forward has no weight gradient; a weight set to require one is refused); the float8 copy
    ``weight_fp8`` ``[out, in]`` and its scales ``weight_scale`` float32 ``[1, out]`` are
    non-persistent buffers, refreshed in place by :meth:`refresh` (in place, so a compiled
    graph that captured them stays valid). Output dtype: the input's.

    ``activation``: ``"rowwise"`` or ``"static"`` (module docstring). A static layer holds
    ``input_scale`` float32 ``[1, 1]`` and, while :attr:`calibrating`, gathers the largest
    ``|x|`` it sees in ``input_amax`` ``[1]``; until its first calibration ends it quantises
    row-wise. ``active``: ``False`` computes the plain linear layer in the weight's dtype.
    """

    def __init__(self, linear: nn.Linear, *, activation: str = "rowwise", fast_accum: bool = False):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        # frozen: a float8 forward computes no weight gradient (updates still copy in place)
        self.requires_grad_(False)
        device = linear.weight.device
        self.register_buffer(
            "weight_fp8",
            torch.empty(self.out_features, self.in_features, dtype=FLOAT8, device=device),
            persistent=False,
        )
        self.register_buffer(
            "weight_scale",
            torch.empty(1, self.out_features, dtype=torch.float32, device=device),
            persistent=False,
        )
        # the input gradient's weight copy (enable_backward): [in, out], per input channel
        self.register_buffer("weight_t_fp8", None, persistent=False)
        self.register_buffer("weight_t_scale", None, persistent=False)
        self.register_buffer("input_scale", torch.ones(1, 1, device=device), persistent=False)
        self.register_buffer("input_amax", torch.zeros(1, device=device), persistent=False)
        self.activation = "rowwise"
        self.fast_accum = False
        self.active = True
        self.input_grad: str | None = None  # enable_backward: one of INPUT_GRADS
        self.calibrating = False
        self.calibrated = False
        self.calibrated_amax: float | None = None  # the largest input of the last calibration
        self.configure(activation=activation, fast_accum=fast_accum)
        self.refresh()

    def configure(self, *, activation: str, fast_accum: bool) -> None:
        """Set the activation scaling and the accumulation mode (a compiled block recompiles
        once, on its next call). Switching to ``"static"`` asks for a new calibration."""
        if activation not in ACTIVATION_SCALINGS:
            raise Float8Error(
                f"unknown float8 activation scaling {activation!r}; known: {ACTIVATION_SCALINGS}"
            )
        if activation == "static" and self.activation != "static":
            self.calibrated = False
        self.activation = activation
        self.fast_accum = bool(fast_accum)

    @property
    def trains(self) -> bool:
        """Whether the layer back-propagates to its input (:meth:`enable_backward`)."""
        return self.input_grad is not None

    @torch.no_grad()
    def enable_backward(self, input_grad: str = "float8") -> None:
        """Back-propagate to the input (the module docstring's "Training"): ``input_grad``
        ``"float8"`` keeps a second float8 copy of the weight, quantised per input channel;
        ``"model_dtype"`` multiplies ``dy`` by ``weight`` itself. The weight must be frozen."""
        if self.weight.requires_grad:
            raise Float8Error(
                "a float8 layer trains only with a frozen weight (LoRA); this one requires a "
                "gradient (full fine-tuning runs in the model dtype)"
            )
        if input_grad not in INPUT_GRADS:
            raise Float8Error(f"unknown float8 input gradient {input_grad!r}; known: {INPUT_GRADS}")
        self.input_grad = input_grad
        w = self.weight
        if input_grad == "model_dtype":
            self.weight_t_fp8 = self.weight_t_scale = None
        elif self.weight_t_fp8 is None:
            self.weight_t_fp8 = torch.empty(w.shape[1], w.shape[0], dtype=FLOAT8, device=w.device)
            self.weight_t_scale = torch.empty(1, w.shape[1], dtype=torch.float32, device=w.device)
        self.refresh(recalibrate=False)

    @property
    def needs_calibration(self) -> bool:
        return self.activation == "static" and not self.calibrated

    @torch.no_grad()
    def refresh(self, *, recalibrate: bool = True) -> None:
        """Re-quantise the float8 weight from ``weight`` (after it changed). ``recalibrate``:
        a static layer calibrates again on its next rollout call (a full-weight update moves
        every activation; a merged LoRA update, like an adapter's, keeps the scales)."""
        q, scale = quantize_rows(self.weight)
        self.weight_fp8.copy_(q)
        self.weight_scale.copy_(scale.t())
        if self.weight_t_fp8 is not None:
            q, scale = quantize_rows(self.weight.t())
            self.weight_t_fp8.copy_(q)
            self.weight_t_scale.copy_(scale.t())
        if recalibrate:
            self.calibrated = False

    @torch.no_grad()
    def finish_calibration(self, margin: float) -> float | None:
        """Fix ``input_scale`` from the amax gathered since :meth:`start_calibration`.
        Returns how much that amax grew since the layer's previous calibration (``None`` at
        its first): a growth beyond the margin means the old scale had been saturating."""
        amax = self.input_amax.clamp(min=_MIN_AMAX)
        self.input_scale.copy_((amax * margin / FLOAT8_MAX).view(1, 1))
        self.calibrating = False
        self.calibrated = True
        previous, self.calibrated_amax = self.calibrated_amax, float(amax)
        return None if previous is None else self.calibrated_amax / previous

    def start_calibration(self) -> None:
        self.input_amax.zero_()
        self.calibrating = True

    def forward(self, x: Tensor) -> Tensor:
        if not self.active:
            return nn.functional.linear(x, self.weight, self.bias)
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        if torch.is_grad_enabled() and (rows.requires_grad or self.weight.requires_grad):
            y = self._trained_matmul(rows)
        else:
            scale = self._static_scale(rows)
            y = quantized_matmul(rows, self.weight_fp8, self.weight_scale, scale, self.fast_accum)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x.dtype).reshape(*lead, self.out_features)

    def _static_scale(self, rows: Tensor) -> Tensor | None:
        """The calibrated input scale ``[1, 1]``, or ``None`` for row-wise scales (row-wise
        layers; static ones before or during calibration, which gathers ``rows``' range)."""
        if self.activation == "static" and self.calibrated and not self.calibrating:
            return self.input_scale
        if self.calibrating:
            torch.maximum(self.input_amax, rows.detach().abs().amax().float(), out=self.input_amax)
        return None

    def _trained_matmul(self, rows: Tensor) -> Tensor:
        if not self.trains or self.weight.requires_grad:
            raise Float8Error(
                "a gradient through a float8 layer needs enable_backward() and a frozen "
                "weight (a float8 forward computes no weight gradient)"
            )
        return _Float8Matmul.apply(
            rows,
            self.weight_fp8,
            self.weight_scale,
            self._static_scale(rows),
            self.fast_accum,
            *self.input_grad_tensors,
        )

    @property
    def input_grad_tensors(self) -> tuple[Tensor, ...]:
        """What the input gradient multiplies ``dy`` by (:func:`input_gradient`): the float8
        copy and its scales, or the model-dtype weight."""
        if self.weight_t_fp8 is None:
            return (self.weight,)
        return (self.weight_t_fp8, self.weight_t_scale)

    def extra_repr(self) -> str:
        accum = ", fast accumulation" if self.fast_accum else ""
        trains = f", input gradient in {self.input_grad}" if self.trains else ""
        off = ", off (model dtype)" if not self.active else ""
        return (
            f"{super().extra_repr()}, float8=e4m3, activations {self.activation}"
            f"{accum}{trains}{off}"
        )


def _is_modulation(name: str) -> bool:
    # diffusers' adaLN layers: norm1.linear, norm1_context.linear, norm_out.linear, norm.linear
    return any(part.startswith("norm") for part in name.split(".")[:-1])


def _convertible(name: str, module: nn.Module) -> bool:
    return (
        type(module) is nn.Linear
        and "lora_" not in name  # PEFT's adapter matrices stay in the model dtype
        and not _is_modulation(name)
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )


def convertible_linears(block: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The ``(name, layer)`` pairs of ``block`` that :func:`convert_to_float8` converts (PEFT's
    wrapped layers by their ``base_layer``)."""
    return [
        (name, module)
        for name, module in block.named_modules()
        if name and _convertible(name, module)
    ]


def _check_cpu_emulation() -> None:
    # torch's CPU backend took row-wise scales only in later releases (2.11 refuses them)
    q = torch.zeros(16, 16, dtype=FLOAT8)
    scale = torch.ones(16, 1)
    try:
        torch._scaled_mm(q, q.t(), scale_a=scale, scale_b=scale.t(), out_dtype=torch.bfloat16)
    except RuntimeError as err:
        raise Float8Error(
            f"this torch ({torch.__version__}) cannot run row-wise float8 matmuls on the CPU: "
            f"{str(err).splitlines()[0][:200]}"
        ) from err


def check_float8_device(device: torch.device | str) -> None:
    """Raise :class:`Float8Error` unless ``device`` runs row-wise float8 matmuls: a CUDA GPU
    of compute capability 9.0 or newer (Hopper; the one measured is an H200), or the CPU,
    where torch emulates them (tests; torch releases whose CPU backend takes only per-tensor
    scales are refused)."""
    device = torch.device(device)
    if device.type == "cpu":
        _check_cpu_emulation()
        return
    if device.type != "cuda":
        raise Float8Error(f"float8 linear layers need a CUDA GPU or the CPU, not {device}")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (9, 0):
        raise Float8Error(
            f"float8 linear layers need compute capability 9.0 or newer (Hopper); "
            f"{torch.cuda.get_device_name(device)} is {major}.{minor}"
        )


def convert_to_float8(
    blocks: list[nn.Module], *, activation: str = "rowwise", fast_accum: bool = False
) -> int:
    """Replace the convertible ``nn.Linear`` layers inside ``blocks`` by :class:`Float8Linear`,
    in place (PEFT-wrapped layers: their ``base_layer``). Returns how many were converted.

    Idempotent: converted layers are ``Float8Linear``, which is not converted again (use
    :func:`configure_float8` to change their scaling).
    """
    count = 0
    for block in blocks:
        for name, module in convertible_linears(block):
            parent_name, _, child = name.rpartition(".")
            parent = block.get_submodule(parent_name) if parent_name else block
            setattr(
                parent, child, Float8Linear(module, activation=activation, fast_accum=fast_accum)
            )
            count += 1
    return count


def refresh_float8(module: nn.Module) -> int:
    """Re-quantise every :class:`Float8Linear` in ``module`` (call after a full-weight
    update); returns how many were refreshed."""
    layers = [m for m in module.modules() if isinstance(m, Float8Linear)]
    for layer in layers:
        layer.refresh()
    return len(layers)


def float8_layers(module: nn.Module) -> list[Float8Linear]:
    return [m for m in module.modules() if isinstance(m, Float8Linear)]


def configure_float8(module: nn.Module, *, activation: str, fast_accum: bool = False) -> int:
    """Set every :class:`Float8Linear` in ``module`` to ``activation`` scaling and
    ``fast_accum``; returns how many."""
    layers = float8_layers(module)
    for layer in layers:
        layer.configure(activation=activation, fast_accum=fast_accum)
    return len(layers)
