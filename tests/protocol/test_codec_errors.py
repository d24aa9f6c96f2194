"""Every way a message can be bad gives its own typed error with a clear message."""

from __future__ import annotations

import pickle
import re

import msgspec
import numpy as np
import pytest
import torch
from test_codec_samples import diffusion_group, sample_messages, token_group, weight_update

from omnirl.protocol import decode, decode_header, encode, encoded_size
from omnirl.protocol import messages as m
from omnirl.protocol.errors import (
    BadFrame,
    EncodeError,
    FrameCountMismatch,
    FrameSizeMismatch,
    MalformedHeader,
    MessageTooLarge,
    NonFiniteValue,
    ProtocolError,
    TruncatedHeader,
    UnknownKind,
    UnsupportedDtype,
    VersionMismatch,
)
from omnirl.protocol.version import PROTOCOL_VERSION, format_version


def header_dict(msg) -> dict:
    return msgspec.msgpack.decode(encode(msg)[0])


def frames_with_header(header: dict, tensor_frames: list) -> list:
    return [msgspec.msgpack.encode(header), *tensor_frames]


# ---------------------------------------------------------------------------- header


@pytest.mark.parametrize("cut", [1, 5, 40, -1])
def test_truncated_header(cut):
    header = encode(diffusion_group())[0]
    with pytest.raises(TruncatedHeader, match="ends mid-value"):
        decode([header[:cut]])


def test_empty_header_and_no_frames():
    with pytest.raises(TruncatedHeader, match="empty"):
        decode([b""])
    with pytest.raises(TruncatedHeader, match="no frames"):
        decode([])


@pytest.mark.parametrize(
    "garbage",
    [b"\xc1", b"\xff\xff\xff", b"hello world", msgspec.msgpack.encode([1, 2, 3])],
    ids=["reserved-byte", "fixints", "text", "array"],
)
def test_garbage_header(garbage):
    with pytest.raises(MalformedHeader):
        decode([garbage])


def test_header_without_version_or_kind():
    with pytest.raises(MalformedHeader, match="`v`"):
        decode([msgspec.msgpack.encode({"kind": "heartbeat", "worker_id": "w", "role": "rollout"})])
    with pytest.raises(MalformedHeader, match="`kind`"):
        decode([msgspec.msgpack.encode({"v": [1, 0]})])


def test_wrong_field_type_names_the_field():
    header = header_dict(m.Heartbeat(worker_id="w", role="rollout"))
    header["policy_version"] = "four"
    with pytest.raises(MalformedHeader, match=r"heartbeat header: Expected `int`.*policy_version"):
        decode([msgspec.msgpack.encode(header)])


def test_bad_tensor_reference_names_the_field():
    group = token_group()
    frames = encode(group)
    header = msgspec.msgpack.decode(frames[0])
    header["log_probs"] = [4, "float32"]
    with pytest.raises(MalformedHeader, match=r"\[frame, dtype, shape\].*log_probs"):
        decode(frames_with_header(header, frames[1:]))
    header["log_probs"] = [4, "float32", [2, -6]]
    with pytest.raises(MalformedHeader, match="non-negative"):
        decode(frames_with_header(header, frames[1:]))


def test_unknown_kind_lists_the_known_ones():
    header = header_dict(m.Ack(ref="x"))
    header["kind"] = "telepathy"
    with pytest.raises(UnknownKind, match=r"'telepathy'; known kinds: hello, welcome"):
        decode([msgspec.msgpack.encode(header)])


def test_other_major_version_names_both():
    header = header_dict(m.Ack(ref="x"))
    header["v"] = [2, 0]
    local = re.escape(format_version(PROTOCOL_VERSION))
    with pytest.raises(
        VersionMismatch, match=rf"peer speaks protocol 2\.0, this process speaks {local}$"
    ):
        decode([msgspec.msgpack.encode(header)])
    # Checked before the schema: a major-2 message may look like nothing we know.
    with pytest.raises(VersionMismatch):
        decode([msgspec.msgpack.encode({"kind": "hologram", "v": [3, 1], "x": 1})])
    assert decode_header(msgspec.msgpack.encode(header)).v == (2, 0)


# ---------------------------------------------------------------------------- frames


def test_missing_frame():
    frames = encode(token_group())
    with pytest.raises(FrameCountMismatch, match=r"field 'log_probs' references frame 4.*3 tensor"):
        decode(frames[:-1])


def test_extra_frame():
    frames = encode(token_group())
    with pytest.raises(FrameCountMismatch, match=r"5 tensor frames came.*references 4.*\[5\]"):
        decode([*frames, b"\x00" * 8])


def test_frame_referenced_twice():
    frames = encode(token_group())
    header = msgspec.msgpack.decode(frames[0])
    header["log_probs"][0] = 3  # the response_mask frame
    with pytest.raises(FrameCountMismatch, match="frame 3 is referenced twice"):
        decode(frames_with_header(header, frames[1:]))


@pytest.mark.parametrize("delta", [-1, 4, -48])
def test_frame_length_mismatch_names_field_dtype_shape_bytes(delta):
    frames = encode(token_group())
    log_probs = bytes(frames[4])
    bad = log_probs[:delta] if delta < 0 else log_probs + b"\x00" * delta
    with pytest.raises(FrameSizeMismatch) as info:
        decode([*frames[:4], bad])
    err = info.value
    assert (err.field, err.dtype, err.shape, err.expected, err.actual) == (
        "log_probs",
        "float32",
        (2, 6),
        48,
        48 + delta,
    )
    assert str(err) == (
        f"field 'log_probs': frame 4 holds {48 + delta} bytes, but dtype float32 with "
        "shape [2, 6] needs 48 bytes"
    )


def test_frame_length_mismatch_inside_a_list_field():
    frames = encode(weight_update())
    with pytest.raises(FrameSizeMismatch, match=r"field 'tensors\[1\]'"):
        decode([frames[0], frames[1], bytes(frames[2])[:-2]])


def test_unknown_wire_dtype():
    frames = encode(token_group())
    header = msgspec.msgpack.decode(frames[0])
    header["log_probs"][1] = "float8_e4m3"
    with pytest.raises(UnsupportedDtype, match=r"'log_probs': dtype float8_e4m3.*bfloat16"):
        decode(frames_with_header(header, frames[1:]))


def test_bool_frame_with_other_bytes():
    frames = encode(token_group())
    mask = bytearray(frames[3])
    mask[0] = 7
    with pytest.raises(BadFrame, match="'response_mask': bool frame 3"):
        decode([*frames[:3], mask, frames[4]])


@pytest.mark.parametrize("frames", [b"abc", "abc", 42, [b"", 3]], ids=repr)
def test_frames_that_are_not_buffers(frames):
    with pytest.raises((BadFrame, TruncatedHeader)):
        decode(frames)
    with pytest.raises(BadFrame):
        encoded_size([encode(m.Ack(ref="x"))[0], object()])


def test_oversized_message_names_size_and_limit():
    frames = encode(diffusion_group())
    size = encoded_size(frames)
    with pytest.raises(MessageTooLarge, match=f"message of {size} bytes exceeds the limit of 1000"):
        decode(frames, max_bytes=1000)
    assert decode(frames, max_bytes=size) is not None
    assert decode(frames, max_bytes=None) is not None


# ------------------------------------------------------------------------- finiteness


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_log_probs(bad):
    group = token_group()
    group.log_probs[1, 2] = bad
    with pytest.raises(NonFiniteValue, match=r"'log_probs'.*1 of 12 elements"):
        encode(group)
    frames = encode(group, check_finite=False)
    with pytest.raises(NonFiniteValue, match="'log_probs'"):
        decode(frames)
    assert decode(frames, check_finite=False).log_probs[1, 2].isnan() == (bad != bad)


def test_non_finite_diffusion_latents_and_bf16_overflow_is_not_a_false_alarm():
    group = diffusion_group()
    group.next_latents[0, 1, 2, 3, 4] = float("nan")
    with pytest.raises(NonFiniteValue, match="'next_latents'"):
        encode(group)
    big = diffusion_group()
    big.latents.fill_(3e38)  # finite, but their sum overflows to inf
    assert torch.equal(decode(encode(big)).latents, big.latents)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_rewards(bad):
    rewards = m.Rewards(group_id="g", total=[0.0, bad])
    with pytest.raises(NonFiniteValue, match=r"'total\[1\]'"):
        encode(rewards)
    with pytest.raises(NonFiniteValue, match=r"'total\[1\]'"):
        decode(encode(rewards, check_finite=False))
    components = m.Rewards(group_id="g", total=[0.0], components={"ocr": [bad]})
    with pytest.raises(NonFiniteValue, match=r"components\['ocr'\]\[0\]"):
        decode(encode(components, check_finite=False))
    group = diffusion_group()  # rewards nested in a trajectory group are checked too
    group.rewards.total[0] = bad
    with pytest.raises(NonFiniteValue, match=r"'rewards\.total\[0\]'"):
        decode(encode(group, check_finite=False))


def test_non_finite_allowed_where_the_schema_does_not_forbid():
    beat = m.Heartbeat(worker_id="w", role="rollout", stats={"loss": float("nan")})
    assert decode(encode(beat)).stats["loss"] != 0.0


# ---------------------------------------------------------------------------- encode


def test_encode_refuses_what_it_cannot_send():
    with pytest.raises(EncodeError, match="not a message kind"):
        encode(m.PromptSpec(group_id="g", text="t"))
    update = weight_update()
    update.tensors[0] = torch.empty(4, 16, device="meta")
    with pytest.raises(EncodeError, match=r"'tensors\[0\]': tensor is on meta.*tensor\.cpu\(\)"):
        encode(update)
    update.tensors[0] = torch.zeros(2, dtype=torch.complex64)
    with pytest.raises(UnsupportedDtype, match=r"'tensors\[0\]': dtype torch\.complex64"):
        encode(update)
    update.tensors[0] = np.zeros(3)
    with pytest.raises(EncodeError, match=r"'tensors\[0\]': expected a torch\.Tensor, got ndarray"):
        encode(update)
    welcome = sample_messages()[1]
    welcome.config = {"oops": torch.zeros(2)}
    with pytest.raises(EncodeError, match="only in fields annotated Tensor"):
        encode(welcome)


def test_gradient_tensors_encode_without_a_copy():
    weight = torch.nn.Parameter(torch.randn(4, 4))
    update = m.WeightUpdate(
        version=1, format="full", chunk=0, num_chunks=1, names=["w"], tensors=[weight], checksum=""
    )
    out = decode(encode(update))
    assert torch.equal(out.tensors[0], weight.detach())


# --------------------------------------------------------------------------- errors


def test_errors_are_protocol_errors_with_refusal_codes_and_pickle():
    header = header_dict(m.Ack(ref="x"))
    header["v"] = [2, 0]
    with pytest.raises(ProtocolError) as info:
        decode([msgspec.msgpack.encode(header)])
    refusal = info.value.to_refusal(ref="ack-x")
    assert (refusal.code, refusal.ref) == ("version_mismatch", "ack-x")
    assert "peer speaks protocol 2.0" in refusal.reason
    assert decode(encode(refusal)) == refusal
    again = pickle.loads(pickle.dumps(info.value))
    assert type(again) is VersionMismatch and str(again) == str(info.value)
    assert again.peer == (2, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_finite_check_every_float_dtype(dtype):
    from omnirl.protocol.tensors import count_non_finite

    big = torch.full((64, 3), torch.finfo(dtype).max, dtype=dtype)  # finite; its sum is not
    assert count_non_finite(big) == 0
    assert count_non_finite(big.t()) == 0  # strided views too
    bad = big.clone()
    bad[3, 1], bad[7, 0], bad[9, 2] = float("nan"), float("inf"), -float("inf")
    assert count_non_finite(bad) == 3
    assert count_non_finite(bad[:, 1:].t()) == 2
    group = token_group()
    group.log_probs = bad
    with pytest.raises(NonFiniteValue, match="3 of 192 elements"):
        encode(group)
