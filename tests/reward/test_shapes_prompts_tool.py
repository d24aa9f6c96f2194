"""``python -m omnirl.tools.shapes_prompts`` writes train / held-out prompt files."""

import json
import subprocess
import sys

import pytest

from omnirl.reward.shapes.world import ShapeSpec, split_of
from omnirl.tools.shapes_prompts import main


def test_writes_balanced_disjoint_prompt_files(tmp_path):
    out = tmp_path / "prompts"
    cmd = [sys.executable, "-m", "omnirl.tools.shapes_prompts", str(out)]
    subprocess.run([*cmd, "--n-train", "120", "--n-heldout", "60", "--seed", "3"], check=True)
    rows = {
        s: [json.loads(line) for line in (out / f"{s}.jsonl").open()] for s in ("train", "heldout")
    }
    assert len(rows["train"]) == 120 and len(rows["heldout"]) == 60
    for split, lines in rows.items():
        for row in lines:
            spec = ShapeSpec.from_metadata(row["metadata"])
            assert row["prompt"] == spec.text
            assert spec.category == "single_object" or split_of(spec) == split
    train_texts = {
        r["prompt"] for r in rows["train"] if r["metadata"]["category"] != "single_object"
    }
    assert train_texts.isdisjoint(r["prompt"] for r in rows["heldout"])
    again = tmp_path / "again"
    assert main([str(again), "--n-train", "120", "--n-heldout", "60", "--seed", "3"]) == 0
    assert (again / "train.jsonl").read_bytes() == (out / "train.jsonl").read_bytes()


def test_unknown_category_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path), "--categories", "colours"])
    assert exit_info.value.code == 2 and "unknown categories" in capsys.readouterr().err
