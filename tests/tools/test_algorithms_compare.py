"""benchmarks/algorithms_compare.py: the report from runs' metrics.jsonl (smoothing, the
table's numbers, the PNG, the marked docs section) and the launch command it builds. The
launches themselves are exercised by running the script (docs/benchmarks.md)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    module = importlib.import_module("algorithms_compare")
    yield module
    for name in ("algorithms_compare", "compare_report"):
        sys.modules.pop(name, None)


def test_trailing_mean_uses_only_the_past(bench):
    from compare_report import trailing_mean

    assert trailing_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert trailing_mean([2.0, 4.0], 10) == [2.0, 3.0]


def _metrics(run_dir: Path, rewards, step_s=2.0, every_s=20.0):
    run_dir.mkdir(parents=True)
    (run_dir / ".algorithms_compare").write_text("")
    rows = [
        {
            "step": i + 1,
            "elapsed_s": every_s * (i + 1),
            "reward_mean": r,
            "step_s": step_s,
            "staleness_mean": 0.5,
            "ledger/groups_trained": 8 * (i + 1),
        }
        for i, r in enumerate(rewards)
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_summary_numbers(bench):
    from compare_report import read_metrics, summarise

    rows = [{"step": i + 1, "elapsed_s": 20.0 * (i + 1), "reward_mean": r, "step_s": 2.0,
             "staleness_mean": 1.0, "ledger/groups_trained": 8 * (i + 1)}
            for i, r in enumerate([0.1, 0.2, 0.3, 0.5, 0.7, 0.9])]  # fmt: skip
    s = summarise("x", rows, group_size=8, groups_per_step=8, smooth_groups=16)
    assert s.steps == 6 and s.samples == 48 * 8
    assert s.first_minute == pytest.approx((0.1 + 0.2 + 0.3) / 3)  # steps ending by 60 s
    assert s.final == pytest.approx((0.7 + 0.9) / 2)  # 16 groups = the last 2 steps
    assert s.gain == pytest.approx(0.8 - 0.2)
    assert s.wall_s_per_step == pytest.approx(20.0) and s.staleness == 1.0
    assert read_metrics(Path("/nonexistent/metrics.jsonl")) == []
    empty = summarise("y", [], group_size=8, groups_per_step=8, smooth_groups=16)
    assert empty.steps == 0 and empty.note == "no steps"


def test_no_run_report_writes_png_table_and_the_marked_section(bench, tmp_path, monkeypatch):
    out = tmp_path / "out"
    _metrics(out / "flow_grpo", [0.2, 0.3, 0.4, 0.6])
    _metrics(out / "diffusion_nft", [0.25, 0.25, 0.3, 0.35], step_s=1.0)
    doc = tmp_path / "benchmarks.md"
    doc.write_text(
        "# B\n\n<!-- algorithms_compare:begin -->\nold\n<!-- algorithms_compare:end -->\ntail\n"
    )
    monkeypatch.setattr(bench, "DOC", doc)
    monkeypatch.setattr(bench, "DOC_PNG", tmp_path / "images" / "algorithms_compare.png")
    # the table's numbers assume 8 groups of 8 a step, whatever the example config says
    argv = ["--no-run", "--out", str(out), "--algorithms", "flow_grpo,diffusion_nft", "--write",
            "--smooth-groups", "16", "--set", "*:train.groups_per_step=8",
            "--set", "*:data.group_size=8"]  # fmt: skip
    assert bench.main(argv) == 0
    page = doc.read_text()
    assert "old" not in page and page.endswith("<!-- algorithms_compare:end -->\ntail\n")
    assert "| `flow_grpo` | 4 | 256 | 0.500 | 0.300 | +0.200 | 20 | 2.0 | 20.0 | 0.50 |" in page
    assert "| `diffusion_nft` | 4 | 256 | 0.325 |" in page
    png = tmp_path / "images" / "algorithms_compare.png"
    assert (
        png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (out / "algorithms_compare.png").is_file()
    )
    summary = json.loads((out / "summary.json").read_text())
    assert [r["algorithm"] for r in summary] == ["flow_grpo", "diffusion_nft"]


def test_launch_command_and_overrides(bench, tmp_path, monkeypatch):
    seen = {}

    class FakePopen:
        pid = 0

        def __init__(self, cmd, **kwargs):
            seen["cmd"] = cmd

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(bench.subprocess, "Popen", FakePopen)
    args = bench.parse_args(
        ["--minutes", "2", "--out", str(tmp_path), "--set", "mix_grpo:train.lr=1e-4"]
    )
    code, _ = bench.run_one("mix_grpo", args)
    cmd = seen["cmd"]
    assert code == 0 and cmd[1] == "launch" and cmd[2].endswith("shapes_flow_grpo_lora.yaml")
    assert cmd[-6:-2] == ["--rollout", "1", "--reward", "1"]  # options after the overrides
    assert cmd[-2:] == ["--address-timeout", "600"]
    assert {"algorithm.name=mix_grpo", "max_minutes=2", "sampling.sde_window=null",
            "train.lr=1e-4", f"run.output_dir={tmp_path / 'mix_grpo'}"} <= set(cmd)  # fmt: skip
    # ODE samplers: distinct x_T per sample, whatever the config's same_initial_noise
    for algo in ("diffusion_nft", "diffusion_dpo"):
        code, _ = bench.run_one(algo, bench.parse_args(["--out", str(tmp_path / "ode")]))
        assert code == 0 and "sampling.same_initial_noise=null" in seen["cmd"]
        cfg = bench.run_config(algo, bench.parse_args(["--out", str(tmp_path / "ode")]))
        assert cfg["sampling"]["same_initial_noise"] is None
    with pytest.raises(SystemExit):
        bench.parse_args(["--algorithms", "nope"])
    (tmp_path / "foreign").mkdir()
    with pytest.raises(SystemExit, match="not made by this script"):
        bench.fresh_dir(tmp_path / "foreign")
