"""CLIP score, PickScore and the aesthetic head, loaded from tiny random models on disk."""

import json

import numpy as np
import pytest

from omnirl.reward.scorers import ScoreBatch, build_reward
from omnirl.reward.scorers.clip_score import ModelFolderError
from omnirl.reward.scoring import parse_scorer_spec


def _byte_chars() -> list[str]:
    """The 256 printable stand-ins byte-level BPE uses for bytes."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    out, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return list(out.values())


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    """A CLIPModel (hidden 16, 2 layers, 32 px) + processor written with save_pretrained."""
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    root = tmp_path_factory.mktemp("clip")
    vocab: dict[str, int] = {}
    for suffix in ("", "</w>"):
        for ch in _byte_chars():
            vocab[ch + suffix] = len(vocab)
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab[special] = len(vocab)
    (root / "vocab.json").write_text(json.dumps(vocab))
    (root / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(str(root / "vocab.json"), str(root / "merges.txt"))
    eos = vocab["<|endoftext|>"]
    small = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
    config = CLIPConfig(
        text_config=dict(
            small,
            vocab_size=len(vocab),
            max_position_embeddings=77,
            bos_token_id=vocab["<|startoftext|>"],
            eos_token_id=eos,
            pad_token_id=eos,
        ),
        vision_config=dict(small, image_size=32, patch_size=8),
        projection_dim=8,
    )
    torch.manual_seed(0)
    folder = root / "model"
    CLIPModel(config).save_pretrained(folder)
    processor = CLIPProcessor(
        image_processor=CLIPImageProcessor(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
        ),
        tokenizer=tokenizer,
    )
    processor.save_pretrained(folder)
    return folder


def batch(n=4, prompts=None):
    images = np.random.default_rng(1).integers(0, 256, (n, 48, 48, 3), dtype=np.uint8)
    prompts = prompts or ["a red cube", "a blue ball", "a red cube", "text"][:n]
    return ScoreBatch(images, prompts, [{}] * n)


def test_clip_score_is_the_cosine_of_the_models_own_embeddings(tiny_clip):
    import torch
    from PIL import Image

    reward = build_reward("clip_score", model=str(tiny_clip))
    b = batch()
    scores = reward(b)["clip_score"]
    assert len(scores) == 4 and all(-1.0 <= s <= 1.0 for s in scores)
    # same number from transformers' own forward (logits_per_image / logit_scale)
    model, proc = reward.clip.model, reward.clip.processor
    inputs = proc(
        text=[b.prompts[1]],
        images=[Image.fromarray(b.images[1])],
        return_tensors="pt",
        padding=True,
    )
    with torch.no_grad():
        logits = model(**inputs).logits_per_image[0, 0] / model.logit_scale.exp()
    assert scores[1] == pytest.approx(float(logits), abs=1e-5)


def test_pickscore_scales_the_cosine_by_the_logit_scale(tiny_clip):
    clip = build_reward("clip_score", model=str(tiny_clip))
    pick = parse_scorer_spec(f"pickscore(model={tiny_clip};processor={tiny_clip};scale=0.5)")[0]
    b = batch()
    logit_scale = float(pick.reward.clip.model.logit_scale.exp())
    expected = 0.5 * logit_scale * np.array(clip(b)["clip_score"])
    assert pick.reward(b)["pickscore"] == pytest.approx(expected, rel=1e-5)


def test_aesthetic_head_loads_laion_keys_and_scores_images(tiny_clip, tmp_path):
    import torch
    from safetensors.torch import save_file

    from omnirl.reward.scorers.aesthetic import build_head

    head = build_head(8)
    torch.nn.init.normal_(head[0].weight)
    state = {f"layers.{k}": v.contiguous() for k, v in head.state_dict().items()}
    save_file(state, tmp_path / "head.safetensors")
    torch.save(state, tmp_path / "head.pth")
    scores = {}
    for name in ("head.safetensors", "head.pth"):
        reward = build_reward("aesthetic", model=str(tiny_clip), head=str(tmp_path / name))
        assert reward.reads == frozenset({"images"})
        scores[name] = reward(batch())["aesthetic"]
    assert scores["head.safetensors"] == pytest.approx(scores["head.pth"])
    emb = reward.clip.model.get_image_features(
        pixel_values=reward.clip.processor(images=list(batch().images), return_tensors="pt")[
            "pixel_values"
        ]
    )
    emb = getattr(emb, "pooler_output", emb)
    emb = emb / emb.norm(dim=-1, keepdim=True)
    assert scores["head.pth"] == pytest.approx(head.eval()(emb).squeeze(-1).tolist(), abs=1e-5)


def test_bad_folders_and_heads_fail_with_typed_errors(tiny_clip, tmp_path):
    with pytest.raises(ModelFolderError, match="does not exist"):
        build_reward("clip_score", model=str(tmp_path / "missing"))
    with pytest.raises(ModelFolderError, match="cannot load"):
        build_reward("clip_score", model=str(tmp_path))
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, tmp_path / "bad.safetensors")
    with pytest.raises(ModelFolderError, match="not a LAION aesthetic head"):
        build_reward("aesthetic", model=str(tiny_clip), head=str(tmp_path / "bad.safetensors"))
