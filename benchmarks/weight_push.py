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
matrices, full ones bf16 matrices of 4 MiB each. Prints one JSON line per (workers, size).

``--model sd35m`` (or ``tiny``) instead pushes what the trainer really exports for the
SD3.5-Medium transformer of ``gpu_sd35m_setup.py`` to one rollout-side receiver in its own
process, and applies it there:

- *trainer side*: the names, shapes and dtypes of ``SD3TrainingAdapter.export_weights()``
  (``full_state``: every ``state_dict`` entry in bf16; ``lora_state``: the rank-32 adapter's
  A/B matrices in fp32), read from the transformer built on the ``meta`` device; a
  ``WeightPublisher`` per version on the trainer's ``weights`` ROUTER with the server's socket
  options (``hwm=0``) and ``runtime.weight_chunk_bytes`` (64 MiB);
- *rollout side*: the worker's ``weights`` DEALER (its ``SocketOptions``), ``decode`` with its
  ``max_bytes``, ``WeightInbox`` (every chunk's sha256 verified), then
  ``SD3RolloutAdapter.load_weights`` into a real ``SD3Transformer2DModel`` of the same config
  (bf16, CPU, memory touched before the first push): validation (names, shapes, finiteness)
  and the in-place copy. After each version the receiver recomputes the update checksum over
  the model's live tensors, so "applied" means the model holds exactly the pushed bytes.

Full pushes go first (the model has no adapter yet), then an untimed LoRA version that makes
the receiver add the adapter from ``adapter_config``, then the timed LoRA pushes. To keep
the trainer process within this box's memory the full source tensors are contiguous views
into one 512 MiB pool of random bf16 (at rotating offsets, so the publisher's copy reads
from memory, not cache); the publisher still copies, hashes and encodes every byte.
Reported per version: ``prepare_s`` (the publisher's copy + sha256 + encode; a
``WeightUpdate`` has no ``finite_fields``, so the wire checks no weight for NaN / inf: only
``load_weights`` does), ``received_s`` (publish start to the receiver holding the whole verified version),
``applied_s`` (publish start to ``load_weights`` returned) and GB/s = bytes / applied_s.
On a GPU trainer ``export_weights`` adds the device-to-host copy before this, and a GPU
rollout worker's ``load_weights`` copies host-to-device.

    uv run python benchmarks/weight_push.py --model sd35m --repeats 3 --full-repeats 2
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path


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


# ------------------------------------------------------------------- --model: real shapes
POOL_BYTES = 512 << 20  # random bf16 the full source tensors are views of


def model_setup(model: str):
    """``(transformer config, Setup)`` of ``gpu_sd35m_setup.py`` for ``sd35m`` or ``tiny``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_sd35m_setup import SETUPS

    setup = SETUPS[model]
    return setup.transformer, setup


def meta_transformer(config: dict, lora: dict | None):
    """The transformer on the ``meta`` device in bf16 (no memory), with LoRA if asked."""
    import torch
    from diffusers import SD3Transformer2DModel

    from omnirl.models.sd3.lora import add_lora

    with torch.device("meta"):
        model = SD3Transformer2DModel(**config)
    model = model.to(torch.bfloat16)
    if lora is not None:
        add_lora(model, lora)
    return model


def export_like(model: str, fmt: str, seed: int = 0):
    """Tensors named, shaped and typed as ``SD3TrainingAdapter.export_weights()`` returns them
    (``lora``: PEFT keys, fp32; ``full``: ``state_dict`` keys, bf16), filled with random values."""
    import torch

    from omnirl.models.weights import full_targets, lora_targets

    config, setup = model_setup(model)
    gen = torch.Generator().manual_seed(seed)
    if fmt == "lora":
        meta = lora_targets(meta_transformer(config, setup.lora))
        return {k: torch.randn(v.shape, generator=gen) for k, v in meta.items()}
    meta = full_targets(meta_transformer(config, None))
    sizes = [v.numel() for v in meta.values()]
    pool_numel = max(max(sizes), min(POOL_BYTES // 2, sum(sizes)))
    pool = torch.randn(pool_numel, generator=gen).to(torch.bfloat16)
    out, offset = {}, 0
    for name, v in meta.items():
        n = v.numel()
        if offset + n > pool.numel():
            offset = 0
        out[name] = pool[offset : offset + n].view(v.shape)
        offset += n
    return out


def build_rollout(model: str):
    """``SD3RolloutAdapter`` over a real ``SD3Transformer2DModel`` of the config (bf16, CPU)."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_sd35m_setup import TINY_VAE, FakeTextPipeline, build_vae

    from omnirl.models.sd3 import SD3RolloutAdapter

    config, setup = model_setup(model)
    transformer = meta_transformer(config, None).to_empty(device="cpu")
    with torch.no_grad():
        for t in transformer.state_dict().values():
            t.zero_()  # resident memory, as a loaded model's weights are
    vae = build_vae(TINY_VAE, "cpu", torch.float32)  # not used: the pipeline needs one
    pipe = FakeTextPipeline(transformer, vae, setup, "cpu", torch.bfloat16)
    return SD3RolloutAdapter(pipe, device="cpu", max_sequence_length=setup.text_len)


def applied_checksum(adapter, update, chunk_bytes: int) -> str:
    """The update checksum of the model's live tensors under the update's names."""
    from omnirl.models.weights import full_targets, lora_targets
    from omnirl.protocol.weights import split_update

    targets = (lora_targets if update.format == "lora" else full_targets)(adapter.transformer)
    live = {name: targets[name].detach() for name in update.tensors}
    return split_update(update.version, update.format, live, chunk_bytes=chunk_bytes)[
        0
    ].update_checksum


def default_of(cls, name: str):
    """A dataclass field's default (the configs are slotted: no class attribute)."""
    import dataclasses

    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def model_receiver(weights_addr: str, report_addr: str, model: str, chunk_bytes: int) -> None:
    """A rollout worker's weight path: DEALER, decode, WeightInbox, load_weights."""
    import zmq

    from omnirl.protocol.codec import decode, encode
    from omnirl.protocol.messages import Ack, WeightRequest
    from omnirl.protocol.sockets import SocketFactory, SocketOptions
    from omnirl.rollout.weights_inbox import WeightInbox
    from omnirl.rollout.worker import RolloutWorkerConfig

    report = zmq.Context.instance().socket(zmq.PUSH)
    report.connect(report_addr)
    t = time.time()
    adapter = build_rollout(model)
    report.send_json({"built_s": time.time() - t})
    max_bytes = default_of(RolloutWorkerConfig, "max_bytes")
    sockets = SocketFactory(options=SocketOptions(max_bytes=max_bytes))
    sock = sockets.connect("weights", weights_addr)
    inbox = WeightInbox()
    sock.send_multipart(encode(WeightRequest(worker_id="w0", have_version=-1)))
    while True:
        msg = decode(sock.recv_multipart(copy=False), max_bytes=max_bytes)
        if isinstance(msg, Ack):
            report.send_json({"registered": True})
            continue
        if msg.version < 0:
            break
        done = inbox.add(msg)
        if done is None:
            continue
        received = time.time()
        adapter.load_weights(done.format, done.tensors, adapter_config=done.adapter_config)
        applied = time.time()
        ok = applied_checksum(adapter, done, chunk_bytes) == done.update_checksum
        report.send_json(
            {
                "version": done.version,
                "received": received,
                "applied": applied,
                "verified": ok,
                "rejected_chunks": inbox.rejected_chunks,
            }
        )
        inbox.discard_through(done.version)
        del done
    report.close(linger=1000)
    sockets.close()


def run_model(args) -> int:
    import gc

    import zmq

    from omnirl.models.sd3.lora import lora_kwargs
    from omnirl.protocol.codec import decode, encode
    from omnirl.protocol.sockets import SocketFactory, SocketOptions
    from omnirl.protocol.weights import split_update
    from omnirl.trainer.config import RuntimeConfig
    from omnirl.trainer.publisher import WeightPublisher

    chunk_bytes = int(args.chunk_mb * 2**20)
    lora_config = lora_kwargs(model_setup(args.model)[1].lora)  # the trainer's adapter_config
    max_bytes = default_of(RuntimeConfig, "max_message_bytes")
    options = SocketOptions(max_bytes=max_bytes, linger_ms=0, hwm=0)  # the server's "weights"
    sockets = SocketFactory(options=options)
    router = sockets.bind("weights", "tcp://127.0.0.1:*")
    port = router.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
    reports = sockets.context.socket(zmq.PULL)
    rport = reports.bind_to_random_port("tcp://127.0.0.1")
    proc = mp.get_context("spawn").Process(
        target=model_receiver,
        args=(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}", args.model, chunk_bytes),
    )
    proc.start()

    def report() -> dict:  # the receiver's next report; fails if it died
        while not reports.poll(1000):
            if not proc.is_alive():
                raise SystemExit(f"receiver exited with {proc.exitcode}")
        return reports.recv_json()

    t = time.time()
    state = {"full": export_like(args.model, "full"), "lora": export_like(args.model, "lora")}
    source_s = time.time() - t
    built = report()
    first = WeightPublisher(chunk_bytes=chunk_bytes, format="full", adapter_config=None)
    peer, *frames = router.recv_multipart(copy=False)  # WeightRequest -> Ack (registered)
    first.handle_request(router, peer.bytes, decode(frames))
    assert report().get("registered")
    print(
        json.dumps(
            {"model": args.model, "receiver_build_s": round(built["built_s"], 2)}
            | {"source_s": round(source_s, 2)}
        ),
        flush=True,
    )
    rows, version = [], 0
    plan = [("full", args.full_repeats, True), ("lora", 1, False), ("lora", args.repeats, True)]
    for fmt, repeats, timed in plan:
        for _ in range(repeats):
            version += 1
            pub = WeightPublisher(
                chunk_bytes=chunk_bytes,
                format=fmt,
                adapter_config=lora_config if fmt == "lora" else None,
            )
            pub.peers[peer.bytes] = -1
            t0 = time.time()
            pub.publish(router, version, state[fmt])
            r = report()
            assert r["version"] == version and r["verified"], r
            if timed:
                applied = r["applied"] - t0
                row = {
                    "model": args.model,
                    "format": fmt,
                    "version": version,
                    "tensors": len(state[fmt]),
                    "bytes": pub.total_bytes,
                    "chunks": pub.num_chunks,
                    "prepare_s": round(pub.last_prepare_s, 4),
                    "received_s": round(r["received"] - t0, 4),
                    "applied_s": round(applied, 4),
                    "gb_per_s": round(pub.total_bytes / applied / 1e9, 3),
                    "verified": r["verified"],
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
            del pub
            gc.collect()
        if fmt == "full":
            del state["full"]
            gc.collect()
    stop = encode(split_update(-1, "lora", {}, chunk_bytes=1)[0])
    router.send_multipart([peer.bytes, *stop])
    proc.join(60)
    reports.close(linger=0)
    sockets.close()
    print_model_table(rows)
    return 0 if proc.exitcode == 0 else 1


def print_model_table(rows: list[dict]) -> None:
    print()
    print("| format | tensors | MB | chunks | prepare s | received s | applied s | GB/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for fmt in ("lora", "full"):
        mine = [r for r in rows if r["format"] == fmt]
        if not mine:
            continue
        med = {k: statistics.median(r[k] for r in mine) for k in mine[0] if k.endswith("_s")}
        print(
            f"| {fmt} | {mine[0]['tensors']} | {mine[0]['bytes'] / 1e6:,.2f} | "
            f"{mine[0]['chunks']} | {med['prepare_s']:.3f} | {med['received_s']:.3f} | "
            f"{med['applied_s']:.3f} | {statistics.median(r['gb_per_s'] for r in mine):.2f} |"
        )
    counts = {fmt: sum(r["format"] == fmt for r in rows) for fmt in ("lora", "full")}
    print(f"\n(medians over {counts['lora']} LoRA and {counts['full']} full versions)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--chunk-mb", type=float, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--model",
        choices=("sd35m", "tiny"),
        default=None,
        help="push a real model's LoRA r32 and full weights to a receiver that applies them",
    )
    p.add_argument("--full-repeats", type=int, default=2, help="with --model: full versions")
    args = p.parse_args(argv)
    if args.model:
        return run_model(args)

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
