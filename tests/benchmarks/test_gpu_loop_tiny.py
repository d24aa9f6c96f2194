"""``benchmarks/gpu_loop.py``: the whole launch on the CPU (``--tiny``), a summary recomputed from
a run's files, and the device setup script."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


@pytest.mark.slow
def test_tiny_loop_writes_a_steady_state_summary(tmp_path):
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "gpu_loop.py"),
        "--tiny",
        "--device",
        "cpu",
        "--no-compile",
        "--minutes",
        "2",
        "--max-steps",
        "5",
        "--attention",
        "math",
        "--micro",
        "2",
        "--float8",
        "static",
        "--float8-recalibrate-every",
        "2",
        "--train-float8",
        "static",
        "--decode-batch",
        "3",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "gpu_loop.json").read_text())
    assert summary["launch_exit"] == 0 and summary["steps"] == 5
    assert summary["steady_steps"] == 2 and summary["images_per_s"] > 0
    assert summary["steady_samples"] == 2 * 2 * 8  # 2 steps x 2 groups x 8 samples
    assert summary["publish_s_median"] > 0 and summary["leases"] >= 10
    assert summary["rollout_device"] == "cpu"  # read back from the worker's own log
    # the first group from the launcher's start: the worker's imports come before its log
    assert summary["rollout_first_group_after_launch_s"] > summary["rollout_first_group_s"] > 0
    config = (tmp_path / "gpu_loop.yaml").read_text()
    assert "attention: math" in config and "micro_batch_size: 2" in config
    started = [
        x for x in (tmp_path / "launch.log").read_text().splitlines() if "started rollout" in x
    ]
    assert len(started) == 1 and "--attention math" in started[0]  # the worker got the kernel
    assert "--float8 static" in started[0]
    worker_log = (tmp_path / "run" / "logs" / "rollout-0.log").read_text()
    assert "float8 linear layers:" in worker_log  # converted, then sampled the whole run
    assert "--decode-batch 3" in started[0] and "at most 3 images per VAE call" in worker_log
    assert "(activations static)" in worker_log
    # the first lease calibrates, then the lease after every second LoRA update (the worker
    # may skip a version; a request after its last lease is never carried out)
    applied = worker_log.count("format=lora")
    calibrations = worker_log.count("layers calibrated")
    assert 2 <= calibrations <= 1 + applied // 2
    assert summary["float8_calibrations"] == calibrations
    assert "recalibrating the static scales on the next lease" in worker_log
    assert summary["float8_input_growth_max"] > 0  # each later calibration says how far
    # the trainer in float8 too: static scales calibrated at its first step, then after
    # every second update (5 steps: updates 0, 2, 4)
    assert "float8: true" in config and "float8_activation: static" in config
    trainer_log = (tmp_path / "run" / "logs" / "trainer.log").read_text()
    assert summary["trainer_float8_calibrations"] == trainer_log.count("layers calibrated") == 3


def test_device_env_registers_every_entry_point_without_installing(tmp_path):
    site = tmp_path / "site"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMNIRL_SITE"] = str(site)
    env["OMNIRL_WHEELS"] = str(tmp_path / "no_wheels")  # nothing to install here
    proc = subprocess.run(
        ["bash", "-c", ". benchmarks/device_env.sh && echo $PYTHONPATH"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    path = proc.stdout.strip().split(":")
    assert str(site) in path and str(ROOT / "packages" / "trainer" / "src") in path
    infos = {p.name.split("-")[0]: p for p in site.glob("*.dist-info")}
    assert {"omnirl_models", "omnirl_trainer", "omnirl_rollout", "omnirl_tools"} <= set(infos)
    models = (infos["omnirl_models"] / "entry_points.txt").read_text()
    assert "[omnirl.models]" in models and "sd3 = omnirl.models.sd3" in models
    trainer = (infos["omnirl_trainer"] / "entry_points.txt").read_text()
    assert "[console_scripts]" in trainer and "trainer = omnirl.trainer.cli:main" in trainer


def test_summarize_only_recomputes_a_run_cut_short_before_its_summary(tmp_path, benchmark_script):
    """The twelfth GPU session's fallback loop (its command's timeout cut the summary): the
    committed metrics give the documented 2.171 images/s and the fallback to micro-batch 8."""
    metrics = RESULTS / "gpu_session12_2026-12-06" / "loop_micro16_fallback" / "metrics.jsonl"
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text(metrics.read_text())
    gpu_loop = benchmark_script("gpu_loop")
    assert gpu_loop.main(["--summarize-only", "--out", str(tmp_path), "--device", "cpu"]) == 0
    summary = json.loads((tmp_path / "gpu_loop.json").read_text())
    assert summary["images_per_s"] == 2.171 and summary["steady_steps"] == 19
    assert summary["micro_batch_fallbacks"] == 1 and summary["micro_batch_size"] == 8


def summary_of(
    tmp_path, benchmark_script, metrics: str, worker_log: str, launched_at: float | None = None
) -> dict:
    """``gpu_loop --summarize-only`` on a run directory holding ``metrics``, the worker's
    log and, if given, the launcher's start time."""
    if launched_at is not None:
        (tmp_path / "launched_at").write_text(f"{launched_at}\n")
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(metrics)
    (run / "logs" / "rollout-0.log").write_text(worker_log)
    gpu_loop = benchmark_script("gpu_loop")
    assert gpu_loop.main(["--summarize-only", "--out", str(tmp_path), "--device", "cpu"]) == 0
    return json.loads((tmp_path / "gpu_loop.json").read_text())


def test_summary_reports_the_trainer_and_worker_memory_peaks(tmp_path, benchmark_script):
    """The most memory the trainer held in any step (its metrics) and the worker in any
    lease (its log): what says whether a micro-batch fits beside the worker."""
    metrics = RESULTS / "gpu_session12_2026-12-06" / "loop_micro16_fallback" / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    steps = [i for i, line in enumerate(lines) if '"num_samples"' in line]
    for i, (alloc, reserved) in zip(steps[:2], [(40.5, 44.0), (51.25, 56.5)], strict=True):
        row = json.loads(lines[i])
        row.update(device_peak_allocated_gb=alloc, device_peak_reserved_gb=reserved)
        lines[i] = json.dumps(row)
    worker_log = (
        "w: lease a done at version 0 in 9.10 s (device memory peak 12.40 GB allocated, "
        "14.00 GB reserved)\n"
        "w: lease b done at version 1 in 1.90 s (device memory peak 11.00 GB allocated, "
        "15.50 GB reserved)\n"
    )
    summary = summary_of(tmp_path, benchmark_script, "\n".join(lines) + "\n", worker_log)
    assert summary["trainer_peak_allocated_gb"] == 51.25
    assert summary["trainer_peak_reserved_gb"] == 56.5
    assert summary["rollout_peak_allocated_gb"] == 12.4
    assert summary["rollout_peak_reserved_gb"] == 15.5
    assert summary["leases"] == 2


def test_activation_memory_budget_reaches_the_trainer_config(tmp_path, benchmark_script):
    """``--activation-memory-budget`` is the run's ``train.activation_memory_budget``, a key
    the trainer accepts (with its compile on) as far as its step's settings, where it once
    stopped the trainer at start-up."""
    from omnirl.trainer.backend import train_step_config
    from omnirl.trainer.config import load_config

    gpu_loop = benchmark_script("gpu_loop")
    argv = [
        "--tiny",
        "--device",
        "cpu",
        "--out",
        str(tmp_path),
        "--activation-memory-budget",
        "0.6",
    ]
    config = gpu_loop.write_config(gpu_loop.parse_args(argv), tmp_path / "model", tmp_path)
    cfg = load_config(config)
    assert cfg.train.activation_memory_budget == 0.6
    train_step_config(cfg)  # raised ConfigError while the key leaked into TrainStep.Config
    unset = gpu_loop.write_config(gpu_loop.parse_args(argv[:-2]), tmp_path / "model", tmp_path)
    assert load_config(unset).train.activation_memory_budget is None


def test_summary_reports_the_workers_start_up(tmp_path, benchmark_script):
    """Model ready, warm-up and the first group after the worker's first log line: what a
    second run on the same ``--compile-cache`` measures as a warm start (issue 9, item 7)."""
    metrics = RESULTS / "gpu_session12_2026-12-06" / "loop_micro16_fallback" / "metrics.jsonl"
    worker_log = (
        "2026-12-07 15:14:06,045 INFO omnirl.rollout: rollout-0: attention cudnn\n"
        "2026-12-07 15:14:08,000 INFO omnirl.models.compile: loaded compile cache /c/artifacts.bin\n"
        "2026-12-07 15:14:40,100 INFO omnirl.rollout: compiled backend warmed up in 21.5 s\n"
        "2026-12-07 15:14:40,200 INFO omnirl.rollout: rollout-0: model ready in 34.2 s\n"
        "2026-12-07 15:14:47,545 INFO omnirl.rollout: rollout-0: lease r:g0:l0 done at version 0 "
        "in 7.30 s\n"
        "2026-12-07 15:14:50,000 INFO omnirl.rollout: rollout-0: lease r:g0:l1 done at version 0 "
        "in 2.30 s\n"
    )
    # the launcher started 5.2 s before the worker's first log line (its imports)
    launched_at = datetime.datetime(2026, 12, 7, 15, 14, 0, 845000).timestamp()
    summary = summary_of(
        tmp_path, benchmark_script, metrics.read_text(), worker_log, launched_at=launched_at
    )
    assert summary["rollout_cache_loaded"] is True
    assert summary["rollout_model_ready_s"] == 34.2 and summary["rollout_warmup_s"] == 21.5
    assert summary["rollout_first_group_s"] == 41.5  # 15:14:06.045 -> 15:14:47.545
    assert summary["rollout_first_group_after_launch_s"] == 46.7  # from 15:14:00.845


def test_compile_cache_is_the_runs_own_unless_given(tmp_path, benchmark_script):
    gpu_loop = benchmark_script("gpu_loop")
    base = ["--tiny", "--device", "cpu", "--out", str(tmp_path)]
    own = gpu_loop.write_config(gpu_loop.parse_args(base), tmp_path / "model", tmp_path)
    assert f"compile_cache: {tmp_path / 'compile_cache'}" in own.read_text()
    shared = tmp_path / "shared_cache"
    args = gpu_loop.parse_args([*base, "--compile-cache", str(shared)])
    given = gpu_loop.write_config(args, tmp_path / "model", tmp_path)
    assert f"compile_cache: {shared}" in given.read_text()
