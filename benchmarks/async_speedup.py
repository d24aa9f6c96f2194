"""Async speed-up: optimisation steps per minute at ``max_staleness=1`` against ``0``.

Real processes on loopback: the real trainer server (ledger, leases, staleness rule,
weight publishing), one real rollout worker loop, one real reward worker (JPEG scoring).
Only the two costs are synthetic and equal: the trainer backend's ``step`` and the rollout
adapter's ``sample`` *sleep* (``--train-s`` per step; ``--sample-s`` per prompt group, and
a step needs ``groups_per_step`` groups), standing for work on separate devices (a trainer
GPU, a rollout GPU). On this shared 2-core box real compute in both processes would fight
for the same two cores, and the ratio would measure the CPU scheduler, not the runtime.

Synchronous (K=0): a step's groups are sampled, then trained, in turn: about
``train + groups * sample`` per step. Asynchronous (K=1): the next batch is sampled while
the current one trains: about ``max(train, groups * sample)``. Ideal ratio 2.0 at equal cost.

    uv run python benchmarks/async_speedup.py            # prints a table; --write updates docs
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DOC = ROOT / "docs" / "benchmarks.md"

TRAINER = textwrap.dedent(
    """
    import logging, sys, time, torch
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from omnirl.trainer.config import load_config
    from omnirl.trainer.server import TrainerServer

    class SleepBackend:
        architecture, model_path, sde_type = "SleepPipeline", "/synthetic", "sde"
        weight_format, adapter_config, adapter, train_step = "full", {}, None, None
        def __init__(self, train_s):
            self.train_s, self.w = train_s, torch.zeros(1024)
        def export_weights(self):
            return {"w": self.w.clone()}
        def step(self, groups, *, policy_version, lr_scale=1.0):
            time.sleep(self.train_s)
            self.w += 1
            return {"wall_time": time.time()}

    cfg = load_config(sys.argv[1], sys.argv[3:])
    sys.exit(TrainerServer(cfg, SleepBackend(float(sys.argv[2]))).run())
    """
)

ROLLOUT = textwrap.dedent(
    """
    import logging, sys, time, torch
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from omnirl.models.registry import register_rollout_adapter
    from omnirl.protocol.messages import DiffusionTrajectoryGroup
    from omnirl.rollout.worker import RolloutWorker, RolloutWorkerConfig

    SAMPLE_S = float(sys.argv[2])

    @register_rollout_adapter("SleepPipeline")
    class SleepAdapter:
        @classmethod
        def from_pretrained(cls, path, *, device, dtype, lora):
            return cls()
        def load_weights(self, format, tensors):
            pass
        def sample(self, prompts, sampling, *, lease_id, worker_id, policy_version):
            out = []
            for p in prompts:
                time.sleep(SAMPLE_S)
                g = sampling.group_size
                gen = torch.Generator().manual_seed(sampling.seed)
                out.append(DiffusionTrajectoryGroup(
                    group_id=p.group_id, lease_id=lease_id, worker_id=worker_id, prompt=p,
                    sampling=sampling, policy_version=policy_version, seeds=torch.arange(g),
                    log_probs=torch.zeros(g, 1),
                    images=torch.randint(0, 256, (g, 32, 32, 3), dtype=torch.uint8, generator=gen)))
            return out

    worker = RolloutWorker(RolloutWorkerConfig(trainer=sys.argv[1], worker_id="rollout-0"))
    sys.exit(worker.run())
    """
)


def run_mode(staleness: int, args, workdir: Path) -> dict:
    out = workdir / f"k{staleness}"
    overrides = [
        f"run.output_dir={out}", "model.path=/synthetic", "model.lora=null",
        f"data.prompts={ROOT / 'examples/prompts/animals.jsonl'}", "data.group_size=2",
        f"train.groups_per_step={args.groups}", f"train.max_staleness={staleness}",
        f"max_steps={args.steps}", "runtime.control_port=0", "runtime.shutdown_grace_s=1",
        "logging.progress_bar=false", "logging.tensorboard=false", "checkpoint.every=0",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    config = ROOT / "examples" / "tiny_sd3_jpeg.yaml"

    def spawn(name, argv):
        f = open(logs / f"{name}.log", "wb")  # noqa: SIM115
        return subprocess.Popen(
            argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    trainer = spawn(
        "trainer", [sys.executable, "-c", TRAINER, str(config), str(args.train_s), *overrides]
    )
    procs = [trainer]
    try:
        deadline = time.monotonic() + 120
        while not (out / "trainer.addr").exists():
            if trainer.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"trainer did not start: {(logs / 'trainer.log').read_text()[-2000:]}"
                )
            time.sleep(0.1)
        address = (out / "trainer.addr").read_text().strip()
        procs.append(
            spawn("reward", [str(BIN / "reward"), "--trainer", address, "--worker-id", "reward-0"])
        )
        procs.append(spawn("rollout", [sys.executable, "-c", ROLLOUT, address, str(args.sample_s)]))
        code = trainer.wait(
            args.steps * (args.train_s + args.groups * args.sample_s) * 3 + 420
        )  # start-up is slow on a loaded box
        if code != 0:
            raise RuntimeError(f"trainer exited {code}")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            p.wait(30)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    t = [r["wall_time"] for r in rows]
    w = args.warmup
    per_min = 60.0 * (len(t) - 1 - w) / (t[-1] - t[w])
    return {
        "staleness": staleness,
        "steps_per_min": per_min,
        "staleness_mean": sum(r["staleness_mean"] for r in rows[w:]) / len(rows[w:]),
        "stale_dropped": rows[-1].get("ledger/groups_stale", 0.0),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train-s", type=float, default=1.0, help="seconds per optimisation step")
    p.add_argument("--sample-s", type=float, default=0.25, help="seconds per prompt group")
    p.add_argument("--groups", type=int, default=4, help="groups per step")
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the rate")
    p.add_argument("--write", action="store_true", help="write the table into docs/benchmarks.md")
    p.add_argument("--workdir", type=Path, default=None, help="keep the runs' logs here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        results = [run_mode(k, args, workdir) for k in (0, 1)]
    sync, asyn = results
    ratio = asyn["steps_per_min"] / sync["steps_per_min"]
    load = os.getloadavg()[0]
    lines = [
        f"train {args.train_s:g} s/step, sampling {args.sample_s:g} s/group x {args.groups} "
        f"groups/step ({args.groups * args.sample_s:g} s/step), {args.steps} steps, first "
        f"{args.warmup} left out; load average {load:.1f}",
        "",
        "| max_staleness | steps / min | mean staleness | stale groups dropped |",
        "|---|---|---|---|",
        *(
            f"| {r['staleness']} | {r['steps_per_min']:.1f} | {r['staleness_mean']:.2f} "
            f"| {int(r['stale_dropped'])} |"
            for r in results
        ),
        "",
        f"speed-up K=1 / K=0: **{ratio:.2f}x** (ideal 2.0x at equal cost; goal >= 1.8x)",
    ]
    text = "\n".join(lines)
    print(text)
    if args.write:
        doc = DOC.read_text()
        begin, end = "<!-- async_speedup:begin -->", "<!-- async_speedup:end -->"
        if begin in doc:
            head, rest = doc.split(begin, 1)
            doc = head + begin + "\n" + text + "\n" + end + rest.split(end, 1)[1]
            DOC.write_text(doc)
        else:
            print("docs/benchmarks.md has no async_speedup section", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
