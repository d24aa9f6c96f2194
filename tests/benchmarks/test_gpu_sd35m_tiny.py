"""``benchmarks/gpu_sd35m.py --tiny`` runs every stage on the CPU and reports each of them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _run_tiny(
    out: Path, *options: str, timeout: float, backend: str = "aot_eager"
) -> dict[str, dict]:
    """Run the benchmark on the toy model on the CPU; its JSONL rows by stage. ``backend``:
    ``aot_eager`` traces forward and backward as inductor would (AOTAutograd, the budget's
    partitioner); ``eager`` only dynamo's graphs (the stages' bookkeeping, a third faster)."""
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "gpu_sd35m.py"),
        "--tiny",
        "--device",
        "cpu",
        "--compile-backend",
        backend,
        "--repeats",
        "1",
        "--out",
        str(out),
        *options,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["stage"]: r for r in map(json.loads, (out / "gpu_sd35m.jsonl").open())}


def test_tiny_run_reports_every_stage(tmp_path):
    # every stage's rows and report; AOTAutograd's tracing of the same trainers is the other
    # tests' (fp8_best below, tests/models/test_compile_backend.py, test_float8_training.py)
    rows = _run_tiny(tmp_path, "--budget-s", "3000", timeout=1800, backend="eager")
    errors = {k: v for k, v in rows.items() if k.endswith(("_error", "_skipped"))}
    assert not errors, errors
    for stage in (
        "ceiling",
        "model",
        "baseline",
        "omnirl_rollout_eager",
        "omnirl_rollout_compiled",
        "omnirl_train_eager",
        "omnirl_train_compiled",
        "omnirl_iteration_kl0",
        "omnirl_iteration_window2",
        "omnirl_train_compiled_kl",
        "omnirl_iteration_same_work",
        "warm_start",
        "omnirl_train_compiled_checkpointing",
        "profile_rollout",
        "profile_train_kl",
        "omnirl_rollout_fp8",
        "profile_rollout_fp8",
        "omnirl_iteration_same_work_fp8",
        "omnirl_rollout_fp8_fast",
        "omnirl_rollout_fp8_static",
        "profile_rollout_fp8_static",
        "omnirl_iteration_same_work_fp8_static",
        "omnirl_rollout_fp8_static_fast",
        "omnirl_train_fp8",
        "omnirl_iteration_same_work_train_fp8",
        "omnirl_train_fp8_fast",
        "omnirl_train_fp8_ref",
        "omnirl_train_fp8_static",
        "omnirl_iteration_same_work_train_fp8_static",
        "omnirl_train_fp8_static_f8grad",
    ):
        assert stage in rows, stage
    for name in ("profile_rollout", "profile_train_kl", "profile_train_fp8_static"):
        # CPU: aten operators' time by kind
        prof = rows[name]
        assert prof["total_ms"] > 0 and prof["launches"] > 0 and prof["top"]
        shares = sum(v for k, v in prof.items() if k.endswith("_share"))
        assert shares == pytest.approx(1.0, abs=0.01)
        assert prof["matmul_share"] > 0
    # float32 on a CPU: the compiled rollout and both trainers run the same arithmetic
    assert rows["omnirl_train_eager"]["parity_max"] < 1e-5
    assert rows["omnirl_iteration_kl0"]["parity_max"] < 1e-5
    # float8 linears: really a different matmul, still close (CPU: torch's emulation)
    assert rows["omnirl_rollout_fp8"]["layers"] > 0
    assert 0 < rows["omnirl_rollout_fp8"]["parity_max"] < 0.1
    static = rows["omnirl_rollout_fp8_static"]
    assert static["activation"] == "static" and static["calibration_s"] > 0
    assert 0 < static["parity_max"] < 0.1
    assert rows["omnirl_rollout_fp8"]["calibration_s"] is None  # row-wise: nothing to calibrate
    assert rows["omnirl_rollout_fp8_static_fast"]["fast_accum"] is True
    # the float8 trainer (forward and input gradient) against the float8 rollout
    assert rows["omnirl_train_fp8"]["layers"] > 0 and rows["omnirl_train_fp8_fast"]["fast_accum"]
    # the last rollout stage left it row-wise float8 too: on the CPU the same arithmetic as
    # the float8 trainer (fast accumulation is a GPU mode), closer than the float32 trainer
    assert rows["omnirl_train_fp8"]["parity_max"] < rows["omnirl_rollout_fp8_fast"]["parity_max"]
    assert rows["omnirl_train_fp8"]["parity_of"].startswith("float8 compiled rollout")
    static = rows["omnirl_train_fp8_static"]
    assert (static["activation"], static["input_grad"], static["scope"]) == (
        "static",
        "model_dtype",
        "all",
    )
    assert 0 < static["parity_max"] < 0.1 and static["compile_s"] > 0  # calibrated, then timed
    assert rows["omnirl_train_fp8_ref"]["scope"] == "reference"
    assert rows["baseline"]["iteration_s_per_image"] > 0
    for batch in ("all", "4", "1"):  # a lease's memory peak by decode batch (none on a CPU)
        row = rows[f"decode_memory_{batch}"]
        assert row["s_per_image"] > 0 and row["lease_peak_allocated_gb"] is None
    assert rows["decode_memory_1"]["images_per_vae_call"] == 1
    assert rows["warm_start"]["process_to_first_group_s"] > 0
    md = (tmp_path / "gpu_sd35m.md").read_text()
    assert "| omnirl, kl_beta 0 (no reference pass) | 3 |" in md
    trainer = "float8 trainer (static, input gradient model_dtype, fast accumulation)"
    assert f"| omnirl, compiled, with KL, {trainer} |" in md
    assert f"| omnirl, same work, {trainer} | 3 |" in md


def test_float8_rollout_alone_reports_the_loop_without_a_trainer(tmp_path):
    """A float8 stage after the compiled rollout alone (no trainer compiled: no parity), the
    rollout compiled whole and the trainer's scope set apart; the report's rollout rows
    give the denoising loop alone beside ``sample`` less decode."""
    rows = _run_tiny(
        tmp_path,
        "--compile-scope",
        "whole",
        "--train-compile-scope",
        "blocks",
        "--stages",
        "compile_rollout,fp8_static_fast",
        timeout=600,
    )
    assert not [k for k in rows if k.endswith(("_error", "_skipped"))], rows
    fp8 = rows["omnirl_rollout_fp8_static_fast"]
    assert fp8["parity_mean"] is None and fp8["calibration_s"] > 0
    for stage in ("omnirl_rollout_compiled", "omnirl_rollout_fp8_static_fast"):
        row = rows[stage]
        assert 0 < row["phase_denoise_s_per_image"] < row["phase_total_s_per_image"]
        assert row["denoise_s_per_image"] > 0
    md = (tmp_path / "gpu_sd35m.md").read_text()
    loop = rows["omnirl_rollout_fp8_static_fast"]["phase_denoise_s_per_image"]
    assert f"| omnirl, float8, static scales, fast accumulation | {loop:.4g} |" in md
    assert "omnirl_rollout_fp8_static_fast:" not in md  # no parity line without a trainer


def test_fp8_best_runs_alone_from_a_cold_start_with_an_inductor_setting(tmp_path):
    """``fp8_best`` needs no other stage: the float8 rollout and trainer compiled from
    nothing, their parity, kernel split and same-work iteration; an ``--inductor`` setting
    is applied and recorded with the run, and so are the trainer's activation memory budget
    and its attention setting."""
    rows = _run_tiny(
        tmp_path,
        "--stages",
        "fp8_best",
        "--inductor",
        "triton.multi_kernel=0",
        "--activation-memory-budget",
        "0.5",
        "--recompute-attention",
        "--compile-decoder",
        timeout=600,
    )
    assert not [k for k in rows if k.endswith(("_error", "_skipped"))], rows
    assert rows["env"]["inductor"] == {"triton.multi_kernel": 0}
    rollout = rows["omnirl_rollout_fp8_best"]
    assert rollout["calibration_s"] > 0 and rollout["phase_denoise_s_per_image"] > 0
    # the decode timed apart from the sampling hits the sampling's compiled decoder graph (a
    # recompile there once made the denoising time negative)
    assert rollout["denoise_s_per_image"] > 0.5 * rollout["phase_denoise_s_per_image"]
    assert "--compile-decoder" in rows["env"]["command"]
    train = rows["omnirl_train_fp8_best"]
    assert (train["activation"], train["input_grad"], train["fast_accum"]) == (
        "static",
        "float8",
        True,
    )
    assert 0 < train["parity_max"] < 0.1 and train["compile_s"] > 0
    assert train["activation_memory_budget"] == 0.5  # the trainer compiled with it
    # the flag reaches the trainer's compile (the pass itself is inductor's, not aot_eager's:
    # tests/models/test_compile_attention.py)
    assert train["recompute_attention"] is True
    assert rows["profile_train_fp8_best"]["launches"] > 0
    assert rows["omnirl_iteration_same_work_train_fp8_best"]["kl"] is True
    md = (tmp_path / "gpu_sd35m.md").read_text()
    trainer = "float8 trainer (static, input gradient float8, fast accumulation)"
    assert f"| omnirl, same work, {trainer} | 3 |" in md
    assert "| the same, cold start (`fp8_best`) |" in md


def test_an_unknown_inductor_setting_ends_the_run_before_it_measures(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_sd35m.py"), "--tiny", "--device", "cpu"]
    for bad, said in (
        ("triton.no_such_knob=1", "has no 'triton.no_such_knob'"),
        ("enable_pdl", "KEY=VALUE"),
    ):
        proc = subprocess.run(
            [*cmd, "--out", str(tmp_path), "--inductor", bad],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        assert proc.returncode != 0 and said in proc.stderr, proc.stderr[-500:]
        assert not (tmp_path / "gpu_sd35m.jsonl").exists()
