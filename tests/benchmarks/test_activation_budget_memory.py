"""The activation-budget memory benchmark's dry run at toy widths: every budget measured,
each block variant's saved bytes counted, bf16 and float8 blocks."""

from __future__ import annotations

import json


def test_tiny_run_counts_each_variant_for_each_budget(tmp_path, benchmark_script):
    bench = benchmark_script("activation_budget_memory")
    out = tmp_path / "rows.jsonl"
    assert bench.main(["--tiny", "--budgets", "1,0.5", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["budget"] for r in rows] == [1.0, 0.5]
    for row in rows:
        assert all(row[f"{v}_block_mb"] > 0 for v in ("dual", "plain", "last")), row
        assert row["model_gb_per_sample"] > 0


def test_float8_blocks_are_counted_without_their_weight_copies(tmp_path, benchmark_script):
    bench = benchmark_script("activation_budget_memory")
    out = tmp_path / "rows.jsonl"
    assert bench.main(["--tiny", "--budgets", "1", "--float8", "--out", str(out)]) == 0
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["float8"] is True
    plain = bench.saved_bytes_by_variant(None, tiny=True, float8=False)
    # a frozen linear layer saves no input, float8 or not; the float8 copies are buffers
    assert row["plain_block_mb"] == round(plain["plain"] / 1e6, 2)
