"""Preference files: format checks with file:line errors, paths relative to the file, a
deterministic resumable order, and two-sample groups (chosen first, rewards [1, 0]) that the
intake accepts and whose latents are the encoder's."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from omnirl.trainer.data import DataError
from omnirl.trainer.intake import _group_problem
from omnirl.trainer.preferences import (
    PreferenceSource,
    load_image,
    offline_sampling,
    preference_groups,
    read_preference_file,
)

HEADER = {"format": "omnirl.preferences", "version": 1, "metadata": {"made_by": "test"}}


def _image(path, value, size=32):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((size, size, 3), value, dtype=np.uint8)).save(path)


def _write(folder, rows, header=HEADER):
    path = folder / "prefs.jsonl"
    lines = ([json.dumps(header)] if header else []) + [json.dumps(r) for r in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def pairs_dir(tmp_path):
    for i in range(5):
        _image(tmp_path / "img" / f"{i}_w.png", 10 * i)
        _image(tmp_path / "img" / f"{i}_l.png", 200 + 10 * i)
    return tmp_path


def _row(i, **extra):
    return {"prompt": f"prompt {i}", "chosen": f"img/{i}_w.png", "rejected": f"img/{i}_l.png",
            "metadata": {"k": i}, **extra}  # fmt: skip


def test_reads_header_rows_and_resolves_paths_against_the_file(pairs_dir):
    f = read_preference_file(_write(pairs_dir, [_row(i, scores={"chosen": 1}) for i in range(3)]))
    assert f.metadata == {"made_by": "test"} and len(f.pairs) == 3
    assert f.pairs[1].chosen == pairs_dir / "img" / "1_w.png" and f.pairs[1].metadata == {"k": 1}
    no_header = read_preference_file(_write(pairs_dir, [_row(0)], header=None))
    assert no_header.metadata == {} and no_header.pairs[0].prompt == "prompt 0"


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        (
            [_row(0), {"prompt": "p", "chosen": "img/0_w.png"}],
            r"prefs\.jsonl:3: no string 'rejected'",
        ),
        ([_row(0, rejected="img/missing.png")], r"prefs\.jsonl:2: rejected image not found"),
        ([_row(0, rejected="img/0_w.png")], "the same image"),
        ([_row(0), HEADER], r":3: a header may only be the first line"),
        ([_row(0, metadata=[1])], "'metadata' is not an object"),
        ([], "no preference pairs"),
    ],
)
def test_malformed_files_name_file_and_line(pairs_dir, rows, match):
    with pytest.raises(DataError, match=match):
        read_preference_file(_write(pairs_dir, rows))


def test_bad_header_and_not_json(pairs_dir):
    with pytest.raises(DataError, match="unsupported version 2"):
        read_preference_file(_write(pairs_dir, [_row(0)], header={**HEADER, "version": 2}))
    path = pairs_dir / "bad.jsonl"
    path.write_text("{nope\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:1: not JSON"):
        read_preference_file(path)


def test_image_size_must_be_the_sampling_size(pairs_dir):
    assert load_image(pairs_dir / "img" / "0_w.png", (32, 32)).shape == (32, 32, 3)
    with pytest.raises(DataError, match="the run samples at 64x64"):
        load_image(pairs_dir / "img" / "0_w.png", (64, 64))


def test_source_order_is_seeded_per_epoch_and_resumes(pairs_dir):
    file = read_preference_file(_write(pairs_dir, [_row(i) for i in range(5)]))
    a = PreferenceSource(file, shuffle=True, seed=3)
    ids = [a.next()[0].group_id for _ in range(7)]
    assert sorted(ids[:5]) == [f"pref:e0:i{i}" for i in range(5)]  # each pair once an epoch
    assert ids[5].startswith("pref:e1:") and a.peek_epoch() == 1
    b = PreferenceSource(file, shuffle=True, seed=3)
    assert [b.next()[0].group_id for _ in range(3)] == ids[:3]
    c = PreferenceSource(file, shuffle=True, seed=3)
    c.load_state_dict(b.state_dict())
    assert [c.next()[0].group_id for _ in range(4)] == ids[3:7]
    assert b.peek_epoch() == 0
    for _ in range(2):
        b.next()
    assert b.peek_epoch() == 1  # the epoch's last pair was taken: the next is epoch 1's


class PixelEncoder:
    """Latents = pixels / 255, embeddings a function of the text length (for the layout)."""

    def encode_images(self, images):
        return images.permute(0, 3, 1, 2).float() / 255.0

    def encode_prompts(self, texts, *, guidance_scale, negative_prompt=""):
        return [
            {
                "prompt_embeds": torch.full((4, 8), float(len(t))),
                "pooled_prompt_embeds": torch.ones(8),
            }
            for t in texts
        ]


def test_groups_put_chosen_first_with_rewards_one_zero(pairs_dir):
    from omegaconf import OmegaConf

    file = read_preference_file(_write(pairs_dir, [_row(i) for i in range(3)]))
    source = PreferenceSource(file, shuffle=False)
    items = [source.next()[:2] for _ in range(3)]
    cfg = OmegaConf.create({"num_steps": 10, "guidance_scale": 3.0, "height": 32, "width": 32,
                            "negative_prompt": ""})  # fmt: skip
    sampling = offline_sampling(cfg, seed=0)
    assert sampling.group_size == 2 and sampling.sde_type == "ode"
    groups = preference_groups(items, PixelEncoder(), sampling, policy_version=4)
    assert [g.group_id for g in groups] == ["pref:e0:i0", "pref:e0:i1", "pref:e0:i2"]
    g = groups[2]
    assert g.rewards.total == [1.0, 0.0] and g.policy_version == 4 and _group_problem(g) is None
    assert g.final_latents.shape == (2, 3, 32, 32)
    assert torch.allclose(g.final_latents[0], torch.full((3, 32, 32), 20 / 255))  # chosen
    assert torch.allclose(g.final_latents[1], torch.full((3, 32, 32), 220 / 255))  # rejected
    assert int(g.images[1, 0, 0, 0]) == 220 and g.prompt.text == "prompt 2"
    assert torch.equal(g.prompt_embeds, torch.full((4, 8), 8.0))
