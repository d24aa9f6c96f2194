"""Recordings of message streams: append-only segment files of checksummed multipart records.

A recording is a directory of segments ``segment-000000.omnirec``, ``segment-000001...``,
read in name order. The byte layout is in ``docs/recording.md``; in short, little-endian::

    segment = file header (32 bytes) then records
    file header = magic "OMNIREC\\0" | format u16 | protocol major u16 | minor u16 | flags u16
                  | created f64 (unix s) | reserved u32 | crc32 of the 28 bytes before it
    record = sync "ORC1" | nframes u32 | time f64 | body_len u64
             | nframes x frame length u64 | frame bytes ... | crc32 u32

``body_len`` counts the length table and the frame bytes; the record's crc32 (zlib's, the
IEEE 802.3 polynomial) covers every byte after the sync marker up to the crc itself.

The reader never raises on damaged data: a record that fails its checks is skipped and the
reader resynchronises on the next sync marker whose record checks out (a warning names the
segment and offset); a record cut off by the end of a segment is reported as a truncated
tail. Every intact record, before and after the damage, is read.

Only the standard library is used (``zlib``, ``mmap``, ``os.writev``), so a replay or
inspect tool can read recordings without numpy or torch.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omnirl.protocol.version import PROTOCOL_VERSION

log = logging.getLogger(__name__)

MAGIC = b"OMNIREC\x00"
FORMAT_VERSION = 1
SYNC = b"ORC1"
SEGMENT_SUFFIX = ".omnirec"
FILE_HEADER = struct.Struct("<8sHHHHdI")  # magic, format, major, minor, flags, created, reserved
FILE_HEADER_SIZE = FILE_HEADER.size + 4  # + crc32
RECORD_HEAD = struct.Struct("<4sIdQ")  # sync, nframes, time, body_len
CRC = struct.Struct("<I")
LENGTH = struct.Struct("<Q")
MAX_FRAMES = 1 << 16  # a sanity bound that lets the reader reject a garbled header at once
FSYNC_POLICIES = ("never", "segment", "always")
_IOV_MAX = min(getattr(os, "sysconf", lambda _n: 1024)("SC_IOV_MAX") or 1024, 1024)


class RecordingError(Exception):
    """A recording cannot be opened or written (not damage inside it: that is reported)."""


def segment_name(index: int) -> str:
    return f"segment-{index:06d}{SEGMENT_SUFFIX}"


def segment_paths(directory: str | Path) -> list[Path]:
    """The segments of a recording, in reading order."""
    return sorted(Path(directory).glob(f"segment-*{SEGMENT_SUFFIX}"))


def _buffer(frame: Any) -> memoryview:
    """A flat byte view of a frame (bytes, memoryview, zmq.Frame, numpy array): no copy."""
    view = frame.buffer if hasattr(frame, "buffer") and not isinstance(frame, memoryview) else frame
    view = memoryview(view)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def encode_file_header(created: float, protocol: tuple[int, int] = PROTOCOL_VERSION) -> bytes:
    head = FILE_HEADER.pack(MAGIC, FORMAT_VERSION, protocol[0], protocol[1], 0, created, 0)
    return head + CRC.pack(zlib.crc32(head))


def record_parts(frames: Sequence[Any], recv_time: float) -> tuple[list[Any], int]:
    """The byte pieces of one record (head, the frames' own buffers, crc) and its size."""
    views = [_buffer(f) for f in frames]
    if len(views) > MAX_FRAMES:
        raise RecordingError(f"{len(views)} frames in one message (at most {MAX_FRAMES})")
    table = b"".join(LENGTH.pack(v.nbytes) for v in views)
    body_len = len(table) + sum(v.nbytes for v in views)
    head = RECORD_HEAD.pack(SYNC, len(views), recv_time, body_len) + table
    crc = zlib.crc32(head[len(SYNC) :])
    for v in views:
        crc = zlib.crc32(v, crc)
    return [head, *views, CRC.pack(crc)], RECORD_HEAD.size + body_len + CRC.size


def _write_all(fd: int, parts: list[Any]) -> None:
    """``writev`` every part, resuming after partial writes (the frames are not copied)."""
    pending = [memoryview(p) if isinstance(p, bytes) else p for p in parts]
    while pending:
        written = os.writev(fd, pending[:_IOV_MAX])
        while pending and written >= pending[0].nbytes:
            written -= pending[0].nbytes
            pending.pop(0)
        if written:
            pending[0] = pending[0][written:]


class RecordingWriter:
    """Appends multipart messages to segment files under ``directory``.

    ``max_segment_bytes``: a new segment starts before a record would make the current one
    larger (a record bigger than that gets a segment of its own). ``fsync``: ``"never"``
    (the OS flushes), ``"segment"`` (when a segment is closed; default) or ``"always"``
    (after every record: a crash loses nothing that :meth:`write` returned from).
    Opening a directory that already holds segments continues after the last one; an
    existing segment is never appended to (its tail may be damaged).
    """

    def __init__(
        self,
        directory: str | Path,
        max_segment_bytes: int = 256 << 20,
        *,
        fsync: str = "segment",
        protocol: tuple[int, int] = PROTOCOL_VERSION,
    ):
        if fsync not in FSYNC_POLICIES:
            raise RecordingError(f"fsync policy {fsync!r} is not one of {FSYNC_POLICIES}")
        if max_segment_bytes <= FILE_HEADER_SIZE:
            raise RecordingError(f"max_segment_bytes={max_segment_bytes} is too small")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_segment_bytes = max_segment_bytes
        self.fsync = fsync
        self.protocol = protocol
        existing = segment_paths(self.directory)
        self._next_index = int(existing[-1].name[8:14]) + 1 if existing else 0
        self._fd: int | None = None
        self._size = 0
        self.records = 0
        self.bytes = 0
        self.segments: list[Path] = []

    def write(self, frames: Sequence[Any], recv_time: float | None = None) -> None:
        """Append one message; ``recv_time`` defaults to now (unix seconds)."""
        parts, size = record_parts(frames, time.time() if recv_time is None else recv_time)
        if self._fd is None or (
            self._size > FILE_HEADER_SIZE and self._size + size > self.max_segment_bytes
        ):
            self._rotate()
        _write_all(self._fd, parts)
        self._size += size
        self.records += 1
        self.bytes += size
        if self.fsync == "always":
            os.fsync(self._fd)

    __call__ = write  # so that a writer is itself an intake tap: ``tap(frames)``

    def _rotate(self) -> None:
        self._close_segment()
        path = self.directory / segment_name(self._next_index)
        self._next_index += 1
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        _write_all(fd, [encode_file_header(time.time(), self.protocol)])
        self._fd, self._size = fd, FILE_HEADER_SIZE
        self.segments.append(path)

    def _close_segment(self) -> None:
        if self._fd is not None:
            if self.fsync != "never":
                os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        self._close_segment()

    def __enter__(self) -> RecordingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    path: Path
    format_version: int
    protocol: tuple[int, int]
    created: float


@dataclass(frozen=True, slots=True)
class Record:
    """One recorded message. ``frames`` are read-only views of the segment (mmap): no copy."""

    frames: list[memoryview]
    time: float  # when it was received (unix seconds)
    segment: Path
    offset: int  # of its sync marker in the segment
    protocol: tuple[int, int] = PROTOCOL_VERSION  # of the segment's writer


@dataclass(slots=True)
class ReadStats:
    """What a pass over a recording found; ``problems`` are (segment, offset, reason)."""

    records: int = 0
    corrupt: int = 0  # damaged regions skipped in the middle of a segment
    truncated: int = 0  # segments whose last record was cut off
    bad_segments: int = 0  # segments whose file header is unreadable (skipped whole)
    problems: list[tuple[str, int, str]] = field(default_factory=list)


def _check_record(buf: Any, offset: int, end: int) -> tuple[int, str]:
    """``(next_offset, "")`` for an intact record at ``offset``, or ``(0, reason)``.

    The reason starts with ``"truncated"`` when the record runs past ``end``.
    """
    if offset + RECORD_HEAD.size > end:
        return 0, "truncated record header"
    sync, nframes, _, body_len = RECORD_HEAD.unpack_from(buf, offset)
    if sync != SYNC:
        return 0, "no sync marker"
    if nframes > MAX_FRAMES or body_len < LENGTH.size * nframes:
        return 0, f"implausible record header (nframes={nframes}, body_len={body_len})"
    stop = offset + RECORD_HEAD.size + body_len + CRC.size
    if stop > end:
        return 0, f"truncated record ({stop - end} bytes missing)"
    table = offset + RECORD_HEAD.size
    lengths = sum(LENGTH.unpack_from(buf, table + 8 * i)[0] for i in range(nframes))
    if lengths + LENGTH.size * nframes != body_len:
        return 0, "frame lengths do not add up to the body length"
    (crc,) = CRC.unpack_from(buf, stop - CRC.size)
    if zlib.crc32(memoryview(buf)[offset + len(SYNC) : stop - CRC.size]) != crc:
        return 0, "checksum mismatch"
    return stop, ""


def _frames(buf: Any, offset: int) -> tuple[list[memoryview], float]:
    _, nframes, recv_time, _ = RECORD_HEAD.unpack_from(buf, offset)
    view = memoryview(buf).toreadonly()
    table = offset + RECORD_HEAD.size
    pos = table + LENGTH.size * nframes
    frames = []
    for i in range(nframes):
        (n,) = LENGTH.unpack_from(buf, table + 8 * i)
        frames.append(view[pos : pos + n])
        pos += n
    return frames, recv_time


def read_segment_header(buf: Any) -> tuple[int, int, int, float] | str:
    """``(format, major, minor, created)`` of a segment's header, or why it is unreadable."""
    if len(buf) < FILE_HEADER_SIZE:
        return "file header truncated"
    magic, fmt, major, minor, _flags, created, _ = FILE_HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        return "not an omnirl recording segment (bad magic)"
    (crc,) = CRC.unpack_from(buf, FILE_HEADER.size)
    if zlib.crc32(memoryview(buf)[: FILE_HEADER.size]) != crc:
        return "file header checksum mismatch"
    if fmt != FORMAT_VERSION:
        return f"segment format {fmt} (this reader reads format {FORMAT_VERSION})"
    return fmt, major, minor, created


class RecordingReader:
    """Reads the records of a recording in order; damage is counted in :attr:`stats`.

    ``RecordingReader(dir).records()`` yields :class:`Record` objects. Segments are
    memory-mapped and the frames are views of the mapping, valid while a view is held.
    """

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise RecordingError(f"recording {self.directory} is not a directory")
        self.segments = segment_paths(self.directory)
        self.stats = ReadStats()
        self.segment_info: list[SegmentInfo] = []

    def _problem(self, path: Path, offset: int, reason: str) -> None:
        self.stats.problems.append((path.name, offset, reason))
        log.warning("recording %s at byte %d: %s", path, offset, reason)

    def records(self) -> Iterator[Record]:
        self.stats = ReadStats()
        self.segment_info = []
        for path in self.segments:
            yield from self._segment(path)

    def __iter__(self) -> Iterator[Record]:
        return self.records()

    def _segment(self, path: Path) -> Iterator[Record]:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            buf: Any = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        header = read_segment_header(buf)
        if isinstance(header, str):
            self.stats.bad_segments += 1
            self._problem(path, 0, header + "; segment skipped")
            return
        fmt, major, minor, created = header
        self.segment_info.append(SegmentInfo(path, fmt, (major, minor), created))
        offset, end = FILE_HEADER_SIZE, size
        while offset < end:
            stop, reason = _check_record(buf, offset, end)
            if stop:
                frames, recv_time = _frames(buf, offset)
                self.stats.records += 1
                yield Record(frames, recv_time, path, offset, (major, minor))
                offset = stop
                continue
            resume = self._resync(buf, offset + 1, end)
            if resume is None:
                if reason.startswith("truncated"):
                    self.stats.truncated += 1
                    self._problem(path, offset, f"{reason}: the segment's tail is cut off")
                else:
                    self.stats.corrupt += 1
                    self._problem(path, offset, f"{reason}: damaged tail skipped")
                return
            self.stats.corrupt += 1
            self._problem(path, offset, f"{reason}: {resume - offset} bytes skipped")
            offset = resume

    @staticmethod
    def _resync(buf: Any, start: int, end: int) -> int | None:
        """Offset of the next sync marker at or after ``start`` that begins an intact record."""
        while True:
            found = buf.find(SYNC, start, end)
            if found < 0:
                return None
            if _check_record(buf, found, end)[0]:
                return found
            start = found + 1
