"""EMA of the trainable parameters."""

import pytest
import torch

from omnirl.trainer.ema import EMA


def _param(value: float) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.full((3,), value))


def test_update_moves_towards_the_parameters_by_one_minus_decay():
    p = _param(0.0)
    ema = EMA([p], decay=0.9, warmup=False)
    with torch.no_grad():
        p.fill_(1.0)
    ema.update()
    assert ema.shadow[0].tolist() == pytest.approx([0.1] * 3)
    ema.update()
    assert ema.shadow[0].tolist() == pytest.approx([0.19] * 3)  # 0.1 + 0.1 * (1 - 0.1)


def test_warmup_schedule_is_flow_grpos():
    p = _param(0.0)
    ema = EMA([p], decay=0.9, warmup=True)
    assert ema.current_decay() == pytest.approx(0.1)  # (1 + 0) / (10 + 0)
    with torch.no_grad():
        p.fill_(1.0)
    ema.update()
    assert ema.shadow[0].tolist() == pytest.approx([0.9] * 3)
    assert ema.current_decay() == pytest.approx(2 / 11)
    ema.num_updates = 1000
    assert ema.current_decay() == 0.9


def test_swapped_in_and_copy_to_and_state_dict():
    p = _param(0.0)
    ema = EMA([p], decay=0.5, warmup=False)
    with torch.no_grad():
        p.fill_(2.0)
    ema.update()  # shadow 1.0
    with ema.swapped_in():
        assert p.tolist() == [1.0] * 3
    assert p.tolist() == [2.0] * 3

    state = ema.state_dict()
    other = EMA([_param(7.0)], decay=0.1, warmup=True)
    other.load_state_dict(state)
    assert other.shadow[0].tolist() == [1.0] * 3
    assert (other.decay, other.warmup, other.num_updates) == (0.5, False, 1)
    target = _param(5.0)
    other.copy_to([target])
    assert target.tolist() == [1.0] * 3
    with pytest.raises(ValueError, match="tracks"):
        EMA([_param(0.0), _param(0.0)], decay=0.5).load_state_dict(state)
    with pytest.raises(ValueError, match="decay"):
        EMA([p], decay=1.0)


def test_bf16_parameters_keep_a_float32_average():
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    ema = EMA([p], decay=0.999, warmup=False)
    with torch.no_grad():
        p.fill_(1.0)
    ema.update()
    assert ema.shadow[0].dtype == torch.float32
    assert ema.shadow[0][0].item() == pytest.approx(1e-3, rel=1e-5)
