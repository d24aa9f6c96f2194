"""Minor versions add optional fields and stay mutually readable; majors refuse each other.

Two versions of the Heartbeat schema are defined here: the shipped minor (``SHIPPED``), and
the next minor (``NEXT``), which adds an optional number and an optional tensor. Each side
decodes the other.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from omnirl.protocol import Codec, decode, encode
from omnirl.protocol import messages as m
from omnirl.protocol.errors import FrameCountMismatch, NonFiniteValue, VersionMismatch
from omnirl.protocol.tensor_type import Tensor
from omnirl.protocol.version import PROTOCOL_VERSION, format_version

SHIPPED = PROTOCOL_VERSION
NEXT = (SHIPPED[0], SHIPPED[1] + 1)


class HeartbeatV0(m.Message, tag="heartbeat", kw_only=True):
    """The shipped protocol's heartbeat."""

    v: tuple[int, int] = SHIPPED
    worker_id: str
    role: m.Role
    policy_version: int = -1
    leases: list[str] = msgspec.field(default_factory=list)
    time: float = 0.0
    stats: dict[str, float] = msgspec.field(default_factory=dict)


class HeartbeatV1(m.Message, tag="heartbeat", kw_only=True):
    """The next minor's heartbeat: two optional fields appended, defaults as shipped behaves."""

    finite_fields = ("load",)
    v: tuple[int, int] = NEXT
    worker_id: str
    role: m.Role
    policy_version: int = -1
    leases: list[str] = msgspec.field(default_factory=list)
    time: float = 0.0
    stats: dict[str, float] = msgspec.field(default_factory=dict)
    load: float = 0.0
    queue_depths: Tensor | None = None  # int64 [N]


OLD = Codec([HeartbeatV0, m.Ack], version=SHIPPED)
NEW = Codec([HeartbeatV1, m.Ack], version=NEXT)


def test_newer_minor_decodes_on_older_minor():
    beat = HeartbeatV1(
        worker_id="w",
        role="rollout",
        leases=["l1"],
        load=0.75,
        queue_depths=torch.tensor([3, 1], dtype=torch.int64),
    )
    frames = NEW.encode(beat)
    assert len(frames) == 2
    old = OLD.decode(frames)
    assert type(old) is HeartbeatV0
    assert (old.v, old.worker_id, old.leases) == (NEXT, "w", ["l1"])
    assert not hasattr(old, "load")
    # The shipped schema reads it the same way.
    shipped = decode(frames)
    assert type(shipped) is m.Heartbeat and shipped.leases == ["l1"]


def test_older_minor_decodes_on_newer_minor_with_defaults():
    frames = OLD.encode(HeartbeatV0(worker_id="w", role="reward", policy_version=3))
    new = NEW.decode(frames)
    assert type(new) is HeartbeatV1
    assert (new.v, new.policy_version, new.load, new.queue_depths) == (SHIPPED, 3, 0.0, None)
    shipped = encode(m.Heartbeat(worker_id="w", role="reward"))
    assert NEW.decode(shipped).load == 0.0


def test_unreferenced_frames_only_from_a_newer_minor():
    frames = OLD.encode(HeartbeatV0(worker_id="w", role="rollout"))
    extra = [frames[0], b"\x00" * 8]
    with pytest.raises(FrameCountMismatch):
        OLD.decode(extra)  # same minor: an unreferenced frame is an error
    with pytest.raises(FrameCountMismatch):
        NEW.decode(extra)  # older minor: it cannot have fields we do not know


def test_newer_minor_fields_are_still_checked_by_the_newer_side():
    frames = NEW.encode(HeartbeatV1(worker_id="w", role="rollout", load=1.0))
    header = msgspec.msgpack.decode(frames[0])
    header["load"] = float("nan")
    bad = [msgspec.msgpack.encode(header)]
    assert OLD.decode(bad).worker_id == "w"  # the shipped minor does not know the field
    with pytest.raises(NonFiniteValue, match="'load' must be finite"):
        NEW.decode(bad)


@pytest.mark.parametrize("major", [0, 2])
def test_other_major_is_refused_by_both(major):
    frames = NEW.encode(HeartbeatV1(worker_id="w", role="rollout", v=(major, 0)))
    for codec, local in ((OLD, format_version(SHIPPED)), (NEW, format_version(NEXT))):
        with pytest.raises(VersionMismatch) as info:
            codec.decode(frames)
        assert str(info.value) == f"peer speaks protocol {major}.0, this process speaks {local}"
        assert info.value.to_refusal().code == "version_mismatch"
