"""Wire dtypes, and tensor <-> raw frame conversion without copies.

A tensor travels as one frame holding its elements in C order, little-endian, with no
padding: ``numel(shape) * itemsize`` bytes. torch is imported inside the functions, so
``omnirl.protocol`` imports (and speaks tensor-free messages) without it.

Encoding hands out a memoryview of the tensor's own memory (a non-contiguous tensor is
made contiguous first: the one copy). Decoding wraps the frame's buffer with
``torch.frombuffer``: the decoded tensor's storage *is* the frame. Treat decoded tensors
as read-only views (a ``bytes`` frame is immutable; writing into a zmq frame changes the
received message): ``clone()`` before writing in place.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from omnirl.protocol.errors import (
    BadFrame,
    EncodeError,
    FrameSizeMismatch,
    NonFiniteValue,
    TorchUnavailable,
    UnsupportedDtype,
)
from omnirl.protocol.tensor_type import Tensor, TensorRef

if TYPE_CHECKING:
    import torch

MAX_NDIM = 32
"""Most dimensions a wire tensor may have."""
MAX_ELEMENTS = 1 << 62
"""Bound on the product of a wire shape's non-zero dimensions (strides stay in int64)."""


@dataclass(frozen=True, slots=True)
class WireDtype:
    """One wire dtype: its name in a :class:`TensorRef`, element size, and byte layout."""

    name: str  # also the torch attribute: getattr(torch, name)
    itemsize: int
    layout: str  # for people and for docs/protocol.md
    floating: bool = False


WIRE_DTYPES: MappingProxyType[str, WireDtype] = MappingProxyType(
    {
        d.name: d
        for d in (
            WireDtype("float32", 4, "IEEE 754 binary32", floating=True),
            WireDtype("float16", 2, "IEEE 754 binary16", floating=True),
            WireDtype("bfloat16", 2, "the upper 16 bits of an IEEE 754 binary32", floating=True),
            WireDtype("float64", 8, "IEEE 754 binary64", floating=True),
            WireDtype("uint8", 1, "unsigned 8-bit integer"),
            WireDtype("int8", 1, "two's complement 8-bit integer"),
            WireDtype("int16", 2, "two's complement 16-bit integer"),
            WireDtype("int32", 4, "two's complement 32-bit integer"),
            WireDtype("int64", 8, "two's complement 64-bit integer"),
            WireDtype("bool", 1, "one byte, 0 (false) or 1 (true)"),
        )
    }
)
"""Every dtype a tensor may have on the wire, by wire name. All multi-byte types are
little-endian."""

_READONLY_WARNING = "The given buffer is not writable"


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is installed in this workspace
        raise TorchUnavailable(
            "this message carries tensors, which needs torch: install omnirl-protocol[torch]"
        ) from exc
    return torch


def is_tensor(value: object) -> bool:
    """True for a ``torch.Tensor``; never imports torch (unloaded torch: no tensors exist)."""
    import sys

    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def wire_name(dtype: torch.dtype) -> str | None:
    """The wire name of a torch dtype, or None when it has none (complex, uint16, ...)."""
    name = str(dtype).removeprefix("torch.")
    return name if name in WIRE_DTYPES else None


def tensor_to_frame(
    tensor: torch.Tensor, frame: int, *, field: str
) -> tuple[TensorRef, memoryview]:
    """``(TensorRef, bytes)`` of a CPU tensor; the memoryview aliases the tensor's memory.

    A non-contiguous tensor is copied once into a contiguous one (the view keeps that copy
    alive). A tensor on another device is refused: moving it is a copy the caller should
    see, so call ``tensor.cpu()`` first.
    """
    torch = _torch()
    if not isinstance(tensor, torch.Tensor):
        raise EncodeError(f"field {field!r}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise EncodeError(
            f"field {field!r}: tensor is on {tensor.device}; move it to the CPU "
            "(tensor.cpu()) before encoding"
        )
    if tensor.layout != torch.strided:
        raise EncodeError(f"field {field!r}: {tensor.layout} tensors are not supported; densify it")
    name = wire_name(tensor.dtype)
    if name is None:
        raise UnsupportedDtype(tensor.dtype, field=field, known=tuple(WIRE_DTYPES))
    if tensor.dim() > MAX_NDIM:
        raise EncodeError(f"field {field!r}: {tensor.dim()} dimensions, at most {MAX_NDIM}")
    t = tensor.detach().resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    # view(uint8) needs at least one dimension; reshape(-1) of a contiguous tensor is a view.
    flat = t.reshape(-1).view(torch.uint8).numpy()
    return TensorRef(frame, name, tuple(t.shape)), memoryview(flat)


def tensor_ref_hook(type_: type, obj: Any) -> Any:
    """msgspec decode hook: a ``Tensor`` field's ``[frame, dtype, shape]`` -> TensorRef.

    TypeError / ValueError raised here come back from msgspec as a ValidationError naming
    the field's path; the codec turns that into MalformedHeader. Bounds on the shape keep
    the work a header can ask for (and torch's int64 strides) finite.
    """
    if type_ is not Tensor:
        raise TypeError(f"no decoder for {type_!r}")
    if not (isinstance(obj, list) and len(obj) == 3):
        raise ValueError("a tensor reference must be [frame, dtype, shape]")
    frame, dtype, shape = obj
    if type(frame) is not int:
        raise ValueError("a tensor reference's frame must be an integer")
    if not isinstance(dtype, str):
        raise ValueError("a tensor reference's dtype must be a string")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise ValueError(f"a tensor shape must be a list of at most {MAX_NDIM} integers")
    elements = 1
    for dim in shape:
        if type(dim) is not int or dim < 0:
            raise ValueError("a tensor shape must hold non-negative integers")
        elements *= max(dim, 1)
        if elements > MAX_ELEMENTS:
            raise ValueError(f"a tensor shape {shape} is too large")
    return TensorRef(frame, dtype, tuple(shape))


def tensor_from_frame(ref: TensorRef, buffer: memoryview, *, field: str) -> torch.Tensor:
    """The tensor ``ref`` describes, built over ``buffer`` (a flat byte view) without a copy.

    Raises :class:`UnsupportedDtype`, :class:`FrameSizeMismatch`, or :class:`BadFrame` (a
    bool frame holding bytes other than 0 and 1).
    """
    wire = WIRE_DTYPES.get(ref.dtype)
    if wire is None:
        raise UnsupportedDtype(ref.dtype, field=field, known=tuple(WIRE_DTYPES))
    expected = math.prod(ref.shape) * wire.itemsize
    if buffer.nbytes != expected:
        raise FrameSizeMismatch(
            field=field,
            frame=ref.frame,
            dtype=ref.dtype,
            shape=ref.shape,
            expected=expected,
            actual=buffer.nbytes,
        )
    torch = _torch()
    dtype = getattr(torch, wire.name)
    if expected == 0:  # frombuffer refuses empty buffers; nothing to alias anyway
        return torch.empty(ref.shape, dtype=dtype)
    if buffer.readonly:
        # torch warns (once per process) that it cannot mark the tensor read-only; the
        # module docstring documents that decoded tensors are read-only views.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_READONLY_WARNING, category=UserWarning)
            flat = torch.frombuffer(buffer, dtype=dtype)
    else:
        flat = torch.frombuffer(buffer, dtype=dtype)
    if wire.name == "bool" and _max_byte(buffer) > 1:
        raise BadFrame(f"field {field!r}: bool frame {ref.frame} holds bytes other than 0 and 1")
    return flat.view(ref.shape)


def _max_byte(buffer: memoryview) -> int:
    import numpy as np

    return int(np.frombuffer(buffer, dtype=np.uint8).max())


def check_tensor_finite(tensor: torch.Tensor, *, field: str) -> None:
    """Raise :class:`NonFiniteValue` if a floating tensor holds NaN or inf."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return
    bad = count_non_finite(tensor)
    if bad:
        raise NonFiniteValue(field, f"{bad} of {tensor.numel()} elements are NaN or inf")


def count_non_finite(tensor: torch.Tensor) -> int:
    """Number of NaN / inf elements of a floating tensor.

    Runs in numpy, single-threaded and memory-bound (~1 ms per 5 MB), so that a receiving
    thread does not compete for torch's intra-op pool. A sum is non-finite whenever any
    element is (NaN and inf propagate), so only a non-finite sum (or a sum that overflows
    from large finite values) pays for the exact elementwise count. bfloat16, which numpy
    lacks, is checked on its bits: all-ones exponent.
    """
    import numpy as np

    torch = _torch()
    t = tensor.detach()
    if t.device.type != "cpu":
        return int((~torch.isfinite(t)).sum())
    if t.dtype == torch.bfloat16:
        bits = t.view(torch.int16).numpy()
        return int(np.count_nonzero((bits & 0x7F80) == 0x7F80))
    values = t.numpy()
    with np.errstate(over="ignore", invalid="ignore"):
        total = values.sum(dtype=np.float64 if values.dtype == np.float64 else np.float32)
    if np.isfinite(total):
        return 0
    return int(values.size - np.count_nonzero(np.isfinite(values)))


def check_number_finite(value: object, *, field: str) -> None:
    """Raise :class:`NonFiniteValue` for a NaN / inf float, recursing into lists and dicts."""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise NonFiniteValue(field, f"value {value!r}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_number_finite(item, field=f"{field}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            check_number_finite(item, field=f"{field}[{key!r}]")
    elif is_tensor(value):
        check_tensor_finite(value, field=field)
