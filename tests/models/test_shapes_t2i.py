"""ShapesT2I family: loads from disk, registry lookup, sampled groups, trainer parity."""

from __future__ import annotations

import pytest
import torch

from omnirl.models.registry import architecture_of, get_rollout_adapter, get_training_adapter
from omnirl.models.shapes_t2i import (
    ARCHITECTURE,
    PRESETS,
    ShapesT2IPipeline,
    ShapesT2IRolloutAdapter,
    ShapesT2ITrainingAdapter,
    build_pipeline,
)
from omnirl.models.transitions import collate_transitions
from omnirl.protocol.messages import PromptSpec, SamplingParams

pytestmark = pytest.mark.usefixtures("torch_one_thread")
LORA = {"r": 4, "lora_alpha": 8}
WORDS = ["a", "photo", "of", "red", "blue", "circle", "square", "and", "left"]


@pytest.fixture(scope="module")
def shapes_path(tmp_path_factory):
    pipe = build_pipeline(WORDS, PRESETS["tiny"], seed=0)
    return pipe.save_pretrained(tmp_path_factory.mktemp("shapes_t2i") / "model")


def test_registry_finds_both_adapters_by_architecture(shapes_path):
    assert architecture_of(shapes_path) == ARCHITECTURE == "ShapesT2IPipeline"
    assert get_rollout_adapter(ARCHITECTURE, "flow_grpo") is ShapesT2IRolloutAdapter
    assert get_training_adapter(ARCHITECTURE, "flow_grpo") is ShapesT2ITrainingAdapter


def test_folder_round_trips_and_tokenizes_words(shapes_path):
    pipe = ShapesT2IPipeline.from_pretrained(shapes_path)
    ids = pipe.tokenize(["a photo of a red circle", "", "a photo of a zebra"])
    assert ids.shape == (3, 16) and ids.dtype == torch.int64
    tok = pipe.tokenizer
    assert ids[0, 0] == tok.bos_token_id and ids[0, 7] == tok.eos_token_id
    assert ids[1, :2].tolist() == [tok.bos_token_id, tok.eos_token_id]
    assert ids[2, 5] == tok.unk_token_id
    pe, pooled = pipe.encode(["a photo of a red circle"])
    assert pe.shape == (1, 16, 16) and pooled.shape == (1, 16) and pe.dtype == torch.float32
    with pytest.raises(ValueError, match="ShapesT2IPipeline"):
        (shapes_path / "model_index.json").write_text('{"_class_name": "Other"}')
        try:
            ShapesT2IPipeline.from_pretrained(shapes_path)
        finally:
            build_pipeline(WORDS, PRESETS["tiny"], seed=0).save_pretrained(shapes_path)


def sample(rollout, sde_type="sde", **kw):
    sp = SamplingParams(
        group_size=2,
        num_steps=4,
        height=32,
        width=32,
        sde_type=sde_type,
        sde_window=(0, 3),
        seed=5,
        guidance_scale=kw.pop("guidance_scale", 3.0),
        **kw,
    )
    texts = ["a photo of a red circle", "a photo of a blue square left of a red circle"]
    ps = [PromptSpec(group_id=f"g{i}", text=t) for i, t in enumerate(texts)]
    return rollout.sample(ps, sp, lease_id="l", worker_id="w", policy_version=3)


def test_rollout_groups_have_sd3_fields(shapes_path):
    roll = ShapesT2IRolloutAdapter.from_pretrained(shapes_path)
    groups = sample(roll)
    g = groups[0]
    assert g.architecture == ARCHITECTURE and g.policy_version == 3
    assert g.latents.shape == (2, 3, 3, 32, 32) and g.latents.dtype == torch.float32
    assert g.next_latents.shape == g.latents.shape and g.log_probs.shape == (2, 3)
    assert g.log_probs.dtype == torch.float32 and torch.isfinite(g.log_probs).all()
    assert g.prompt_embeds.shape == (16, 16) and g.pooled_prompt_embeds.shape == (16,)
    assert g.negative_prompt_embeds.shape == (16, 16)
    assert g.negative_pooled_prompt_embeds.shape == (16,)
    assert g.images.shape == (2, 32, 32, 3) and g.images.dtype == torch.uint8
    assert g.final_latents.shape == (2, 3, 32, 32)
    again = sample(roll)
    assert torch.equal(again[1].images, groups[1].images)  # deterministic in the seeds
    no_cfg = sample(roll, guidance_scale=1.0)[0]
    assert no_cfg.negative_prompt_embeds is None


def test_trainer_recomputes_rollout_log_probs(shapes_path):
    train = ShapesT2ITrainingAdapter.from_pretrained(shapes_path, lora=LORA)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in train.trainable_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    roll = ShapesT2IRolloutAdapter.from_pretrained(shapes_path, lora=LORA)
    roll.load_weights("lora", train.export_weights())
    for sde_type in ("sde", "cps"):
        groups = sample(roll, sde_type)
        for k in range(3):
            batch = collate_transitions(groups, k)
            with torch.no_grad():
                out = train.transition(batch, sde_type=sde_type)
            ratio = torch.exp(out.log_prob - batch.old_log_probs)
            torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-5, rtol=0)
