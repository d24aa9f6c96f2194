"""Weight versions on the wire: chunking, checksums, assembly, corruption, zero-copy pushes."""

from __future__ import annotations

import pytest
import torch
import zmq

from omnirl.protocol.codec import decode, encode
from omnirl.protocol.messages import Ack, WeightRequest, WeightUpdate
from omnirl.protocol.weights import WeightAssembler, WeightIntegrityError, split_update
from omnirl.trainer.publisher import WeightPublisher


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(64, 32, generator=g),  # 8 KiB
        "b.bias": torch.randn(7, generator=g).to(torch.bfloat16),
        "c.big": torch.randn(40, 100, generator=g),  # 16 KB: larger than a chunk, alone
        "d.mask": torch.rand(5, generator=g) > 0.5,
        "e.empty": torch.zeros(0, 3),
    }


def _wire(chunk: WeightUpdate) -> WeightUpdate:
    frames = [bytes(f) for f in encode(chunk)]
    return decode(frames)


def test_chunking_bounds_sizes_and_checksums_round_trip():
    state = _state()
    chunks = split_update(3, "full", state, chunk_bytes=10_000)
    assert len(chunks) >= 3 and all(c.num_chunks == len(chunks) for c in chunks)
    assert len({c.update_checksum for c in chunks}) == 1
    assert ["c.big"] in [c.names for c in chunks]  # a tensor is never split
    for c in chunks:
        size = sum(t.numel() * t.element_size() for t in c.tensors)
        assert size <= 10_000 or len(c.tensors) == 1
    asm = WeightAssembler()
    out = None
    for c in reversed(chunks):  # any arrival order
        assert out is None
        out = asm.add(_wire(c))
    assert out is not None and out.version == 3 and out.format == "full"
    assert list(out.tensors) == list(state) or set(out.tensors) == set(state)
    for name, t in state.items():
        assert out.tensors[name].dtype == t.dtype
        assert torch.equal(out.tensors[name], t)


def test_corrupted_chunk_is_rejected_and_a_resend_completes():
    state = _state()
    chunks = split_update(1, "lora", state, chunk_bytes=10_000, adapter_config={"r": 4})
    bad = _wire(chunks[0])
    tensors = [t.clone() for t in bad.tensors]
    tensors[0].view(-1)[0] += 1.0  # one flipped value
    asm = WeightAssembler()
    with pytest.raises(WeightIntegrityError, match="checksum mismatch"):
        asm.add(
            WeightUpdate(
                **{**{f: getattr(bad, f) for f in bad.__struct_fields__}, "tensors": tensors}
            )
        )
    out = None
    for c in chunks:
        out = asm.add(_wire(c))
    assert out is not None and out.adapter_config == {"r": 4}


def test_forged_update_checksum_and_old_versions():
    chunks = split_update(2, "full", _state(), chunk_bytes=10_000)
    asm = WeightAssembler()
    forged = [
        WeightUpdate(
            **{**{f: getattr(c, f) for f in c.__struct_fields__}, "update_checksum": "0" * 64}
        )
        for c in chunks
    ]
    with pytest.raises(WeightIntegrityError):
        for c in forged:
            asm.add(c)
    for c in chunks:
        done = asm.add(c)
    assert done is not None
    older = split_update(1, "full", _state(1), chunk_bytes=1 << 20)
    assert asm.add(older[0]) is None  # older than what we hold: ignored
    newer = split_update(5, "full", _state(2), chunk_bytes=10_000)
    partial = split_update(4, "full", _state(3), chunk_bytes=10_000)
    asm.add(partial[0])
    for c in newer:  # a newer version discards the partial older one
        done = asm.add(c)
    assert done.version == 5


def test_publisher_pushes_fresh_copies_to_peers_and_answers_late_joiners():
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealers = [ctx.socket(zmq.DEALER) for _ in range(2)]
    for d in dealers:
        d.connect(f"tcp://127.0.0.1:{port}")
    try:
        live = _state()
        pub = WeightPublisher(chunk_bytes=10_000, format="full", adapter_config=None)
        pub.prepare(0, live)

        def request(d, have):
            d.send_multipart(encode(WeightRequest(worker_id="w", have_version=have)))
            peer, *frames = router.recv_multipart(copy=False)
            pub.handle_request(router, peer.bytes, decode(frames))

        def collect(d):
            asm = WeightAssembler()
            while True:
                assert d.poll(5000), "no weight chunk arrived"
                msg = decode(d.recv_multipart(copy=False))
                if isinstance(msg, Ack):
                    return msg
                done = asm.add(msg)
                if done is not None:
                    return done

        for d in dealers:
            request(d, -1)
            assert collect(d).version == 0
        request(dealers[0], 0)
        assert isinstance(collect(dealers[0]), Ack)  # up to date
        # the next version: published from the live tensors, which change right after
        before = {k: v.clone() for k, v in live.items()}
        pushed = pub.publish(router, 1, live)
        for t in live.values():
            if t.dtype.is_floating_point and t.numel():
                t.add_(100.0)  # the trainer's next step writes the live parameters
        assert pushed == 2
        for d in dealers:
            got = collect(d)
            assert got.version == 1
            for name, t in before.items():
                assert torch.equal(got.tensors[name], t), name
    finally:
        for s in (*dealers, router):
            s.close(linger=0)
        ctx.term()


def test_publisher_refuses_non_finite_weights_and_keeps_the_last_good_version():
    from omnirl.protocol.errors import NonFiniteValue

    pub = WeightPublisher(chunk_bytes=1 << 10, format="lora", adapter_config={"r": 2})
    pub.prepare(1, {"a.lora_A.weight": torch.ones(4, 4)})
    bad = torch.ones(4, 4)
    bad[1, 2] = float("nan")
    with pytest.raises(NonFiniteValue, match=r"weights\[b.lora_B.weight\].*1 of 16"):
        pub.prepare(2, {"a.lora_A.weight": torch.ones(4, 4), "b.lora_B.weight": bad})
    assert pub.version == 1 and pub.num_chunks >= 1
