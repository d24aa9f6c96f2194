"""Fixtures of the recording tests: a small recorded stream of real, scored SD3 groups."""

from __future__ import annotations

import msgspec
import pytest
from recording_setup import GROUPS

from omnirl.protocol.codec import encode
from omnirl.protocol.recording import RecordingWriter


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
