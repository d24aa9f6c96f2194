"""Segment format: round trip, rotation, truncated tails, corruption in the middle, versions."""

from __future__ import annotations

import logging
import zlib

import msgspec
import pytest
import torch

from omnirl.protocol import Codec
from omnirl.protocol import messages as m
from omnirl.protocol.recording import (
    FILE_HEADER_SIZE,
    RecordingError,
    RecordingReader,
    RecordingWriter,
    segment_paths,
)
from omnirl.protocol.tensor_type import Tensor


def _messages(n: int) -> list[list[bytes]]:
    """n multipart messages of 1..3 frames with distinct contents (an empty frame too)."""
    return [
        [f"header {i}".encode(), bytes([i % 251]) * (17 * i), b""][: 1 + i % 3] for i in range(n)
    ]


def _write(directory, messages, **kw):
    with RecordingWriter(directory, **kw) as w:
        for i, frames in enumerate(messages):
            w.write(frames, recv_time=100.0 + i)
    return w


def _read(directory):
    reader = RecordingReader(directory)
    return [[bytes(f) for f in r.frames] for r in reader.records()], reader


def test_round_trip_keeps_frames_times_and_offsets(tmp_path):
    msgs = _messages(20)
    zmq = pytest.importorskip("zmq")
    msgs[5] = [zmq.Frame(b"a zmq frame"), memoryview(b"a view"), bytearray(b"xy")]
    _write(tmp_path, msgs)
    records = list(RecordingReader(tmp_path).records())
    assert [[bytes(f) for f in r.frames] for r in records] == [[bytes(f) for f in x] for x in msgs]
    assert [r.time for r in records] == [100.0 + i for i in range(20)]
    assert records[0].offset == FILE_HEADER_SIZE
    assert all(r.frames[0].readonly for r in records)


def test_segments_rotate_by_size_and_continue_after_reopen(tmp_path):
    msgs = _messages(30)
    w = _write(tmp_path, msgs, max_segment_bytes=300, fsync="always")
    assert len(w.segments) > 3
    assert all(p.stat().st_size <= 300 or i for i, p in enumerate(w.segments))
    _write(tmp_path, msgs[:2])  # a second writer never appends to an old segment
    got, reader = _read(tmp_path)
    assert got == msgs + msgs[:2]
    assert len(segment_paths(tmp_path)) == len(w.segments) + 1
    assert reader.stats.records == 32 and not reader.stats.problems


def test_bad_arguments_are_typed_errors(tmp_path):
    with pytest.raises(RecordingError, match="fsync"):
        RecordingWriter(tmp_path, fsync="sometimes")
    with pytest.raises(RecordingError, match="not a directory"):
        RecordingReader(tmp_path / "missing")


def test_truncated_tail_keeps_every_complete_record(tmp_path, caplog):
    msgs = _messages(6)
    _write(tmp_path / "full", msgs)
    (segment,) = segment_paths(tmp_path / "full")
    data = segment.read_bytes()
    offsets = [r.offset for r in RecordingReader(tmp_path / "full").records()] + [len(data)]
    for cut in sorted({3, FILE_HEADER_SIZE, *(o + d for o in offsets[1:-1] for d in (1, 5, 30))}):
        if cut >= len(data):
            continue
        d = tmp_path / f"cut{cut}"
        d.mkdir()
        (d / segment.name).write_bytes(data[:cut])
        with caplog.at_level(logging.WARNING):
            got, reader = _read(d)
        complete = sum(1 for o in offsets[1:] if o <= cut)
        assert got == msgs[:complete], cut
        if cut < FILE_HEADER_SIZE:
            assert reader.stats.bad_segments == 1
        elif cut not in offsets:
            assert reader.stats.truncated == 1 and reader.stats.corrupt == 0, cut
            assert "cut off" in caplog.text


def test_corrupted_record_in_the_middle_is_skipped_and_the_rest_read(tmp_path, caplog):
    msgs = _messages(9)
    _write(tmp_path, msgs)
    (segment,) = segment_paths(tmp_path)
    offsets = [r.offset for r in RecordingReader(tmp_path).records()]
    data = bytearray(segment.read_bytes())
    data[offsets[4] - 5] ^= 0xFF  # the last payload byte of record 3: checksum mismatch
    data[offsets[6] + 5] ^= 0x40  # the frame count of record 6: implausible header
    segment.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        got, reader = _read(tmp_path)
    assert got == [x for i, x in enumerate(msgs) if i not in (3, 6)]
    assert reader.stats.corrupt == 2 and reader.stats.truncated == 0
    assert "checksum mismatch" in caplog.text and "bytes skipped" in caplog.text


def test_checksum_is_zlib_crc32_of_everything_after_the_sync_marker(tmp_path):
    _write(tmp_path, [[b"hi"]])
    data = segment_paths(tmp_path)[0].read_bytes()[FILE_HEADER_SIZE:]
    assert data[:4] == b"ORC1"
    assert int.from_bytes(data[-4:], "little") == zlib.crc32(data[4:-4])


class PingV0(m.Message, tag="heartbeat", kw_only=True):
    v: tuple[int, int] = (1, 0)
    worker_id: str
    role: m.Role
    policy_version: int = -1
    leases: list[str] = msgspec.field(default_factory=list)
    time: float = 0.0
    stats: dict[str, float] = msgspec.field(default_factory=dict)


class PingV1(m.Message, tag="heartbeat", kw_only=True):
    v: tuple[int, int] = (1, 1)
    worker_id: str
    role: m.Role
    policy_version: int = -1
    leases: list[str] = msgspec.field(default_factory=list)
    time: float = 0.0
    stats: dict[str, float] = msgspec.field(default_factory=dict)
    load: float = 0.0
    queue_depths: Tensor | None = None


def test_recording_at_minor_n_reads_and_decodes_at_minor_n_plus_1(tmp_path):
    old, new = Codec([PingV0], version=(1, 0)), Codec([PingV1], version=(1, 1))
    with RecordingWriter(tmp_path, protocol=(1, 0)) as w:
        w.write(old.encode(PingV0(worker_id="w", role="rollout", leases=["l1"])))
    (record,) = RecordingReader(tmp_path).records()
    assert record.protocol == (1, 0)
    msg = new.decode(record.frames)
    assert isinstance(msg, PingV1) and msg.leases == ["l1"] and msg.load == 0.0
    # and the other way: a 1.1 recording (with a tensor frame) read by a 1.0 decoder
    with RecordingWriter(tmp_path / "n1", protocol=(1, 1)) as w:
        w.write(new.encode(PingV1(worker_id="w", role="rollout", queue_depths=torch.arange(3))))
    (record,) = RecordingReader(tmp_path / "n1").records()
    assert record.protocol == (1, 1) and len(record.frames) == 2
    assert isinstance(old.decode(record.frames), PingV0)


def test_the_worked_example_in_the_docs_is_what_the_writer_writes(tmp_path):
    import re
    from pathlib import Path

    from omnirl.protocol.recording import encode_file_header

    doc = (Path(__file__).resolve().parents[2] / "docs" / "recording.md").read_text()
    blocks = re.findall(r"```\n(4f 4d 4e.*?|4f 52 43 31.*?)```", doc, re.S)
    header, record = (
        bytes.fromhex(" ".join(line[:26] for line in b.splitlines())) for b in blocks[:2]
    )
    assert header == encode_file_header(1764700000.0, (1, 0))
    with RecordingWriter(tmp_path, protocol=(1, 0)) as w:
        w.write([b"hi", b"\x01\x02\x03"], recv_time=1764700000.25)
    assert segment_paths(tmp_path)[0].read_bytes()[FILE_HEADER_SIZE:] == record
