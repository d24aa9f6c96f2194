"""A trainer fed the same recording twice (same seed, same config) is bitwise the same."""

from __future__ import annotations

import json

import pytest
from recording_setup import EXAMPLE, trainer_overrides

# wall-clock metrics differ between runs by nature
TIMING = ("_s", "time", "rate")


def _train(model, recording, out, *extra):
    import torch

    from omnirl.trainer.cli import main

    torch.set_num_threads(1)
    argv = ["--config", str(EXAMPLE), *trainer_overrides(model, out), "--replay", str(recording)]
    rc = main([*argv, *extra])
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
        runs = [_train(tiny_sd3_path, recording, tmp_path / name) for name in "ab"]
        # --deterministic picks other (deterministic) CPU kernels for some backward passes:
        # its runs agree with each other bitwise, not with the default kernels' runs
        runs += [_train(tiny_sd3_path, recording, tmp_path / n, "--deterministic") for n in "cd"]
    finally:
        torch.set_num_threads(before)
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False
        torch.backends.cuda.enable_flash_sdp(True)
        torch.backends.cuda.enable_mem_efficient_sdp(True)
    (rows_a, weights_a), (rows_b, weights_b), (rows_c, weights_c), (rows_d, weights_d) = runs
    assert [r["step"] for r in rows_a] == [1, 2]
    assert all(r["loss"] == r["loss"] for r in rows_a)  # not NaN
    assert _untimed(rows_a) == _untimed(rows_b) and weights_a == weights_b
    assert _untimed(rows_c) == _untimed(rows_d) and weights_c == weights_d


def _untimed(rows):
    return [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in rows]
