"""A trainer fed the same recording twice (same seed, same config) is bitwise the same."""

from __future__ import annotations

import json

import pytest
from conftest import EXAMPLE, trainer_overrides

# wall-clock metrics differ between runs by nature
TIMING = ("_s", "time", "rate")


def _train(model, recording, out):
    import torch

    from omnirl.trainer.cli import main

    torch.set_num_threads(1)
    rc = main(
        ["--config", str(EXAMPLE), *trainer_overrides(model, out), "--replay", str(recording)]
    )
    assert rc == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    (weights,) = sorted(out.rglob("trainable.safetensors"))[-1:]
    return rows, weights.read_bytes()


@pytest.mark.slow
def test_replay_twice_gives_bitwise_equal_losses_and_weights(
    tiny_sd3_path, recorded_groups, tmp_path
):
    import torch

    recording, _ = recorded_groups
    before = torch.get_num_threads()
    try:
        rows_a, weights_a = _train(tiny_sd3_path, recording, tmp_path / "a")
        rows_b, weights_b = _train(tiny_sd3_path, recording, tmp_path / "b")
    finally:
        torch.set_num_threads(before)
    assert [r["step"] for r in rows_a] == [1, 2]
    strip = [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in rows_a]
    assert strip == [
        {k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in rows_b
    ]
    assert all(r["loss"] == r["loss"] for r in rows_a)  # finite, not NaN
    assert weights_a == weights_b
