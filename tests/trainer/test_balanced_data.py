"""BalancedPromptSource: strata drawn by size and recent reward spread, resumable."""

from __future__ import annotations

import collections
import io

import pytest
import torch

from omnirl.protocol.messages import PromptSpec
from omnirl.trainer.balanced_data import BalancedPromptSource
from omnirl.trainer.config import ConfigError, load_config
from omnirl.trainer.data import DataError


def records(sizes: dict[str, int]) -> list[dict]:
    return [
        {"prompt": f"{cat} {i}", "metadata": {"category": cat}}
        for cat, n in sizes.items()
        for i in range(n)
    ]


def categories(source: BalancedPromptSource, n: int) -> collections.Counter:
    return collections.Counter(p.metadata["category"] for p in source.take(n))


def test_without_reports_the_draw_follows_the_dataset_mix():
    source = BalancedPromptSource(records({"a": 300, "b": 100}), key="category", seed=1)
    assert source.weights() == pytest.approx({"a": 0.75, "b": 0.25})
    counts = categories(source, 2000)
    assert 0.71 < counts["a"] / 2000 < 0.79


def test_a_stratum_whose_groups_tie_drops_to_its_floor_and_recovers():
    source = BalancedPromptSource(
        records({"easy": 100, "hard": 100}), key="category", floor=0.2, memory=4, seed=0
    )
    easy, hard = (
        PromptSpec(group_id=c, text=c, metadata={"category": c}) for c in ("easy", "hard")
    )
    for _ in range(4):
        source.observe(easy, [1.0, 1.0, 1.0])  # all passed: nothing to learn
        source.observe(hard, [0.0, 1.0, 0.0])
    assert source.weights() == pytest.approx({"easy": 0.2 / 1.2, "hard": 1.0 / 1.2})
    counts = categories(source, 1200)
    assert 0.13 < counts["easy"] / 1200 < 0.21  # still drawn: the floor
    source.observe(easy, [0.0, 1.0, 1.0])
    source.observe(easy, [0.0, 1.0, 1.0])  # memory 4: half of its last groups had a spread
    assert source.weights()["easy"] == pytest.approx(0.6 / 1.6)
    source.observe(easy, [])  # a group without rewards tells nothing
    source.observe(PromptSpec(group_id="x", text="?", metadata={}), [0.0, 1.0])
    assert source.weights()["easy"] == pytest.approx(0.6 / 1.6)


def test_each_stratum_walks_all_its_prompts_per_epoch_with_unique_group_ids():
    source = BalancedPromptSource(records({"a": 5, "b": 3}), key="category", seed=2)
    specs = source.take(400)
    ids = [p.group_id for p in specs]
    assert len(set(ids)) == len(ids)
    b_texts = [p.text for p in specs if p.metadata["category"] == "b"]
    assert sorted(b_texts[:3]) == ["b 0", "b 1", "b 2"]  # one epoch of b before any repeat


def test_state_dict_resumes_the_same_draws_and_outcomes():
    recs = records({"a": 50, "b": 20, "c": 10})
    source = BalancedPromptSource(recs, key="category", seed=3, memory=8)
    for p in source.take(37):
        source.observe(p, [0.0, 0.0] if p.metadata["category"] == "a" else [0.0, 1.0])
    state, weights = source.state_dict(), source.weights()
    assert weights["a"] < 0.5 * 50 / 80  # its groups all tied
    expected = [p.group_id for p in source.take(40)]
    resumed = BalancedPromptSource(recs, key="category", seed=3, memory=8)
    resumed.load_state_dict(torch.load(_saved(state), weights_only=True))
    assert resumed.weights() == pytest.approx(weights)
    assert [p.group_id for p in resumed.take(40)] == expected
    with pytest.raises(DataError, match="does not match"):
        BalancedPromptSource(records({"x": 3}), key="category").load_state_dict(state)


def _saved(state) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return buf


def test_bad_input_names_the_problem():
    with pytest.raises(DataError, match=r"prompt 1 .* no metadata 'category'"):
        BalancedPromptSource(
            [{"prompt": "x", "metadata": {"category": "a"}}, {"prompt": "y", "metadata": {}}],
            key="category",
        )
    with pytest.raises(ValueError, match="floor"):
        BalancedPromptSource(records({"a": 2}), key="category", floor=0.0)
    base = ["model.path=x", "data.prompts=p.jsonl", "data.balance_by=category"]
    assert load_config(None, base).data.balance_by == "category"
    with pytest.raises(ConfigError, match=r"data\.balance_floor"):
        load_config(None, [*base, "data.balance_floor=1.5"])
    with pytest.raises(ConfigError, match=r"data\.balance_memory"):
        load_config(None, [*base, "data.balance_memory=0"])
