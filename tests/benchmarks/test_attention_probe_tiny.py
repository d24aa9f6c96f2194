"""The attention probe's CPU dry run: every variant runs or says why not, and the table
has each one's time against the baseline measured in the same run."""

from __future__ import annotations

import json


def test_tiny_probe_times_every_variant_against_the_baseline(tmp_path, benchmark_script):
    probe = benchmark_script("attention_probe")
    assert probe.main(["--tiny", "--out", str(tmp_path)]) == 0
    rows = {
        r["stage"]: r
        for r in map(json.loads, (tmp_path / "attention_probe.jsonl").read_text().splitlines())
    }
    assert rows["cudnn_bf16_fwd"]["speed_vs_cudnn_bf16"] == 1.0
    for stage in ("cudnn_bf16_fwd", "flash_bf16_fwd", "flex_bf16_fwd"):
        assert rows[stage]["abs_err_max"] < 0.05, rows[stage]  # bf16 against float32
    assert "speed_vs_cudnn_bf16" in rows["flash_bf16_fwd_bwd"]
    assert "needs a GPU" in rows["flex_float8_fwd"]["error"]  # said, not skipped silently
    for stage in ("cudnn_fp8_fwd", "cudnn_fp8_fwd_quantizing"):
        assert "needs a CUDA GPU" in rows[stage]["error"]
    table = (tmp_path / "attention_probe.md").read_text()
    assert "| flex_float8_fwd | failed:" in table
