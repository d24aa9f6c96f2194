"""Reward worker throughput: scored groups per second, and the forwarding overhead.

``uv run python benchmarks/rewards.py [--groups 40] [--group-size 4]``

Every measurement sends real multipart messages over loopback TCP through
PUSH -> PULL -> (work) -> PUSH -> PULL, one group per message, each carrying 256x256 images
and the usual large tensors (latents, next_latents: float32 ``[G, K=2, 16, 32, 32]``):

- ``plain forward``: the middle PULL re-sends the received frames as they are (no decoding);
- ``worker, no-op reward``: ``RewardWorker.process_batch`` with a reward that returns zeros:
  decode the header, build the Rewards, re-encode the header, forward the tensor frames;
- ``worker, jpeg`` / ``worker, ocr``: the same with the real reward (``ocr`` on rendered text).

The plain forward runs once unreported (warm-up), then before and after the worker rows;
each non-OCR row is the best of ``--repeats`` runs; the no-op row minus the mean of the two
plain rows is the worker's forwarding overhead.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import numpy as np
import torch
import zmq
from PIL import Image, ImageDraw, ImageFont

from omnirl.protocol.codec import encode
from omnirl.protocol.messages import DiffusionTrajectoryGroup, PromptSpec, SamplingParams
from omnirl.reward.scorers import ScoreBatch, register_reward
from omnirl.reward.scoring import parse_scorer_spec
from omnirl.reward.worker import RewardWorker, RewardWorkerConfig


@register_reward("bench_noop")
class NoOp:
    components = ("bench_noop",)
    reads = frozenset({"prompt"})
    batchable = True
    thread_safe = True

    def __call__(self, batch: ScoreBatch):
        return {"bench_noop": np.zeros(len(batch))}


WORDS = ["Hello World", "Open Door", "Coffee Shop", "Exit Here", "Big Sale"]


def make_group(i: int, g: int) -> DiffusionTrajectoryGroup:
    word = WORDS[i % len(WORDS)]
    font = ImageFont.load_default(size=40)
    images = []
    for k in range(g):
        image = Image.new("RGB", (256, 256), (255 - 10 * k, 255, 255))
        ImageDraw.Draw(image).text((16, 100), word, fill="black", font=font)
        images.append(np.asarray(image))
    return DiffusionTrajectoryGroup(
        group_id=f"g{i}",
        lease_id="l",
        worker_id="bench",
        prompt=PromptSpec(group_id=f"g{i}", text=f'a sign that says "{word}"'),
        sampling=SamplingParams(group_size=g),
        policy_version=0,
        seeds=torch.arange(g),
        latents=torch.randn(g, 2, 16, 32, 32),
        next_latents=torch.randn(g, 2, 16, 32, 32),
        log_probs=torch.randn(g, 2),
        images=torch.from_numpy(np.stack(images)),
    )


def run_pipeline(messages: list[list], worker: RewardWorker | None, batch: int) -> float:
    """Seconds to move every message through the middle stage (``worker`` None: plain forward)."""
    ctx = zmq.Context()
    source, middle_in = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    middle_out, sink = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    port_in = middle_in.bind_to_random_port("tcp://127.0.0.1")
    port_out = sink.bind_to_random_port("tcp://127.0.0.1")
    source.connect(f"tcp://127.0.0.1:{port_in}")
    middle_out.connect(f"tcp://127.0.0.1:{port_out}")
    received = []

    def drain() -> None:
        for _ in range(len(messages)):
            received.append(sink.recv_multipart(copy=False))

    sink_thread = threading.Thread(target=drain)
    sink_thread.start()
    time.sleep(0.2)  # connections up
    t0 = time.perf_counter()
    for frames in messages:
        source.send_multipart(frames, copy=False)
    done = 0
    while done < len(messages):
        queued = [middle_in.recv_multipart(copy=False)]
        while len(queued) < batch:
            try:
                queued.append(middle_in.recv_multipart(zmq.NOBLOCK, copy=False))
            except zmq.Again:
                break
        done += len(queued)
        outs = queued if worker is None else worker.process_batch(queued)
        for out in outs:
            middle_out.send_multipart(out, copy=False)
    sink_thread.join()
    elapsed = time.perf_counter() - t0
    for sock in (source, middle_in, middle_out, sink):
        sock.close(linger=0)
    ctx.term()
    return elapsed


def worker_for(spec: str, batch: int, threads: int) -> RewardWorker:
    config = RewardWorkerConfig(
        trainer="tcp://127.0.0.1:1",
        scorers=parse_scorer_spec(spec),
        batch_groups=batch,
        score_threads=threads,
    )
    return RewardWorker(config)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", type=int, default=40)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--ocr-groups", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3, help="best of N (not for ocr)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    messages = [encode(make_group(i, args.group_size)) for i in range(args.groups)]
    mb = sum(len(memoryview(f)) if not isinstance(f, bytes) else len(f) for f in messages[0]) / 1e6
    print(f"{args.groups} groups of {args.group_size} images 256x256, {mb:.2f} MB per message")
    print(f"load average before: {os.getloadavg()}")
    run_pipeline(messages, None, 1)  # warm-up (allocator, page faults), not reported
    rows = []
    for name, worker, msgs, batch in [
        ("plain forward (no decode)", None, messages, 1),
        ("worker, no-op reward", worker_for("bench_noop", 1, 1), messages, 1),
        ("worker, jpeg_compressibility", worker_for("jpeg_compressibility", 1, 1), messages, 1),
        (
            "worker, jpeg, batch 8, 2 threads",
            worker_for("jpeg_compressibility", 8, 2),
            messages,
            8,
        ),
        ("plain forward again", None, messages, 1),
        ("worker, ocr", worker_for("ocr", 1, 1), messages[: args.ocr_groups], 1),
        (
            "worker, ocr, batch 4, 2 threads",
            worker_for("ocr", 4, 2),
            messages[: args.ocr_groups],
            4,
        ),
    ]:
        if worker is not None and "ocr" in name:  # build the engines outside the timing
            worker.process_batch(messages[:2])
        repeats = 1 if "ocr" in name else args.repeats
        seconds = min(run_pipeline(msgs, worker, batch) for _ in range(repeats))
        if worker is not None:
            assert worker.counters.refused == 0, name
        rows.append((name, len(msgs), len(msgs) / seconds, 1e3 * seconds / len(msgs)))
    print("| path | groups | groups/s | ms/group |")
    print("| --- | ---: | ---: | ---: |")
    for name, n, rate, ms in rows:
        print(f"| {name} | {n} | {rate:.1f} | {ms:.2f} |")
    plain = (rows[0][3] + rows[4][3]) / 2
    print(f"forwarding overhead of the worker: {rows[1][3] - plain:.2f} ms/group")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
