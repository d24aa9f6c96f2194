"""``benchmarks/vae_decode_probe.py`` on the toy VAE: every variant timed against eager, its
images compared with eager's and, in bf16, with a float32 decode of the same latents."""

from __future__ import annotations

import json

import pytest


@pytest.fixture
def vae_decode_probe(benchmark_script):
    return benchmark_script("vae_decode_probe")


def test_every_variant_is_timed_and_compared(vae_decode_probe, tmp_path, torch_one_thread):
    rows = vae_decode_probe.main(
        [
            "--tiny",
            "--device",
            "cpu",
            "--backend",
            "aot_eager",
            "--batches",
            "2,1",
            "--seconds",
            "0",
            "--dtype",
            "bfloat16",
            "--float32-reference",
            "--out",
            str(tmp_path),
        ]
    )
    assert [(r["stage"], r["images_per_call"]) for r in rows] == [
        (name, b) for name in vae_decode_probe.VARIANTS for b in (2, 1)
    ]
    for row in rows:
        assert "error" not in row, row
        assert row["ms_per_image"] > 0 and row["speed_vs_eager"] > 0
        assert row["vs_float32_max"] >= 0 and row["absdiff_max"] <= 2  # bf16 rounding apart
    assert rows[0]["absdiff_max"] == 0 and rows[0]["speed_vs_eager"] == 1.0  # eager itself
    lines = (tmp_path / "vae_decode.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["stage"] == "env" and len(lines) == 1 + len(rows)


def test_an_unknown_variant_is_refused(vae_decode_probe):
    with pytest.raises(SystemExit, match="unknown variants \\['fused'\\]"):
        vae_decode_probe.main(["--tiny", "--variants", "eager,fused"])
