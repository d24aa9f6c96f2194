"""Transport benchmark: a ~64 MB DiffusionTrajectoryGroup between two processes.

The receiver (this process) binds a ``control`` ROUTER on tcp loopback or ipc; a sender
process (multiprocessing, spawn) connects a DEALER. For each run the receiver asks for one
message and times from the request to the fully decoded message, so a run covers the
sender's encode + send and the receiver's recv + decode (plus one tiny request, ~50 us).
Modes, interleaved run by run so that background load hits them alike:

- ``omnirl``: ``send_message`` / ``recv_message`` with the default finite checks;
- ``omnirl, no finite check``: the same with ``check_finite=False`` on both sides;
- ``raw pyzmq``: the same frames pre-encoded, ``send_multipart`` / ``recv_multipart``
  with ``copy=False``, no decode;
- ``memcpy`` (in this process): ``numpy.copyto`` into a preallocated buffer, and
  ``torch.clone`` (fresh memory: page faults included, as a receive has) of the bytes.

Each is measured twice in one run (``--allocator both``): with glibc's default allocator,
then with ``omnirl.protocol.memory.retain_freed_memory`` in both processes, as the trainer,
rollout and reward processes run.

"receiver CPU ms" is the receiving process's CPU time per message (all its threads, the
ZeroMQ I/O thread included; median): less sensitive than wall time to other load.

Copies on decode are counted, not assumed: a decoded tensor whose memory does not lie
inside one of the received frames is a copy.

    uv run python benchmarks/transport.py                 # tcp and ipc, 10 runs
    uv run python benchmarks/transport.py --write-docs    # also update docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from omnirl.protocol.codec import encode
from omnirl.protocol.memory import retain_freed_memory
from omnirl.protocol.messages import DiffusionTrajectoryGroup, PromptSpec, SamplingParams
from omnirl.protocol.sockets import (
    SocketFactory,
    SocketOptions,
    bound_endpoint,
    recv_message,
    send_message,
)

DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
BEGIN, END = "<!-- transport:begin -->", "<!-- transport:end -->"
MODES = {b"omnirl": "omnirl encode+send / recv+decode", b"nocheck": "omnirl, no finite check"}
RAW = b"raw"
OPTIONS = SocketOptions(max_bytes=1 << 30, linger_ms=0)


def make_group(size_mb: float) -> DiffusionTrajectoryGroup:
    """G=8 samples, K=4 steps, latents and next_latents float32 [8, 4, 16, H, H]."""
    g, k, c = 8, 4, 16
    side = max(1, round((size_mb * 2**20 / (2 * 4 * g * k * c)) ** 0.5))
    gen = torch.Generator().manual_seed(0)
    return DiffusionTrajectoryGroup(
        group_id="bench",
        lease_id="bench",
        worker_id="sender",
        prompt=PromptSpec(group_id="bench", text="a benchmark"),
        sampling=SamplingParams(group_size=g, num_steps=10, height=side * 8, width=side * 8),
        policy_version=0,
        seeds=torch.arange(g, dtype=torch.int64),
        step_indices=torch.arange(k, dtype=torch.int64),
        timesteps=torch.linspace(1000, 100, k),
        sigmas=torch.linspace(1, 0.1, k),
        next_sigmas=torch.linspace(0.9, 0.0, k),
        latents=torch.randn(g, k, c, side, side, generator=gen),
        next_latents=torch.randn(g, k, c, side, side, generator=gen),
        log_probs=torch.randn(g, k, generator=gen),
        prompt_embeds=torch.randn(77, 64, generator=gen),
        pooled_prompt_embeds=torch.randn(64, generator=gen),
    )


# --------------------------------------------------------------------------------- sender


def sender(endpoints: list[str], size_mb: float, retain: bool) -> None:
    """Child process: on each endpoint in turn, answer each request with one message."""
    torch.set_num_threads(1)
    if retain:
        retain_freed_memory()
    group = make_group(size_mb)
    raw_frames = encode(group)
    with SocketFactory(options=OPTIONS) as sockets:
        for endpoint in endpoints:
            sock = sockets.connect("control", endpoint)
            sock.send(b"ready")
            while (cmd := sock.recv()) != b"stop":
                if cmd == RAW:
                    sock.send_multipart(raw_frames, copy=False)
                else:
                    send_message(sock, group, check_finite=cmd == b"omnirl")


# ------------------------------------------------------------------------------- receiver


def tensors_of(msg: DiffusionTrajectoryGroup) -> list[torch.Tensor]:
    found = []
    for name in msg.__struct_fields__:
        value = getattr(msg, name)
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, dict):
            found.extend(v for v in value.values() if isinstance(v, torch.Tensor))
    return found


def count_copies(msg: DiffusionTrajectoryGroup, frames: list) -> tuple[int, int]:
    """(tensors, tensors whose memory is not inside a received frame); empty ones skipped."""
    spans = []
    for frame in frames:
        view = np.frombuffer(frame.buffer, dtype=np.uint8)
        if view.size:
            spans.append((view.ctypes.data, view.ctypes.data + view.size))
    tensors = [t for t in tensors_of(msg) if t.numel()]
    copies = 0
    for t in tensors:
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        copies += not any(lo <= start and end <= hi for lo, hi in spans)
    return len(tensors), copies


def time_memcpy(nbytes: int, runs: int) -> tuple[float, float]:
    """Median GB/s of numpy.copyto into a preallocated buffer, and of torch.clone."""
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    copy_s, clone_s = [], []
    src_t = torch.from_numpy(src)
    for _ in range(runs + 1):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        copy_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        clone = src_t.clone()
        clone_s.append(time.perf_counter() - t0)
        del clone
    return nbytes / statistics.median(copy_s[1:]) / 1e9, nbytes / statistics.median(
        clone_s[1:]
    ) / 1e9


def measure(sock, runs: int, warmup: int) -> dict:
    """Median GB/s per mode and the decode copy count, against the sender behind ``sock``."""
    if not sock.poll(120_000):
        raise RuntimeError("the sender process did not connect within 120 s")
    peer, _ = sock.recv_multipart()
    seconds: dict[bytes, list[float]] = {mode: [] for mode in (*MODES, RAW)}
    cpu: dict[bytes, list[float]] = {mode: [] for mode in seconds}
    nbytes = copies = tensors = 0
    for run in range(warmup + runs):
        for mode in seconds:
            t0, c0 = time.perf_counter(), time.process_time()
            sock.send_multipart([peer, mode])
            if mode == RAW:
                frames = sock.recv_multipart(copy=False)[1:]
                elapsed, cpu_s = time.perf_counter() - t0, time.process_time() - c0
            else:
                got = recv_message(sock, check_finite=mode == b"omnirl")
                msg, frames = got.unwrap(), got.frames
                elapsed, cpu_s = time.perf_counter() - t0, time.process_time() - c0
                tensors, run_copies = count_copies(msg, frames)
                copies = max(copies, run_copies)
                del msg, got
            nbytes = sum(len(f) for f in frames)
            del frames
            if run >= warmup:
                seconds[mode].append(elapsed)
                cpu[mode].append(cpu_s)
    sock.send_multipart([peer, b"stop"])
    rates = {mode: nbytes / statistics.median(s) / 1e9 for mode, s in seconds.items()}
    spread = {mode: (nbytes / max(s) / 1e9, nbytes / min(s) / 1e9) for mode, s in seconds.items()}
    return {
        "rates": rates,
        "spread": spread,
        "cpu_ms": {mode: 1e3 * statistics.median(c) for mode, c in cpu.items()},
        "nbytes": nbytes,
        "copies": copies,
        "tensors": tensors,
    }


def measure_all(
    transports: list[str], size_mb: float, runs: int, warmup: int, retain: bool
) -> dict:
    """One sender process serves each transport in turn ("tcp": loopback, "ipc").

    ``retain``: both processes run with :func:`retain_freed_memory` (as the omnirl
    processes do); the receiver must not have called it before a ``retain=False`` run."""
    if retain:
        retain_freed_memory()
    tmp = tempfile.mkdtemp(prefix="omnirl-bench-")
    addresses = {"tcp": "tcp://127.0.0.1:*", "ipc": f"ipc://{tmp}/bench.sock"}
    try:
        with SocketFactory(options=OPTIONS) as sockets:
            socks = {t: sockets.bind("control", addresses[t]) for t in transports}
            endpoints = [bound_endpoint(sock) for sock in socks.values()]
            child = mp.get_context("spawn").Process(
                target=sender, args=(endpoints, size_mb, retain), daemon=True
            )
            child.start()
            results = {t: measure(sock, runs, warmup) for t, sock in socks.items()}
            child.join(30)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return results


# --------------------------------------------------------------------------------- report


ALLOCATORS = {False: "glibc default", True: "retain freed memory"}


def table(
    results: dict[bool, dict[str, dict]], memcpy: tuple[float, float], runs: int, load: str
) -> str:
    first = next(iter(next(iter(results.values())).values()))
    nbytes = first["nbytes"]
    lines = [
        f"Message: {nbytes / 1e6:.1f} MB ({nbytes / 2**20:.1f} MiB) in "
        f"{first['tensors']} tensor frames + header; "
        f"median of {runs} runs (range: slowest to fastest run), GB/s = 1e9 bytes/s.",
        "",
        "| allocator | transport | path | median GB/s | range GB/s | receiver CPU ms |",
        "|---|---|---|---:|---:|---:|",
    ]
    for retain, by_transport in results.items():
        for transport, r in by_transport.items():
            for mode, label in (*MODES.items(), (RAW, "raw pyzmq multipart, copy=False")):
                lo, hi = r["spread"][mode]
                lines.append(
                    f"| {ALLOCATORS[retain]} | {transport} | {label} | {r['rates'][mode]:.2f} "
                    f"| {lo:.2f}-{hi:.2f} | {r['cpu_ms'][mode]:.0f} |"
                )
    lines.append(f"| | in-process | memcpy (numpy.copyto, preallocated) | {memcpy[0]:.2f} | | |")
    lines.append(f"| | in-process | torch.clone (fresh memory) | {memcpy[1]:.2f} | | |")
    copies = ", ".join(
        f"{t} ({ALLOCATORS[a]}): {r['copies']} of {r['tensors']}"
        for a, by_transport in results.items()
        for t, r in by_transport.items()
    )
    lines += ["", f"Copies on decode (tensors not inside a received frame): {copies}."]
    lines.append(
        f"Load average before the run (1, 5, 15 min): {load} on {os.cpu_count()} CPUs "
        "(other work on the machine; the benchmark itself adds two busy processes)."
    )
    return "\n".join(lines)


def write_docs(text: str, command: str) -> None:
    block = f"{BEGIN}\nCommand: `{command}`\n\n{text}\n{END}"
    doc = DOCS.read_text()
    if BEGIN in doc and END in doc:
        head, rest = doc.split(BEGIN, 1)
        doc = head + block + rest.split(END, 1)[1]
    else:
        doc = doc.rstrip("\n") + "\n\n" + block + "\n"
    DOCS.write_text(doc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=64.0, help="tensor MiB per message")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--transports", default="tcp,ipc")
    parser.add_argument(
        "--allocator",
        choices=("both", "default", "retain"),
        default="both",
        help="glibc default, retain_freed_memory (as omnirl processes run), or both in turn",
    )
    parser.add_argument("--write-docs", action="store_true", help=f"update {DOCS.name}")
    args = parser.parse_args(argv)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    settings = {"both": (False, True), "default": (False,), "retain": (True,)}[args.allocator]
    transports = args.transports.split(",")
    results = {
        retain: measure_all(transports, args.size_mb, args.runs, args.warmup, retain)
        for retain in settings  # default first: retain_freed_memory cannot be undone
    }
    nbytes = next(iter(results[settings[0]].values()))["nbytes"]
    text = table(results, time_memcpy(nbytes, args.runs), args.runs, load)
    print(text)
    if args.write_docs:
        write_docs(text, "uv run python benchmarks/transport.py " + " ".join(argv or sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
