"""The prompt stream: group ids from dataset positions, exact resume from state_dict."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from omnirl.trainer.data import DataError, PromptSource, read_prompt_records


def _records(n):
    return [{"prompt": f"prompt {i}", "metadata": {"i": i}} for i in range(n)]


def test_resume_continues_the_same_order_across_epochs():
    src = PromptSource(_records(7), shuffle=True, seed=11)
    src.take(10)  # into the second epoch
    state = src.state_dict()
    expected = [p.group_id for p in src.take(12)]
    resumed = PromptSource(_records(7), shuffle=True, seed=11)
    resumed.load_state_dict(state)
    assert [p.group_id for p in resumed.take(12)] == expected
    # and the whole stream equals an uninterrupted one
    straight = PromptSource(_records(7), shuffle=True, seed=11)
    assert [p.group_id for p in straight.take(22)][10:] == expected


def test_resume_keeps_the_order_it_started_with_when_the_seed_changes():
    # data.seed follows run.seed: a run resumed under another seed must not switch permutation
    src = PromptSource(_records(7), shuffle=True, seed=11)
    src.take(3)
    state = src.state_dict()
    expected = [p.group_id for p in src.take(9)]
    resumed = PromptSource(_records(7), shuffle=True, seed=12)
    resumed.load_state_dict(state)
    assert [p.group_id for p in resumed.take(9)] == expected


def test_group_ids_name_epoch_and_index_and_epochs_are_permutations():
    src = PromptSource(_records(5), shuffle=True, seed=3)
    ids = [p.group_id for p in src.take(10)]
    assert sorted(ids[:5]) == [f"e0:i{i}" for i in range(5)]
    assert sorted(ids[5:]) == [f"e1:i{i}" for i in range(5)]
    first = src.dataset[(0, 2)]
    assert first.text == "prompt 2" and first.metadata == {"i": 2}
    unshuffled = PromptSource(_records(3), shuffle=False, seed=0)
    assert [p.group_id for p in unshuffled.take(4)] == ["e0:i0", "e0:i1", "e0:i2", "e1:i0"]


def test_jsonl_and_parquet_read_the_same(tmp_path):
    recs = _records(4)
    jl = tmp_path / "p.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in recs) + "\n\n")
    pqf = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(recs), pqf)
    assert read_prompt_records(jl) == recs
    assert read_prompt_records(pqf) == recs


def test_bad_prompt_files_are_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{not json}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2"):
        read_prompt_records(bad)
    nop = tmp_path / "nop.jsonl"
    nop.write_text('{"text": "x"}\n')
    with pytest.raises(DataError, match="row 0"):
        read_prompt_records(nop)
    with pytest.raises(DataError, match="not found"):
        read_prompt_records(tmp_path / "missing.jsonl")
