"""Property tests: whatever arrives, the decoder raises nothing but ProtocolError.

InternalDecodeError (the decoder's safety net for its own bugs) must never be reached
either: every failure has a specific, typed reason.
"""

from __future__ import annotations

import math

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_codec_samples import sample_messages

from omnirl.protocol import decode, decode_header, encode
from omnirl.protocol.errors import InternalDecodeError, MalformedHeader, ProtocolError
from omnirl.protocol.messages import MESSAGE_TYPES, Message
from omnirl.protocol.tensors import WIRE_DTYPES

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SAMPLES = [[bytes(f) for f in encode(msg)] for msg in sample_messages()]
KINDS = [cls.__struct_config__.tag for cls in MESSAGE_TYPES]
FIELDS = {cls.__struct_config__.tag: cls.__struct_fields__ for cls in MESSAGE_TYPES}


def decodes_or_refuses(frames) -> None:
    """The decoder's contract on any input."""
    try:
        msg = decode(frames, max_bytes=1 << 20)
    except InternalDecodeError as exc:  # a decoder bug, not bad input
        raise AssertionError(f"internal decoder error: {exc}") from exc
    except ProtocolError:
        return
    assert isinstance(msg, Message)
    for value in msgspec.structs.asdict(msg).values():  # tensors are real and readable
        if isinstance(value, torch.Tensor):
            value.sum()


@SETTINGS
@given(header=st.binary(max_size=300), rest=st.lists(st.binary(max_size=64), max_size=4))
def test_random_bytes(header, rest):
    decodes_or_refuses([header, *rest])
    try:
        decode_header(header)
    except InternalDecodeError:
        raise
    except ProtocolError:
        pass


def _mutate(data, frames: list[bytearray]) -> list:
    for _ in range(data.draw(st.integers(1, 4), label="mutations")):
        op = data.draw(st.sampled_from(["flip", "cut", "insert", "drop", "dup", "swap"]))
        i = data.draw(st.integers(0, len(frames) - 1)) if frames else 0
        if op in ("flip", "cut", "insert") and frames:
            frame = frames[i]
            pos = data.draw(st.integers(0, len(frame)))
            if op == "flip" and pos < len(frame):
                frame[pos] = data.draw(st.integers(0, 255))
            elif op == "cut":
                del frame[pos:]
            elif op == "insert":
                frame[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
        elif op == "drop" and frames:
            del frames[i]
        elif op == "dup" and frames:
            frames.insert(i, bytearray(frames[i]))
        elif op == "swap" and len(frames) > 1:
            j = data.draw(st.integers(0, len(frames) - 1))
            frames[i], frames[j] = frames[j], frames[i]
    return frames


@SETTINGS
@given(data=st.data())
def test_mutated_valid_encodings(data):
    frames = [bytearray(f) for f in data.draw(st.sampled_from(SAMPLES), label="message")]
    decodes_or_refuses(_mutate(data, frames))


_INT = st.integers(-(2**63), 2**64 - 1)
_LEAF = st.none() | st.booleans() | _INT | st.floats() | st.text(max_size=12)
_VALUE = st.recursive(
    _LEAF,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_TENSOR_REF = st.tuples(
    st.integers(-2, 6),
    st.sampled_from([*WIRE_DTYPES, "float8", ""]),
    st.lists(st.integers(0, 9) | _INT, max_size=4),
).map(list)


@st.composite
def _headers(draw):
    """Plausible headers: a real kind and version, its field names with random values."""
    kind = draw(st.sampled_from([*KINDS, "nope"]))
    header = {"kind": kind, "v": draw(st.sampled_from([[1, 0], [1, 3], [2, 0], [1], "1.0"]))}
    for name in draw(st.lists(st.sampled_from(FIELDS.get(kind, ("x",))), max_size=8)):
        header[name] = draw(_TENSOR_REF | _VALUE | st.lists(_TENSOR_REF, max_size=2))
    return header


@SETTINGS
@given(header=_headers(), rest=st.lists(st.binary(max_size=96), max_size=5))
def test_structured_headers(header, rest):
    decodes_or_refuses([msgspec.msgpack.encode(header), *rest])


@SETTINGS
@given(data=st.data())
def test_valid_headers_with_random_field_values(data):
    """Start from a real header and replace one field's value: deep schema paths."""
    frames = data.draw(st.sampled_from(SAMPLES), label="message")
    header = msgspec.msgpack.decode(frames[0])
    name = data.draw(st.sampled_from(sorted(header)), label="field")
    header[name] = data.draw(_TENSOR_REF | _VALUE, label="value")
    decodes_or_refuses([msgspec.msgpack.encode(header), *frames[1:]])


def _ref_paths(value, path=()):
    """Paths of the ``[frame, dtype, shape]`` lists in a raw header."""
    if isinstance(value, list) and len(value) == 3 and isinstance(value[1], str):
        yield path
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _ref_paths(item, (*path, i))
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _ref_paths(item, (*path, key))


WITH_TENSORS = [frames for frames in SAMPLES if len(frames) > 1]


@SETTINGS
@given(data=st.data())
def test_mutated_tensor_references(data):
    """Rewrite tensor references (frame, dtype, shape) and frame lengths of real messages."""
    frames = list(data.draw(st.sampled_from(WITH_TENSORS), label="message"))
    header = msgspec.msgpack.decode(frames[0])
    paths = [p for p in _ref_paths(header) if p[0] != "v"]
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(paths), label="ref")
        parent = header
        for key in path[:-1]:
            parent = parent[key]
        ref = list(parent[path[-1]])
        slot = data.draw(st.integers(0, 2))
        ref[slot] = data.draw(
            [st.integers(-1, len(frames) + 1), st.sampled_from([*WIRE_DTYPES, "f4"]),
             st.lists(st.integers(0, 6), max_size=4)][slot]
        )  # fmt: skip
        parent[path[-1]] = ref
        frame, dtype, shape = ref
        fits = 0 < frame < len(frames) and dtype in WIRE_DTYPES
        if fits and data.draw(st.booleans(), label="resize frame to fit"):
            size = math.prod(shape) * WIRE_DTYPES[dtype].itemsize
            frames[frame] = data.draw(st.binary(min_size=size, max_size=size))
    if data.draw(st.booleans()):
        i = data.draw(st.integers(1, len(frames) - 1))
        frames[i] = data.draw(st.binary(max_size=96))
    decodes_or_refuses([msgspec.msgpack.encode(header), *frames[1:]])


def test_deeply_nested_header_is_refused():
    header = msgspec.msgpack.decode(SAMPLES[1][0])  # a Welcome: config is dict[str, Any]
    header["config"] = {"deep": "x"}
    raw = msgspec.msgpack.encode(header)
    deep = b"\x91" * 5_000 + b"\xc0"  # 5k nested one-element arrays around nil
    raw = raw.replace(msgspec.msgpack.encode("x"), deep)
    with pytest.raises(MalformedHeader, match="nests values too deeply"):
        decode([raw])
