"""``benchmarks/shapes_group_outcomes.py`` samples every mode and reports group statistics."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "shapes_group_outcomes.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(SCRIPT), str(ROOT / "examples/checkpoints/shapes_t2i"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)


def _rows(stdout: str) -> dict[str, list[float]]:
    return {
        line.strip("| ").split(" | ")[0]: [float(v) for v in line.strip("| ").split(" | ")[1:]]
        for line in stdout.splitlines()
        if line.startswith(("| sde", "| ode", "| cps"))
    }


def test_every_mode_reports_fractions_in_range():
    proc = _run("--prompts", "2", "--group", "4", "--threads", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(proc.stdout)
    assert list(rows) == ["sde, one x_T per group", "sde, fresh x_T", "ode, fresh x_T"]
    for values in rows.values():
        assert len(values) == 7 and all(0.0 <= v <= 1.0 for v in values[:6])
        assert 1.0 <= values[6] <= 4.0  # different colours among a group of 4


def test_cps_on_a_window_across_categories():
    proc = _run(
        "--category",
        "all",
        "--prompts",
        "2",
        "--group",
        "4",
        "--threads",
        "1",
        "--window",
        "0",
        "2",
        "--modes",
        "cps,sde",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(proc.stdout)
    assert list(rows) == ["cps, one x_T per group", "sde, one x_T per group"]
    # one x_T per group: the window's noise alone makes the samples differ
    assert all(values[1] > 0.0 for values in rows.values())


def test_an_unknown_mode_is_refused_by_name():
    proc = _run("--modes", "sde,langevin")
    assert proc.returncode != 0 and "langevin" in proc.stderr


def test_a_category_without_prompts_is_refused_by_name():
    proc = _run("--category", "juggling")
    assert proc.returncode != 0 and "no 'juggling' prompts" in proc.stderr
