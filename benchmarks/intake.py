"""Trainer intake throughput: scored groups per second absorbed from many sender processes.

The real :class:`~omnirl.trainer.server.TrainerServer` runs (sockets, codec, ledger,
exactly-once intake, leases, step scheduling, weight publishing of a tiny model-free
"policy"); only the optimisation step is a no-op, so what is measured is the trainer's
own per-group cost. Each sender process registers as a rollout worker, takes leases of
``--lease-size`` prompt groups and PUSHes one scored, header-only group per prompt
(``seeds`` [G] and ``rewards`` are the only payload) to the intake.

    uv run python benchmarks/intake.py --senders 8 --groups 40000

Prints one JSON line: accepted groups, seconds, groups/s, and the ledger's counters
(duplicates, rejections: all should be 0).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import threading
import time
from pathlib import Path


class NullBackend:
    architecture, model_path, sde_type = "Null", "", "sde"
    weight_format, adapter_config = "lora", {}
    adapter = train_step = None

    def export_weights(self):
        import torch

        return {"w": torch.zeros(16)}

    def step(self, groups, *, policy_version, lr_scale=1.0):
        return {"groups": float(len(groups))}


def sender(address: str, worker_id: str, quota: int, lease_size: int, group_size: int) -> None:
    import torch
    import zmq

    from omnirl.protocol.codec import decode, encode
    from omnirl.protocol.messages import (
        DiffusionTrajectoryGroup,
        Hello,
        Lease,
        LeaseRequest,
        Rewards,
    )

    ctx = zmq.Context()
    control = ctx.socket(zmq.DEALER)
    control.connect(address)

    def ask(msg):
        control.send_multipart(encode(msg))
        return decode(control.recv_multipart())

    welcome = ask(Hello(role="rollout", worker_id=worker_id))
    push = ctx.socket(zmq.PUSH)
    push.connect(welcome.topology.intake)
    seeds = torch.arange(group_size, dtype=torch.int64)
    sent = 0
    while sent < quota:
        lease = ask(LeaseRequest(worker_id=worker_id, capacity=min(lease_size, quota - sent)))
        if not isinstance(lease, Lease):
            time.sleep(0.002)
            continue
        for prompt in lease.prompts:
            group = DiffusionTrajectoryGroup(
                group_id=prompt.group_id,
                lease_id=lease.lease_id,
                worker_id=worker_id,
                prompt=prompt,
                sampling=lease.sampling,
                policy_version=lease.policy_version,
                seeds=seeds,
                rewards=Rewards(group_id=prompt.group_id, total=[0.5] * group_size),
            )
            push.send_multipart(encode(group), copy=False)
        sent += len(lease.prompts)
    push.close(linger=-1)  # deliver everything, however slow the trainer is
    control.close(linger=0)
    ctx.term()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--senders", type=int, default=8)
    p.add_argument("--groups", type=int, default=40_000, help="total groups sent")
    p.add_argument("--lease-size", type=int, default=500)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--groups-per-step", type=int, default=1000)
    args = p.parse_args(argv)

    import zmq

    from omnirl.protocol.codec import decode, encode
    from omnirl.protocol.messages import Hello
    from omnirl.trainer.config import load_config
    from omnirl.trainer.server import ADDRESS_FILE, TrainerServer

    tmp = Path(tempfile.mkdtemp(prefix="intake-bench-"))
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(5000)))
    cfg = load_config(
        None,
        [
            "model.path=unused",
            f"data.prompts={prompts}",
            f"data.group_size={args.group_size}",
            f"data.prompts_per_lease={args.lease_size}",
            f"run.output_dir={tmp / 'run'}",
            "runtime.control_port=0",
            "runtime.heartbeat_timeout_s=600",
            "runtime.shutdown_grace_s=0.1",
            f"train.groups_per_step={args.groups_per_step}",
            "train.max_staleness=1000",
            "logging.tensorboard=false",
            "logging.progress_bar=false",
            "max_steps=1000000",
        ],
    )
    server = TrainerServer(cfg, NullBackend())
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    addr_file = tmp / "run" / ADDRESS_FILE
    while not addr_file.exists() or not addr_file.read_text().strip():
        time.sleep(0.05)
    address = addr_file.read_text().strip()
    ctx = zmq.Context()
    reward = ctx.socket(zmq.DEALER)
    reward.connect(address)
    reward.send_multipart(encode(Hello(role="reward", worker_id="r", address="tcp://127.0.0.1:9")))
    decode(reward.recv_multipart())

    quota = args.groups // args.senders
    total = quota * args.senders
    spawn = mp.get_context("spawn")
    procs = [
        spawn.Process(
            target=sender,
            args=(address, f"sender-{i}", quota, args.lease_size, args.group_size),
        )
        for i in range(args.senders)
    ]
    for proc in procs:
        proc.start()
    counters = server.ledger.counters
    while counters["groups_accepted"] == 0:
        time.sleep(0.001)
    t0, n0 = time.perf_counter(), counters["groups_accepted"]
    deadline = time.monotonic() + 300
    while counters["groups_accepted"] < total and time.monotonic() < deadline:
        time.sleep(0.01)
    elapsed = time.perf_counter() - t0
    accepted = counters["groups_accepted"] - n0
    for proc in procs:
        proc.join(30)
    server.request_stop()
    thread.join(30)
    reward.close(linger=0)
    ctx.term()
    out = {
        "senders": args.senders,
        "group_size": args.group_size,
        "lease_size": args.lease_size,
        "groups_accepted": counters["groups_accepted"],
        "seconds": round(elapsed, 3),
        "groups_per_s": round(accepted / elapsed, 1),
        "steps": server.step,
        "received": server.intake.received,
        "duplicates": counters["groups_duplicate"],
        "rejected": dict(server.intake.rejected),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
