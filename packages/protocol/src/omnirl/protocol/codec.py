"""Messages <-> ZeroMQ multipart frames.

Frame 0 is the msgpack header: the message as a map with the ``kind`` tag and the protocol
version ``v``, every tensor replaced by a :class:`TensorRef` ``[frame, dtype, shape]``.
Frames 1..n are the tensors' raw bytes, numbered in field order. Tensor bytes never enter
the header; ``encode`` hands out views of the tensors' memory and ``decode`` builds
tensors over the received frames, so neither copies (see :mod:`omnirl.protocol.tensors`).

``decode`` raises only :class:`~omnirl.protocol.errors.ProtocolError` subclasses: a process
catches that one class, refuses the message (``err.to_refusal()``) and carries on.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Union

import msgspec
import msgspec.inspect as mi

from omnirl.protocol.errors import (
    BadFrame,
    EncodeError,
    FrameCountMismatch,
    InternalDecodeError,
    MalformedHeader,
    MessageTooLarge,
    ProtocolError,
    TruncatedHeader,
    UnknownKind,
    VersionMismatch,
)
from omnirl.protocol.messages import MESSAGE_TYPES, Message
from omnirl.protocol.tensor_type import Tensor, TensorRef
from omnirl.protocol.tensors import (
    check_number_finite,
    tensor_from_frame,
    tensor_ref_hook,
    tensor_to_frame,
)
from omnirl.protocol.version import PROTOCOL_VERSION

DEFAULT_MAX_BYTES = 1 << 30
"""Default limit on a message's total size (all frames), 1 GiB."""

Frame = Any  # zmq.Frame | bytes | bytearray | memoryview | any C-contiguous buffer


class Header(msgspec.Struct, frozen=True):
    """What :func:`decode_header` peeks from frame 0 without decoding the message."""

    kind: str
    v: tuple[Annotated[int, msgspec.Meta(ge=0)], Annotated[int, msgspec.Meta(ge=0)]]


_HEADER_DECODER = msgspec.msgpack.Decoder(Header)


@dataclass(frozen=True, slots=True)
class _Plan:
    """Which fields of one struct class the codec must visit."""

    tensor_fields: tuple[str, ...]  # may hold tensors (directly or in containers / structs)
    finite_fields: tuple[str, ...]  # the class's own ``finite_fields``
    nested_fields: tuple[str, ...]  # may hold structs that have finite fields of their own


class Codec:
    """Encoder / decoder for one set of message kinds at one protocol version.

    The module functions use :func:`default_codec` (every kind in ``messages.py``); tests
    build codecs for other schema versions.
    """

    def __init__(
        self,
        types: Iterable[type[Message]] = MESSAGE_TYPES,
        *,
        version: tuple[int, int] = PROTOCOL_VERSION,
    ):
        types = tuple(types)
        self.version = (int(version[0]), int(version[1]))
        self._kind_of: dict[type, str] = {cls: cls.__struct_config__.tag for cls in types}
        self._type_of: dict[str, type] = {kind: cls for cls, kind in self._kind_of.items()}
        self._plans = _build_plans(types)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Union[types], dec_hook=tensor_ref_hook)  # noqa: UP007

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(self._type_of)

    # --------------------------------------------------------------------------- encode

    def encode(self, msg: Message, *, check_finite: bool = True) -> list[bytes | memoryview]:
        """``[header, tensor frame 1, ..., tensor frame n]``; tensor frames alias the tensors.

        Keep the tensors unmodified until the send has completed (pyzmq sends zero-copy).
        """
        kind = self._kind_of.get(type(msg))
        if kind is None:
            raise EncodeError(
                f"cannot encode a {type(msg).__name__}: not a message kind of this codec "
                f"(kinds: {', '.join(self.kinds)})"
            )
        if check_finite:
            self._check_struct(msg, "")
        buffers: list[memoryview] = []
        wire = self._swap_struct(msg, "", buffers)
        try:
            header = self._encoder.encode(wire)
        except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as exc:
            hint = (
                "; tensors may appear only in fields annotated Tensor"
                if "Tensor" in str(exc)
                else ""
            )
            raise EncodeError(f"cannot encode {kind} header: {exc}{hint}") from exc
        return [header, *buffers]

    def _swap_struct(self, obj: Any, path: str, buffers: list[memoryview]) -> Any:
        plan = self._plans.get(type(obj))
        if plan is None or not plan.tensor_fields:
            return obj
        changes = {}
        for name in plan.tensor_fields:
            value = getattr(obj, name)
            if value is not None:
                changes[name] = self._swap(value, _join(path, name), buffers)
        return msgspec.structs.replace(obj, **changes) if changes else obj

    def _swap(self, value: Any, path: str, buffers: list[memoryview]) -> Any:
        if value is None:
            return None
        if isinstance(value, msgspec.Struct):
            return self._swap_struct(value, path, buffers)
        if isinstance(value, (list, tuple)):
            return [self._swap(item, f"{path}[{i}]", buffers) for i, item in enumerate(value)]
        if isinstance(value, dict):
            return {k: self._swap(item, f"{path}[{k!r}]", buffers) for k, item in value.items()}
        ref, view = tensor_to_frame(value, len(buffers) + 1, field=path)
        buffers.append(view)
        return ref

    # --------------------------------------------------------------------------- decode

    def decode_header(self, frame0: Frame) -> Header:
        """Peek ``kind`` and ``v`` from frame 0 (no version check, no tensors)."""
        try:
            return _decode_header(_frame_view(frame0, 0))
        except ProtocolError:
            raise
        except Exception as exc:
            raise InternalDecodeError(f"unexpected {type(exc).__name__} in header: {exc}") from exc

    def decode(
        self,
        frames: Sequence[Frame],
        *,
        max_bytes: int | None = DEFAULT_MAX_BYTES,
        check_finite: bool = True,
    ) -> Message:
        """The message in ``frames`` (zmq.Frame, bytes, memoryview, bytearray, ...).

        Tensors are built over the frames without a copy and share their lifetime. Frames
        that no known field references are an error, except from a newer minor version
        (they belong to fields this process does not know). Raises only ProtocolError.
        """
        try:
            return self._decode(frames, max_bytes, check_finite)
        except ProtocolError:
            raise
        except RecursionError:
            raise MalformedHeader("header nests values too deeply to decode") from None
        except Exception as exc:
            raise InternalDecodeError(f"unexpected {type(exc).__name__}: {exc}") from exc

    def _decode(
        self, frames: Sequence[Frame], max_bytes: int | None, check_finite: bool
    ) -> Message:
        views = _frame_views(frames)
        size = sum(view.nbytes for view in views)
        if max_bytes is not None and size > max_bytes:
            raise MessageTooLarge(size, max_bytes)
        header = _decode_header(views[0])
        if header.v[0] != self.version[0]:
            raise VersionMismatch(header.v, self.version)
        if header.kind not in self._type_of:
            raise UnknownKind(header.kind, self.kinds)
        try:
            msg = self._decoder.decode(views[0])
        except msgspec.ValidationError as exc:
            raise MalformedHeader(f"{header.kind} header: {exc}") from None
        except msgspec.DecodeError as exc:
            raise MalformedHeader(f"{header.kind} header is not valid msgpack: {exc}") from None
        owners: dict[int, str] = {}
        self._fill_struct(msg, "", views, owners)
        unused = len(views) - 1 - len(owners)
        if unused and header.v[1] <= self.version[1]:
            missing = [i for i in range(1, len(views)) if i not in owners][:8]
            raise FrameCountMismatch(
                f"{header.kind}: {len(views) - 1} tensor frames came but the header references "
                f"{len(owners)}; unreferenced frames: {missing}"
            )
        if check_finite:
            self._check_struct(msg, "")
        return msg

    def _fill_struct(self, obj: Any, path: str, views: list[memoryview], owners: dict) -> None:
        plan = self._plans.get(type(obj))
        if plan is None:
            return
        for name in plan.tensor_fields:
            value = getattr(obj, name)
            filled = self._fill(value, _join(path, name), views, owners)
            if filled is not value:
                setattr(obj, name, filled)

    def _fill(self, value: Any, path: str, views: list[memoryview], owners: dict) -> Any:
        if isinstance(value, TensorRef):
            if not 1 <= value.frame < len(views):
                raise FrameCountMismatch(
                    f"field {path!r} references frame {value.frame}, but the message has "
                    f"{len(views) - 1} tensor frames (1..{len(views) - 1})"
                )
            if value.frame in owners:
                raise FrameCountMismatch(
                    f"frame {value.frame} is referenced twice: by {owners[value.frame]!r} "
                    f"and {path!r}"
                )
            owners[value.frame] = path
            return tensor_from_frame(value, views[value.frame], field=path)
        if isinstance(value, list):
            for i, item in enumerate(value):
                value[i] = self._fill(item, f"{path}[{i}]", views, owners)
        elif isinstance(value, tuple):
            return tuple(self._fill(x, f"{path}[{i}]", views, owners) for i, x in enumerate(value))
        elif isinstance(value, dict):
            for key, item in value.items():
                value[key] = self._fill(item, f"{path}[{key!r}]", views, owners)
        elif isinstance(value, msgspec.Struct):
            self._fill_struct(value, path, views, owners)
        return value

    # ----------------------------------------------------------------------- finiteness

    def _check_struct(self, obj: Any, path: str) -> None:
        plan = self._plans.get(type(obj))
        if plan is None:
            return
        for name in plan.finite_fields:
            check_number_finite(getattr(obj, name), field=_join(path, name))
        for name in plan.nested_fields:
            self._check_nested(getattr(obj, name), _join(path, name))

    def _check_nested(self, value: Any, path: str) -> None:
        if isinstance(value, msgspec.Struct):
            self._check_struct(value, path)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                self._check_nested(item, f"{path}[{i}]")
        elif isinstance(value, dict):
            for key, item in value.items():
                self._check_nested(item, f"{path}[{key!r}]")


# ------------------------------------------------------------------------------ helpers


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _frame_views(frames: Sequence[Frame]) -> list[memoryview]:
    if isinstance(frames, (bytes, bytearray, memoryview, str)) or not isinstance(frames, Sequence):
        raise BadFrame(f"frames must be a sequence of buffers, got {type(frames).__name__}")
    if len(frames) == 0:
        raise TruncatedHeader("no frames: a message has at least its header frame")
    return [_frame_view(frame, i) for i, frame in enumerate(frames)]


def _frame_view(frame: Frame, index: int) -> memoryview:
    """A flat byte view of one frame, without copying (zmq.Frame: its ``buffer``)."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        frame = getattr(frame, "buffer", frame)
    try:
        view = memoryview(frame)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
    except (TypeError, ValueError, BufferError) as exc:
        raise BadFrame(
            f"frame {index} is not a contiguous byte buffer ({type(frame).__name__}): {exc}"
        ) from None
    return view


def _decode_header(view: memoryview) -> Header:
    if view.nbytes == 0:
        raise TruncatedHeader("frame 0 (the header) is empty")
    try:
        return _HEADER_DECODER.decode(view)
    except msgspec.ValidationError as exc:  # a subclass of DecodeError: catch it first
        raise MalformedHeader(
            f"header is not a message (a map with 'kind' and 'v' [major, minor]): {exc}"
        ) from None
    except msgspec.DecodeError as exc:
        if "truncated" in str(exc):
            raise TruncatedHeader(f"header of {view.nbytes} bytes ends mid-value: {exc}") from None
        raise MalformedHeader(f"header is not valid msgpack: {exc}") from None


def _build_plans(types: tuple[type, ...]) -> dict[type, _Plan]:
    """Per struct class reachable from ``types``: the fields to visit for tensors / checks."""
    infos = {}

    def collect(t: mi.Type) -> None:
        if isinstance(t, mi.StructType):
            if t.cls in infos:
                return
            infos[t.cls] = t
            for f in t.fields:
                collect(f.type)
        for child in _children(t):
            collect(child)

    for info in mi.multi_type_info(types):
        collect(info)

    def reaches(t: mi.Type, leaf: Any, seen: frozenset = frozenset()) -> bool:
        if leaf(t):
            return True
        if isinstance(t, mi.StructType):
            if t.cls in seen:
                return False
            return any(reaches(f.type, leaf, seen | {t.cls}) for f in t.fields)
        return any(reaches(child, leaf, seen) for child in _children(t))

    def is_tensor(t: mi.Type) -> bool:
        return isinstance(t, mi.CustomType) and t.cls is Tensor

    def has_finite(t: mi.Type) -> bool:
        return isinstance(t, mi.StructType) and bool(getattr(t.cls, "finite_fields", ()))

    plans = {}
    for cls, info in infos.items():
        finite = tuple(getattr(cls, "finite_fields", ()))
        names = {f.name for f in info.fields}
        unknown = [name for name in finite if name not in names]
        if unknown:
            raise TypeError(f"{cls.__name__}.finite_fields names unknown fields {unknown}")
        plans[cls] = _Plan(
            tensor_fields=tuple(f.name for f in info.fields if reaches(f.type, is_tensor)),
            finite_fields=finite,
            nested_fields=tuple(f.name for f in info.fields if reaches(f.type, has_finite)),
        )
    return plans


def _children(t: mi.Type) -> tuple[mi.Type, ...]:
    if isinstance(t, mi.UnionType):
        return tuple(t.types)
    if isinstance(t, (mi.ListType, mi.SetType, mi.FrozenSetType, mi.VarTupleType)):
        return (t.item_type,)
    if isinstance(t, mi.TupleType):
        return tuple(t.item_types)
    if isinstance(t, mi.DictType):
        return (t.value_type,)
    if isinstance(t, mi.Metadata):
        return (t.type,)
    return ()


# ---------------------------------------------------------------------- module functions


@functools.cache
def default_codec() -> Codec:
    """The codec for every message kind of ``messages.py`` at this protocol version."""
    return Codec()


def encode(msg: Message, *, check_finite: bool = True) -> list[bytes | memoryview]:
    """Frames of ``msg``: header, then one frame per tensor in field order (no copies)."""
    return default_codec().encode(msg, check_finite=check_finite)


def decode(
    frames: Sequence[Frame], *, max_bytes: int | None = DEFAULT_MAX_BYTES, check_finite: bool = True
) -> Message:
    """The message in ``frames``; tensors are views of the frames. Raises only ProtocolError."""
    return default_codec().decode(frames, max_bytes=max_bytes, check_finite=check_finite)


def decode_header(frame0: Frame) -> Header:
    """``kind`` and ``v`` of a message from its frame 0, without decoding the rest."""
    return default_codec().decode_header(frame0)


def encoded_size(frames: Sequence[Frame]) -> int:
    """Total bytes of a message's frames (what ``max_bytes`` limits)."""
    return sum(view.nbytes for view in _frame_views(frames))
