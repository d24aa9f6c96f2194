"""Typed protocol errors.

Every failure of :func:`omnirl.protocol.codec.decode` is a :class:`ProtocolError`
subclass, so a long-running process can catch that one class, log the reason, count it
and answer with a :class:`~omnirl.protocol.messages.Refusal` (``code`` below) without
losing anything else. Each message names the problem precisely enough to fix the sender.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from omnirl.protocol.version import format_version

if TYPE_CHECKING:
    from omnirl.protocol.messages import Refusal


class ProtocolError(Exception):
    """Base of every protocol error; ``code`` is the machine-readable refusal code."""

    code: ClassVar[str] = "protocol_error"

    def to_refusal(self, ref: str = "") -> Refusal:
        """A :class:`Refusal` that tells the peer what was wrong with its message."""
        from omnirl.protocol.messages import Refusal

        return Refusal(code=self.code, reason=str(self), ref=ref)

    def __reduce__(self) -> tuple[Any, ...]:
        # Subclasses take structured keyword arguments; pickle the finished message and
        # attributes instead, so errors cross process boundaries (multiprocessing, logs).
        return (_restore, (type(self), self.args, self.__dict__))


def _restore(cls: type[ProtocolError], args: tuple[Any, ...], state: dict[str, Any]):
    err = cls.__new__(cls)
    Exception.__init__(err, *args)
    err.__dict__.update(state)
    return err


class TruncatedHeader(ProtocolError):
    """Frame 0 is missing, empty, or ends in the middle of a msgpack value."""

    code = "truncated_header"


class MalformedHeader(ProtocolError):
    """Frame 0 is not a valid header (bad msgpack, wrong field types, bad TensorRef)."""

    code = "malformed_header"


class UnknownKind(ProtocolError):
    """The header's ``kind`` names no message kind this process knows."""

    code = "unknown_kind"

    def __init__(self, kind: object, known: tuple[str, ...]):
        self.kind = kind
        self.known = known
        super().__init__(f"unknown message kind {kind!r}; known kinds: {', '.join(known)}")


class BadFrame(ProtocolError):
    """A frame is not a byte buffer, or holds bytes its dtype forbids."""

    code = "bad_frame"


class FrameCountMismatch(ProtocolError):
    """The header's tensor references and the frames that came do not match one to one."""

    code = "frame_count_mismatch"


class FrameSizeMismatch(ProtocolError):
    """A tensor frame's byte length is not ``numel(shape) * itemsize(dtype)``."""

    code = "frame_size_mismatch"

    def __init__(
        self,
        *,
        field: str,
        frame: int,
        dtype: str,
        shape: tuple[int, ...],
        expected: int,
        actual: int,
    ):
        self.field = field
        self.frame = frame
        self.dtype = dtype
        self.shape = tuple(shape)
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"field {field!r}: frame {frame} holds {actual} bytes, but dtype {dtype} with "
            f"shape {list(self.shape)} needs {expected} bytes"
        )


class UnsupportedDtype(ProtocolError):
    """A tensor's dtype has no wire name (encode) or a wire name is unknown (decode)."""

    code = "unsupported_dtype"

    def __init__(self, dtype: object, *, field: str, known: tuple[str, ...]):
        self.dtype = dtype
        self.field = field
        self.known = known
        super().__init__(
            f"field {field!r}: dtype {dtype!s} is not supported on the wire; "
            f"supported: {', '.join(known)}"
        )


class MessageTooLarge(ProtocolError):
    """The message's frames together exceed the receiver's byte limit."""

    code = "message_too_large"

    def __init__(self, size: int, limit: int):
        self.size = size
        self.limit = limit
        super().__init__(f"message of {size} bytes exceeds the limit of {limit} bytes")


class NonFiniteValue(ProtocolError):
    """A field the schema declares finite (``finite_fields``) holds NaN or inf."""

    code = "non_finite"

    def __init__(self, field: str, detail: str = ""):
        self.field = field
        self.detail = detail
        suffix = f": {detail}" if detail else ""
        super().__init__(f"field {field!r} must be finite but holds NaN or inf{suffix}")


class VersionMismatch(ProtocolError):
    """The peer speaks another protocol major version."""

    code = "version_mismatch"

    def __init__(self, peer: tuple[int, int], local: tuple[int, int]):
        self.peer = tuple(peer)
        self.local = tuple(local)
        super().__init__(
            f"peer speaks protocol {format_version(self.peer)}, "
            f"this process speaks {format_version(self.local)}"
        )


class EncodeError(ProtocolError):
    """A message cannot be encoded (not a known kind, a tensor where none may be, ...)."""

    code = "encode_error"


class TorchUnavailable(ProtocolError):
    """A tensor was to be built or sent but torch is not installed."""

    code = "torch_unavailable"


class InternalDecodeError(ProtocolError):
    """A decoder bug: an unexpected exception, re-raised typed so no process dies of it.

    The property tests assert this is never raised; seeing it in a log is a bug report.
    """

    code = "internal_error"


__all__ = [
    "BadFrame",
    "EncodeError",
    "FrameCountMismatch",
    "FrameSizeMismatch",
    "InternalDecodeError",
    "MalformedHeader",
    "MessageTooLarge",
    "NonFiniteValue",
    "ProtocolError",
    "TorchUnavailable",
    "TruncatedHeader",
    "UnknownKind",
    "UnsupportedDtype",
    "VersionMismatch",
]
