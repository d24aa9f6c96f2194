"""pretrain_shapes --vae-from: a trained VAE is reused, frozen, instead of the VAE stage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.usefixtures("torch_one_thread")

COMMITTED = Path(__file__).resolve().parents[2] / "examples" / "checkpoints" / "shapes_t2i"


def _args(out: Path, preset: str, vae_from: Path) -> list[str]:
    return [
        str(out),
        "--preset",
        preset,
        "--vae-from",
        str(vae_from),
        "--max-steps",
        "2",
        "--batch",
        "4",
        "--eval-prompts",
        "3",
        "--eval-steps",
        "2",
        "--log-every",
        "1",
    ]


def test_reused_vae_is_saved_unchanged_and_no_vae_stage_runs(tmp_path):
    from diffusers import AutoencoderKL

    from omnirl.tools.pretrain_shapes import main

    out = tmp_path / "ckpt"
    assert main(_args(out, "latent_small", COMMITTED)) == 0
    events = [json.loads(line)["event"] for line in (out / "pretrain_log.jsonl").open()]
    assert "vae_reused" in events and "vae" not in events and "vae_done" not in events
    assert events[-1] == "done"
    saved = AutoencoderKL.from_pretrained(out / "vae")
    source = AutoencoderKL.from_pretrained(COMMITTED / "vae")
    assert saved.config.scaling_factor == source.config.scaling_factor
    assert saved.config.shift_factor == source.config.shift_factor
    for (name, a), (_, b) in zip(
        saved.state_dict().items(), source.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(
    ("preset", "source", "message"),
    [
        ("tiny_latent", "committed", "block_out_channels"),  # another VAE architecture
        ("tiny", "committed", "pixel-space"),
        ("latent_small", "empty", "holds no VAE"),
    ],
)
def test_unusable_vae_is_refused_by_name(tmp_path, capsys, preset, source, message):
    from omnirl.tools.pretrain_shapes import main

    vae_from = COMMITTED if source == "committed" else tmp_path
    with pytest.raises(SystemExit) as exit_info:
        main(_args(tmp_path / "ckpt", preset, vae_from))
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
