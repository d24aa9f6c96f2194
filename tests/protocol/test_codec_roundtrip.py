"""Round trips of every message kind and tensor layout, and proof that nothing is copied."""

from __future__ import annotations

import gc
import subprocess
import sys

import msgspec
import numpy as np
import pytest
import torch
import zmq
from test_codec_samples import diffusion_group, sample_messages, token_group, weight_update

from omnirl.protocol import decode, decode_header, encode, encoded_size
from omnirl.protocol import messages as m
from omnirl.protocol.tensors import WIRE_DTYPES
from omnirl.protocol.version import PROTOCOL_VERSION


def address(buffer) -> int:
    """Address of a buffer's first byte (bytes, memoryview, zmq.Frame.buffer)."""
    return np.frombuffer(buffer, dtype=np.uint8).ctypes.data


def assert_same(a, b, path="msg"):
    """Deep equality of decoded messages; tensors equal in dtype, shape and bits."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert (
            torch.equal(a.view(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
            if (a.numel() and a.dim())
            else torch.equal(a, b)
        ), path
    elif isinstance(a, msgspec.Struct):
        assert type(a) is type(b), path
        for name in a.__struct_fields__:
            assert_same(getattr(a, name), getattr(b, name), f"{path}.{name}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            assert_same(a[key], b[key], f"{path}[{key!r}]")
    else:
        assert a == b, path


def count_tensors(value) -> int:
    if isinstance(value, torch.Tensor):
        return 1
    if isinstance(value, msgspec.Struct):
        return sum(count_tensors(getattr(value, n)) for n in value.__struct_fields__)
    if isinstance(value, (list, tuple)):
        return sum(count_tensors(x) for x in value)
    if isinstance(value, dict):
        return sum(count_tensors(x) for x in value.values())
    return 0


@pytest.mark.parametrize("msg", sample_messages(), ids=lambda msg: type(msg).__name__)
def test_every_kind_round_trips(msg):
    frames = encode(msg)
    assert len(frames) == 1 + count_tensors(msg)
    header = decode_header(frames[0])
    assert header.kind == msg.__struct_config__.tag and header.v == PROTOCOL_VERSION
    out = decode(frames)
    assert_same(out, msg)
    assert encoded_size(frames) == sum(memoryview(f).nbytes for f in frames)


def test_header_never_holds_tensor_bytes():
    group = diffusion_group()
    frames = encode(group)
    assert len(frames[0]) < 2048  # latents alone are 3 KiB per sample
    assert bytes(memoryview(group.latents.numpy()).cast("B"))[:64] not in frames[0]


def _layout_cases() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(6, 5, generator=gen)
    cases = {}
    for name in WIRE_DTYPES:
        dtype = getattr(torch, name)
        if dtype == torch.bool:
            cases[name] = torch.rand(3, 4, generator=gen) > 0.5
        elif dtype.is_floating_point:
            cases[name] = (base * 100).to(dtype)
        else:
            info = torch.iinfo(dtype)
            cases[name] = torch.randint(info.min, info.max, (3, 4), dtype=dtype, generator=gen)
    cases |= {
        "transposed": base.t(),
        "sliced": base[1:5:2, ::2],
        "expanded": torch.arange(3.0).expand(4, 3),
        "bf16_transposed": base.to(torch.bfloat16).t(),
        "offset_view": base.view(-1)[7:19],
        "empty_0": torch.empty(0),
        "empty_3_0_2": torch.empty(3, 0, 2, dtype=torch.bfloat16),
        "scalar": torch.tensor(2.5),
        "scalar_int": torch.tensor(-7, dtype=torch.int64),
        "scalar_bool": torch.tensor(True),
    }
    return cases


@pytest.mark.parametrize("name", list(_layout_cases()))
def test_tensor_layouts_round_trip(name):
    tensor = _layout_cases()[name]
    msg = m.WeightUpdate(
        version=1, format="full", chunk=0, num_chunks=1, names=[name], tensors=[tensor], checksum=""
    )
    frames = encode(msg)
    assert len(frames) == 2
    assert memoryview(frames[1]).nbytes == tensor.numel() * tensor.element_size()
    out = decode([bytes(f) for f in frames])
    assert out.tensors[0].dtype == tensor.dtype
    assert out.tensors[0].shape == tensor.shape
    assert torch.equal(out.tensors[0], tensor)
    if tensor.is_contiguous() and tensor.numel():
        assert address(frames[1]) == tensor.data_ptr()  # encode did not copy


def test_bf16_bytes_are_the_upper_half_of_fp32():
    values = torch.tensor([1.0, -2.5, 3.140625])  # exactly representable in bf16
    msg = m.WeightUpdate(
        version=1, format="full", chunk=0, num_chunks=1, names=["x"], checksum="",
        tensors=[values.to(torch.bfloat16)],
    )  # fmt: skip
    wire = bytes(encode(msg)[1])
    fp32 = values.numpy().astype("<f4").tobytes()
    assert wire == b"".join(fp32[i + 2 : i + 4] for i in range(0, len(fp32), 4))


def test_encode_does_not_copy_contiguous_tensors():
    group = diffusion_group()
    frames = encode(group)
    fields = [
        f
        for f in m.DiffusionTrajectoryGroup.__struct_fields__
        if isinstance(getattr(group, f), torch.Tensor)
    ]
    tensors = [getattr(group, f) for f in fields] + list(group.extra.values())
    assert len(frames) == 1 + len(tensors)
    for frame, tensor in zip(frames[1:], tensors, strict=True):  # frames in field order
        assert address(frame) == tensor.data_ptr()


def test_decode_builds_tensors_over_the_frames():
    frames = [bytes(f) for f in encode(diffusion_group())]
    refs = msgspec.msgpack.decode(frames[0])  # the header as plain data: [frame, dtype, shape]
    out = decode(frames)
    assert out.seeds.data_ptr() == address(frames[refs["seeds"][0]])
    assert out.latents.untyped_storage().data_ptr() == address(frames[refs["latents"][0]])
    assert out.prompt_embeds.dtype == torch.bfloat16
    assert out.prompt_embeds.data_ptr() == address(frames[refs["prompt_embeds"][0]])
    assert out.extra["guidance"].data_ptr() == address(frames[refs["extra"]["guidance"][0]])


@pytest.mark.parametrize("transport", ["inproc", "tcp"])
def test_zero_copy_over_real_zmq_frames(transport):
    """Frames received with copy=False decode in place, and forward on without a copy."""
    ctx = zmq.Context()
    try:
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        for sock in (pull, push):
            sock.linger = 0
            sock.rcvtimeo = sock.sndtimeo = 5000
        if transport == "tcp":
            port = pull.bind_to_random_port("tcp://127.0.0.1")
            push.connect(f"tcp://127.0.0.1:{port}")
        else:
            pull.bind("inproc://codec-test")
            push.connect("inproc://codec-test")
        group = diffusion_group()
        group.latents = torch.randn(2, 3, 16, 32, 32)  # 384 KiB: above pyzmq's copy threshold
        push.send_multipart(encode(group), copy=False)
        received = pull.recv_multipart(copy=False)
        assert all(isinstance(f, zmq.Frame) for f in received)
        out = decode(received)
        latents_frame = msgspec.msgpack.decode(received[0].bytes)["latents"][0]
        assert out.latents.data_ptr() == address(received[latents_frame].buffer)
        assert out.seeds.data_ptr() == address(received[1].buffer)
        assert torch.equal(out.latents, group.latents)
        # A reward worker sets rewards and forwards: the tensor frames are the same memory.
        out.rewards = m.Rewards(group_id=out.group_id, total=[1.0, 0.0])
        forwarded = encode(out)
        assert address(forwarded[latents_frame]) == address(received[latents_frame].buffer)
        push.send_multipart(forwarded, copy=False)
        again = decode(pull.recv_multipart(copy=False))
        assert again.rewards.total == [1.0, 0.0]
        assert torch.equal(again.latents, group.latents)
        del received, forwarded, again  # the decoded tensor alone keeps its zmq.Frame alive
        gc.collect()
        assert torch.equal(out.latents, group.latents)
    finally:
        ctx.destroy(linger=0)


def test_decoded_tensors_keep_their_frames_alive():
    frames = [bytearray(f) for f in encode(token_group())]
    out = decode(frames)
    expected = out.log_probs.clone()
    del frames
    assert torch.equal(out.log_probs, expected)


def test_tensor_fields_in_lists_get_frames_in_order():
    update = weight_update()
    frames = encode(update)
    assert [decode_header(frames[0]).kind, len(frames)] == ["weight_update", 3]
    for frame, tensor in zip(frames[1:], update.tensors, strict=True):
        assert address(frame) == tensor.data_ptr()


def test_protocol_imports_and_codes_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from omnirl.protocol import encode, decode\n"
        "from omnirl.protocol.messages import Heartbeat\n"
        "msg = Heartbeat(worker_id='w', role='rollout', stats={'a': 1.0})\n"
        "assert decode(encode(msg)) == msg\n"
        "print('ok')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_frames_sliced_from_one_buffer_at_odd_offsets():
    """A recording holds frames back to back: views at unaligned offsets decode in place."""
    group = token_group()
    frames = [bytes(f) for f in encode(group)]
    blob = bytearray(b"\x00" + b"".join(frames))
    views, offset = [], 1
    for frame in frames:
        views.append(memoryview(blob)[offset : offset + len(frame)])
        offset += len(frame)
    out = decode(views)
    assert torch.equal(out.log_probs, group.log_probs)
    assert out.log_probs.data_ptr() == address(views[4])
