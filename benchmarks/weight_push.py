"""Weight push latency per worker against model size, LoRA-sized and full-sized updates.

The trainer side is the real :class:`~omnirl.trainer.publisher.WeightPublisher` on a
ROUTER (fresh CPU copies, chunking, per-chunk sha256, encoding once, zero-copy sends to
every peer); each worker is a separate process with a DEALER and the real
:class:`~omnirl.protocol.weights.WeightAssembler` (every checksum verified). For each
update size the publisher publishes one version and every worker reports when it holds the
whole, verified version. Reported per size: the publisher's prepare time (copy + checksum
+ encode) and the latency from the start of ``publish`` to each worker's completion.

    uv run python benchmarks/weight_push.py --workers 1 2 4 --sizes-mb 1 16 64 256

Synthetic state dicts stand in for models: LoRA-like updates are many small fp32
matrices, full ones bf16 matrices of 4 MiB each (SD3-medium's full transformer is ~4.2 GB
in bf16, its rank-32 LoRA ~ 37 MB in fp32). Prints one JSON line per (workers, size).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time


def receiver(weights_addr: str, report_addr: str, worker_id: str) -> None:
    import zmq

    from omnirl.protocol.codec import decode, encode
    from omnirl.protocol.messages import Ack, WeightRequest
    from omnirl.protocol.weights import WeightAssembler

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(weights_addr)
    report = ctx.socket(zmq.PUSH)
    report.connect(report_addr)
    asm = WeightAssembler()
    sock.send_multipart(encode(WeightRequest(worker_id=worker_id, have_version=10**9)))
    while True:
        msg = decode(sock.recv_multipart(copy=False), max_bytes=None)
        if isinstance(msg, Ack):
            report.send_json({"worker": worker_id, "ready": True})
            continue
        if msg.version < 0:
            break
        done = asm.add(msg)
        if done is not None:
            report.send_json({"worker": worker_id, "version": done.version, "t": time.time()})
    report.close(linger=1000)
    sock.close(linger=0)
    ctx.term()


def synthetic_state(total_mb: float, fmt: str):
    import torch

    if fmt == "lora":  # rank-16 A/B pairs of 1536-wide projections, fp32
        a, b = (16, 1536), (1536, 16)
        per = (a[0] * a[1] + b[0] * b[1]) * 4
        n = max(1, int(total_mb * 2**20 / per))
        out = {}
        for i in range(n):
            out[f"blocks.{i}.lora_A.weight"] = torch.randn(*a)
            out[f"blocks.{i}.lora_B.weight"] = torch.randn(*b)
        return out
    n = max(1, int(total_mb / 4))  # 4 MiB bf16 matrices
    return {f"blocks.{i}.weight": torch.randn(1024, 2048).to(torch.bfloat16) for i in range(n)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--chunk-mb", type=float, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)

    import zmq

    from omnirl.protocol.codec import decode, encode
    from omnirl.protocol.messages import Ack
    from omnirl.protocol.weights import split_update
    from omnirl.trainer.publisher import WeightPublisher

    spawn = mp.get_context("spawn")
    for n_workers in args.workers:
        ctx = zmq.Context()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.SNDHWM, 0)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        reports = ctx.socket(zmq.PULL)
        rport = reports.bind_to_random_port("tcp://127.0.0.1")
        procs = [
            spawn.Process(
                target=receiver,
                args=(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}", f"w{i}"),
            )
            for i in range(n_workers)
        ]
        for proc in procs:
            proc.start()
        pubs = {
            fmt: WeightPublisher(
                chunk_bytes=int(args.chunk_mb * 2**20), format=fmt, adapter_config={}
            )
            for fmt in ("lora", "full")
        }
        peers = []
        for _ in range(n_workers):  # registration: WeightRequest -> Ack
            peer, *frames = router.recv_multipart(copy=False)
            peers.append(peer.bytes)
            decode(frames)
            for pub in pubs.values():
                pub.peers[peer.bytes] = -1
            router.send_multipart([peer.bytes, *encode(Ack(ref="-1", detail="up_to_date"))])
        for _ in range(n_workers):
            reports.recv_json()
        version = 1  # warm-up version: the receivers import torch on their first tensor
        pubs["lora"].publish(router, version, synthetic_state(1, "lora"))
        for _ in range(n_workers):
            reports.recv_json()
        for fmt in ("lora", "full"):
            for size in args.sizes_mb:
                if fmt == "lora" and size > 64:
                    continue
                state = synthetic_state(size, fmt)
                nbytes = sum(t.numel() * t.element_size() for t in state.values())
                lat, prep = [], []
                for _ in range(args.repeats):
                    version += 1
                    t0 = time.time()
                    pubs[fmt].publish(router, version, state)
                    prep.append(pubs[fmt].last_prepare_s)
                    for _ in range(n_workers):
                        r = reports.recv_json()
                        assert r["version"] == version
                        lat.append(r["t"] - t0)
                print(
                    json.dumps(
                        {
                            "workers": n_workers,
                            "format": fmt,
                            "mb": round(nbytes / 2**20, 1),
                            "chunks": pubs[fmt].num_chunks,
                            "prepare_s": round(statistics.median(prep), 4),
                            "latency_median_s": round(statistics.median(lat), 4),
                            "latency_max_s": round(max(lat), 4),
                        }
                    ),
                    flush=True,
                )
                del state
        # stop the receivers: a version -1 chunk
        stop = encode(split_update(-1, "lora", {}, chunk_bytes=1)[0])
        for peer in peers:
            router.send_multipart([peer, *stop])
        for proc in procs:
            proc.join(30)
        router.close(linger=0)
        reports.close(linger=0)
        ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
