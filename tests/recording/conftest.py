"""Fixtures of the recording tests: a small recorded stream of real, scored SD3 groups."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from omnirl.protocol.codec import encode
from omnirl.protocol.recording import RecordingWriter

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_sd3_jpeg.yaml"
PROMPTS = Path(__file__).resolve().parents[2] / "examples" / "prompts" / "animals.jsonl"
GROUPS = 4  # two steps of two groups


def trainer_overrides(model: Path, out: Path) -> list[str]:
    """The example config made tiny; it must sample what :func:`recorded_groups` sampled."""
    items = {
        "model.path": model,
        "run.output_dir": out,
        "data.prompts": PROMPTS,
        "data.group_size": 2,
        "sampling.num_steps": 3,
        "train.groups_per_step": 2,
        "train.max_staleness": 1,  # step 2 trains on groups sampled at version 0
        "runtime.control_port": 0,
        "runtime.shutdown_grace_s": 0,
        "logging.progress_bar": "false",
        "logging.tensorboard": "false",
        "checkpoint.every": 0,
        "max_steps": 2,
    }
    return [f"{k}={v}" for k, v in items.items()]


def jpeg_compressibility(images) -> list[float]:
    """DDPO's JPEG compressibility (minus the quality-95 JPEG size in kB), as the reward
    package's scorer defines it; written out here so the fixture does not import the
    reward package's model-based scorers."""
    import io

    from PIL import Image

    out = []
    for image in images:
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="JPEG", quality=95)
        out.append(-len(buffer.getvalue()) / 1000)
    return out


@pytest.fixture(scope="session")
def recorded_groups(tiny_sd3_path, tmp_path_factory):
    """A recording of GROUPS scored groups from the tiny SD3 rollout adapter (JPEG reward)."""
    import torch

    from omnirl.models.registry import get_rollout_adapter
    from omnirl.protocol.messages import PromptSpec, Rewards, SamplingParams

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rollout = get_rollout_adapter("StableDiffusion3Pipeline", "flow_grpo").from_pretrained(
            tiny_sd3_path
        )
        groups = []
        for i in range(GROUPS):
            sampling = SamplingParams(
                group_size=2, num_steps=3, guidance_scale=1.0, height=32, width=32, seed=100 + i
            )
            prompt = PromptSpec(group_id=f"rec:{i}", text=f"a photo of animal {i}")
            (g,) = rollout.sample(
                [prompt], sampling, lease_id=f"lease{i}", worker_id="w0", policy_version=0
            )
            scores = jpeg_compressibility(g.images.numpy())
            rewards = Rewards(
                group_id=g.group_id, total=scores, components={"jpeg": scores}, scorer="r0"
            )
            groups.append(msgspec.structs.replace(g, rewards=rewards))
    finally:
        torch.set_num_threads(before)
    directory = tmp_path_factory.mktemp("recording") / "stream"
    with RecordingWriter(directory) as writer:
        for i, g in enumerate(groups):
            writer.write(encode(g), recv_time=1_000_000.0 + 0.05 * i)
    return directory, groups
