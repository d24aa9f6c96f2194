"""pretrain_shapes writes a loadable checkpoint; eval_shapes scores it; the shapes_eval scorer."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from omnirl.reward.shapes import ShapeSpec, generate_prompts, render

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    from omnirl.tools.pretrain_shapes import main

    out = tmp_path_factory.mktemp("pretrain") / "ckpt"
    rc = main(
        [
            str(out),
            "--preset",
            "tiny",
            "--max-steps",
            "3",
            "--batch",
            "4",
            "--eval-prompts",
            "6",
            "--eval-steps",
            "2",
            "--log-every",
            "1",
            "--threads",
            "1",
        ]
    )
    assert rc == 0
    return out


def test_pretrain_writes_a_checkpoint_the_registry_loads(pretrained):
    from omnirl.models.registry import architecture_of
    from omnirl.tools.policy_loading import load_adapter

    assert architecture_of(pretrained) == "ShapesT2IPipeline"
    rows = [
        json.loads(line) for line in (pretrained / "pretrain_log.jsonl").read_text().splitlines()
    ]
    events = [r["event"] for r in rows]
    assert events.count("train") == 3 and "eval" in events and events[-1] == "done"
    assert all(np.isfinite(r["loss"]) for r in rows if r["event"] == "train")
    assert load_adapter(pretrained).architecture == "ShapesT2IPipeline"


def test_eval_prints_categories_and_writes_json_and_grid(pretrained, tmp_path, capsys):
    from omnirl.tools.eval_shapes import main

    prompts = tmp_path / "p.jsonl"
    specs = generate_prompts(6, "heldout", seed=0)
    prompts.write_text(
        "".join(json.dumps({"text": s.text, "metadata": s.to_metadata()}) + "\n" for s in specs)
    )
    out = tmp_path / "eval"
    assert (
        main(
            [
                str(pretrained),
                "--prompts",
                str(prompts),
                "--seeds",
                "2",
                "--steps",
                "2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    for name in (
        "single_object",
        "two_object",
        "counting",
        "colors",
        "position",
        "color_attr",
        "overall",
    ):
        assert name in printed
    summary = json.loads((out / "eval.json").read_text())
    assert summary["overall"]["samples"] == 12 and summary["overall"]["prompts"] == 6
    assert 0.0 <= summary["overall"]["strict"] <= 1.0
    assert (out / "grid.png").stat().st_size > 0


def test_bootstrap_interval_brackets_the_mean():
    from omnirl.tools.eval_shapes import bootstrap_ci

    values = np.array([1.0] * 30 + [0.0] * 70)
    lo, hi = bootstrap_ci(values)
    assert lo < 0.3 < hi and lo > 0.18 and hi < 0.42


def test_cluster_bootstrap_moves_repeated_prompts_together():
    from omnirl.tools.eval_shapes import bootstrap_ci, cluster_bootstrap_ci

    rng = np.random.default_rng(1)
    values = rng.random(40)
    # one line per prompt: the plain bootstrap of the lines' mean
    means = values[np.random.default_rng(0).integers(0, 40, size=(2000, 40))].mean(axis=1)
    expected = (float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975)))
    assert cluster_bootstrap_ci(values, list(range(40))) == pytest.approx(expected, abs=1e-12)
    assert bootstrap_ci(values) == pytest.approx(expected, abs=1e-12)
    # two prompts, 50 lines each, one always passing: the lines alone look certain, the
    # prompts span everything from one prompt's mean to the other's
    values = np.array([1.0] * 50 + [0.0] * 50)
    clusters = ["a"] * 50 + ["b"] * 50
    lo, hi = bootstrap_ci(values)
    assert 0.35 < lo < hi < 0.65
    assert cluster_bootstrap_ci(values, clusters) == (0.0, 1.0)


def test_shapes_eval_reward_prefers_the_correct_render():
    from omnirl.reward.scorers import ScoreBatch, build_reward

    reward = build_reward("shapes_eval")
    assert reward.components[0] == "partial" and "metadata" in reward.reads
    text = "a photo of a red circle left of a blue square"
    spec = ShapeSpec.from_text(text)
    right = render(spec, 32, seed=1)
    wrong = render(ShapeSpec.from_text("a photo of a blue square left of a red circle"), 32, seed=1)
    out = reward(ScoreBatch(np.stack([right, wrong]), [text, text]))
    assert out["partial"][0] > out["partial"][1] and out["partial"][0] > 0.9
    assert out["strict"] == [1.0, 0.0]
    # metadata, when present, is the spec (the text is not parsed)
    meta = spec.to_metadata()
    with_meta = reward(ScoreBatch(np.stack([right, wrong]), ["?", "?"], [meta, meta]))
    assert with_meta == out
    with pytest.raises(ValueError):
        reward(ScoreBatch(np.stack([right]), ["a photo of a zebra"]))


def test_eval_loads_a_trainer_saved_lora_like_a_weight_update(pretrained, tmp_path):
    import torch

    from omnirl.models.shapes_t2i import ShapesT2IRolloutAdapter, ShapesT2ITrainingAdapter
    from omnirl.tools.eval_shapes import evaluate
    from omnirl.tools.policy_loading import load_adapter

    lora = {"r": 4, "lora_alpha": 8}
    train = ShapesT2ITrainingAdapter.from_pretrained(pretrained, lora=lora)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in train.trainable_parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen))
    train.save_pretrained(tmp_path / "lora")
    pushed = ShapesT2IRolloutAdapter.from_pretrained(pretrained, lora=lora)
    pushed.load_weights("lora", train.export_weights())
    specs = generate_prompts(2, "heldout", seed=0)
    kw = {"seeds": 1, "num_steps": 2}
    from_disk = evaluate(
        load_adapter(pretrained, lora=tmp_path / "lora", lora_alpha=8), specs, **kw
    )
    base = evaluate(load_adapter(pretrained), specs, **kw)
    expected = evaluate(pushed, specs, **kw)
    assert np.array_equal(from_disk.images, expected.images)
    assert not np.array_equal(base.images, expected.images)
    with pytest.raises(FileNotFoundError):
        load_adapter(pretrained, lora=tmp_path)


def test_shapes_curve_scores_base_and_checkpoints_with_their_lora_scale(pretrained, tmp_path):
    """A run folder as the trainer writes it (checkpoint policy/ with adapter_config.json,
    config.yaml, metrics.jsonl): the curve has the base at minute 0 and the checkpoint at its
    elapsed time, and the checkpoint is sampled with its own alpha / r."""
    import torch
    import yaml

    from omnirl.models.shapes_t2i import ShapesT2IRolloutAdapter, ShapesT2ITrainingAdapter
    from omnirl.tools.eval_shapes import evaluate, summarise
    from omnirl.tools.policy_loading import apply_policy, load_adapter
    from omnirl.tools.shapes_curve import main
    from omnirl.trainer.checkpoint import save_checkpoint
    from omnirl.trainer.ema import EMA

    lora = {"r": 4, "lora_alpha": 16}  # scale 4: a reader that assumed alpha = r would differ
    train = ShapesT2ITrainingAdapter.from_pretrained(pretrained, lora=lora)
    ema = EMA(list(train.trainable_parameters()), decay=0.5, warmup=False)  # the LoRA at init
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in train.trainable_parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen))
    run = tmp_path / "run"
    config = {
        "run": {"name": "curve_test"},
        "model": {"path": str(pretrained), "lora": {"r": 4, "alpha": 16}},
        "sampling": {"num_steps": 2, "guidance_scale": 3.0, "height": 32, "width": 32},
    }
    save_checkpoint(
        run / "checkpoints",
        2,
        state={},
        adapter=train,
        train_step=SimpleNamespace(ema=ema, state_dict=dict),
        config_yaml=yaml.safe_dump(config),
    )
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "elapsed_s": 30.0 * s}) + "\n" for s in (1, 2))
    )
    prompts = tmp_path / "p.jsonl"
    specs = generate_prompts(3, "heldout", seed=0)
    prompts.write_text(
        "".join(json.dumps({"prompt": s.text, "metadata": s.to_metadata()}) + "\n" for s in specs)
    )
    assert main([str(run), "--prompts", str(prompts), "--seeds", "1"]) == 0
    rows = json.loads((run / "curve" / "curve.json").read_text())
    assert [(r["step"], r["minutes"]) for r in rows] == [(0, 0.0), (2, 1.0)]
    assert "gain_vs_base" in rows[1] and set(rows[1]["categories"]) <= set(rows[0]["categories"])
    gain = rows[1]["gain_vs_base"]["overall"]
    assert gain["prompts"] == 3 and gain["distinct"] == len(set(specs))
    assert gain["ci95_distinct"][0] <= gain["gain"] <= gain["ci95_distinct"][1]
    for name in ("curve.png", "before_after.png"):
        assert (run / "curve" / name).stat().st_size > 1000
    assert {(r["num_steps"], r["guidance_scale"]) for r in rows} == {(2, 3.0)}
    # --steps / --cfg: scored with other sampling settings than the run's, and says so
    assert main([str(run), "--prompts", str(prompts), "--seeds", "1", "--steps", "3",
                 "--cfg", "1.5", "--out", str(tmp_path / "c3")]) == 0  # fmt: skip
    rows3 = json.loads((tmp_path / "c3" / "curve.json").read_text())
    assert {(r["num_steps"], r["guidance_scale"]) for r in rows3} == {(3, 1.5)}
    base3 = evaluate(load_adapter(pretrained), specs, seeds=1, num_steps=3, guidance_scale=1.5)
    assert rows3[0]["overall"]["strict"] == summarise(base3)["overall"]["strict"]

    pushed = ShapesT2IRolloutAdapter.from_pretrained(pretrained, lora=lora)
    pushed.load_weights("lora", train.export_weights())
    loaded = load_adapter(pretrained)
    apply_policy(loaded, run / "checkpoints" / "step_00000002" / "policy", {})
    kw = {"seeds": 1, "num_steps": 2}
    expected = evaluate(pushed, specs, **kw)
    assert np.array_equal(evaluate(loaded, specs, **kw).images, expected.images)
    # eval_shapes takes the trainer checkpoint itself: step_N, the latest pointer, the run
    for name in ("checkpoints/step_00000002", "checkpoints/latest", "checkpoints", "."):
        by_checkpoint = load_adapter(run / name)
        assert np.array_equal(evaluate(by_checkpoint, specs, **kw).images, expected.images), name
    # --ema: the averaged weights (here the LoRA at init, B = 0: the base model's images)
    base_images = evaluate(load_adapter(pretrained), specs, **kw).images
    assert np.array_equal(evaluate(load_adapter(run, ema=True), specs, **kw).images, base_images)
    with pytest.raises(FileNotFoundError, match="policy_ema"):
        load_adapter(pretrained, ema=True)
    (run / "checkpoints" / "step_00000002" / "policy" / "adapter_config.json").unlink()
    unscaled = load_adapter(pretrained)
    apply_policy(unscaled, run / "checkpoints" / "step_00000002" / "policy", {})  # alpha = r
    assert not np.array_equal(evaluate(unscaled, specs, **kw).images, expected.images)


def test_summary_counts_the_distinct_prompts_among_the_lines():
    from omnirl.tools.eval_shapes import EvalRun, format_table, load_prompt_file, summarise

    specs = load_prompt_file(ROOT / "examples" / "prompts" / "shapes_heldout.jsonl")
    two = [s for s in specs if s.category == "two_object"]
    single = [s for s in specs if s.category == "single_object"]
    chosen = two[:10] + single[:10]
    n = len(chosen)
    run = EvalRun(
        specs=chosen,
        strict=np.zeros((n, 2), dtype=bool),
        partial=np.zeros((n, 2)),
        images=np.zeros((n, 2, 4, 4, 3), dtype=np.uint8),
        seconds=0.0,
    )
    summary = summarise(run)
    cats = summary["categories"]
    assert cats["two_object"]["prompts"] == 10
    # the held-out split keeps one shape pair for two objects, in either order
    assert cats["two_object"]["distinct"] == len({s.text for s in two[:10]}) <= 2
    assert cats["single_object"]["distinct"] == len({s.text for s in single[:10]}) <= 3
    assert summary["overall"]["distinct"] == (
        cats["two_object"]["distinct"] + cats["single_object"]["distinct"]
    )
    assert "distinct" in format_table(summary).splitlines()[0]


def test_unnamed_colours_show_a_policy_that_draws_one_colour_only():
    """Renders of the prompts that name no colour, all in red, against the same prompts in
    the renderer's own colours: both pass strict, only the colour entropy tells them apart."""
    import dataclasses

    from omnirl.reward.shapes.render import render
    from omnirl.tools.eval_shapes import format_table, load_prompt_file, score_images, summarise

    specs = load_prompt_file(ROOT / "examples" / "prompts" / "shapes_heldout.jsonl")
    free = [s for s in specs if all(o.colour is None for o in s.objects)][:40]
    named = [s for s in specs if all(o.colour is not None for o in s.objects)][:10]
    assert len(free) == 40 and len(named) == 10

    def red(spec):
        objects = tuple(dataclasses.replace(o, colour="red") for o in spec.objects)
        return dataclasses.replace(spec, objects=objects)

    chosen = free + named
    own = np.stack([[render(s, 32, seed=k) for k in range(2)] for s in chosen])
    all_red = np.stack(
        [[render(red(s) if s in free else s, 32, seed=k) for k in range(2)] for s in chosen]
    )
    varied, collapsed = (
        summarise(score_images(own, chosen)),
        summarise(score_images(all_red, chosen)),
    )
    for summary in (varied, collapsed):
        assert summary["overall"]["strict"] > 0.9  # the reward accepts either
        assert summary["unnamed_colours"]["images"] == 80
    assert collapsed["unnamed_colours"]["top"] == "red"
    assert collapsed["unnamed_colours"]["shares"]["red"] == 1.0
    assert collapsed["unnamed_colours"]["entropy"] == 0.0
    assert varied["unnamed_colours"]["entropy"] > 0.8
    assert varied["unnamed_colours"]["objects"] >= 80
    assert "entropy 0.00 of 1" in format_table(collapsed)


def test_score_images_passes_merge_parts_to_the_detector():
    from omnirl.reward.shapes.world import BACKGROUND, PALETTE, ShapeObject
    from omnirl.tools.eval_shapes import score_images

    image = np.full((32, 32, 3), BACKGROUND, dtype=np.uint8)
    image[10:22, 8:20] = PALETTE["purple"]
    image[10:22, 16:20] = (np.asarray(PALETTE["purple"]) * 0.35).astype(np.uint8)
    spec = ShapeSpec("colors", (ShapeObject(1, "purple", "square"),))
    images = image[None, None]  # one prompt, one image
    assert not score_images(images, [spec]).strict[0, 0]
    merged = score_images(images, [spec], merge_parts=True)
    assert merged.strict[0, 0] and merged.colours[0, 0].tolist() == [0, 0, 0, 0, 0, 1]
