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
- activations: one scale per row (token), computed on the fly in the forward, so an outlier
  token costs only its own row precision.

Only the linear layers of the denoiser's repeated blocks are converted, and of those not the
adaLN modulation (one row per sample: no speed to gain, and the whole block's scale and
shift depend on it) nor layers whose sizes are not multiples of 16 (the kernel's
requirement). A converted layer is still an ``nn.Linear`` holding its bf16 weight as the
parameter, so state-dict keys, full-weight updates and PEFT's LoRA wrapping (the adapter
branch stays bf16) work unchanged.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

log = logging.getLogger("omnirl.models.float8")

FLOAT8 = torch.float8_e4m3fn
FLOAT8_MAX = float(torch.finfo(FLOAT8).max)  # 448
_MIN_AMAX = 1e-12  # an all-zero row gets scale 1e-12 / 448 instead of a division by zero


class Float8Error(ValueError):
    """The model or device cannot run float8 linear layers."""


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Row-wise e4m3 quantisation.

    ``x`` ``[M, K]`` (any float dtype) -> ``(q, scale)``: ``q`` float8_e4m3fn ``[M, K]``,
    ``scale`` float32 ``[M, 1]`` with ``x ~= q.float() * scale``.
    """
    amax = x.abs().amax(dim=1, keepdim=True).float().clamp(min=_MIN_AMAX)
    scale = amax / FLOAT8_MAX
    q = (x.float() / scale).clamp(-FLOAT8_MAX, FLOAT8_MAX).to(FLOAT8)
    return q, scale


class Float8Linear(nn.Linear):
    """An ``nn.Linear`` whose forward is a row-wise scaled float8 matmul.

    Keeps ``weight`` (and ``bias``) as its parameters, in the model dtype; the float8 copy
    ``weight_fp8`` ``[out, in]`` and its scales ``weight_scale`` float32 ``[1, out]`` are
    non-persistent buffers, refreshed in place by :meth:`refresh` (in place, so a compiled
    graph that captured them stays valid). Output dtype: the input's.
    """

    def __init__(self, linear: nn.Linear):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
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
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        """Re-quantise the float8 weight from ``weight`` (after it changed)."""
        q, scale = quantize_rows(self.weight)
        self.weight_fp8.copy_(q)
        self.weight_scale.copy_(scale.t())

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        q, scale = quantize_rows(x.reshape(-1, self.in_features))
        y = torch._scaled_mm(
            q,
            self.weight_fp8.t(),  # column-major [in, out], as the kernel wants
            scale_a=scale,
            scale_b=self.weight_scale,
            out_dtype=torch.bfloat16,
        )
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x.dtype).reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, float8=e4m3 row-wise"


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


def check_float8_device(device: torch.device | str) -> None:
    """Raise :class:`Float8Error` unless ``device`` runs row-wise float8 matmuls: a CUDA GPU
    of compute capability 9.0 or newer (Hopper; the one measured is an H200), or the CPU,
    where torch emulates them (tests)."""
    device = torch.device(device)
    if device.type == "cpu":
        return
    if device.type != "cuda":
        raise Float8Error(f"float8 linear layers need a CUDA GPU or the CPU, not {device}")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (9, 0):
        raise Float8Error(
            f"float8 linear layers need compute capability 9.0 or newer (Hopper); "
            f"{torch.cuda.get_device_name(device)} is {major}.{minor}"
        )


def convert_to_float8(blocks: list[nn.Module]) -> int:
    """Replace the convertible ``nn.Linear`` layers inside ``blocks`` by :class:`Float8Linear`,
    in place (PEFT-wrapped layers: their ``base_layer``). Returns how many were converted.

    Idempotent: converted layers are ``Float8Linear``, which is not converted again.
    """
    count = 0
    for block in blocks:
        for name, module in list(block.named_modules()):
            if not name or not _convertible(name, module):
                continue
            parent_name, _, child = name.rpartition(".")
            parent = block.get_submodule(parent_name) if parent_name else block
            setattr(parent, child, Float8Linear(module))
            count += 1
    return count


def refresh_float8(module: nn.Module) -> int:
    """Re-quantise every :class:`Float8Linear` in ``module`` (call after a full-weight
    update); returns how many were refreshed."""
    layers = [m for m in module.modules() if isinstance(m, Float8Linear)]
    for layer in layers:
        layer.refresh()
    return len(layers)
