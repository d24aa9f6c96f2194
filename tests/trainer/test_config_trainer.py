"""Trainer config: defaults <- file <- dotlist; unknown keys refused by name."""

from __future__ import annotations

import pytest

from omnirl.trainer.config import ConfigError, load_config

BASE = "model: {path: /m}\ndata: {prompts: /p.jsonl}\n"


def _write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_unknown_key_in_file_is_named(tmp_path):
    path = _write(tmp_path, BASE + "train: {groups_per_stepp: 3}\n")
    with pytest.raises(ConfigError, match=r"train\.groups_per_stepp"):
        load_config(path)


def test_unknown_top_level_key_in_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="'bogus'"):
        load_config(_write(tmp_path, BASE + "bogus: 1\n"))


def test_unknown_key_in_dotlist_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"runtime\.contrl_port"):
        load_config(_write(tmp_path, BASE), ["runtime.contrl_port=0"])


def test_wrong_type_and_missing_required_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.max_staleness"):
        load_config(_write(tmp_path, BASE), ["train.max_staleness=soon"])
    with pytest.raises(ConfigError, match=r"model\.path"):
        load_config(_write(tmp_path, "data: {prompts: /p.jsonl}\n"))
    with pytest.raises(ConfigError, match=r"train\.max_staleness"):
        load_config(_write(tmp_path, BASE), ["train.max_staleness=-1"])


def test_merge_order_and_lora_null(tmp_path):
    path = _write(tmp_path, "model: {path: /m, lora: null}\ndata: {prompts: /p.jsonl}\n"
                  "train: {groups_per_step: 3}\n")  # fmt: skip
    cfg = load_config(path, ["train.groups_per_step=5", "sampling.sde_window=[0,2]"])
    assert cfg.train.groups_per_step == 5
    assert cfg.model.lora is None  # full fine-tuning
    assert list(cfg.sampling.sde_window) == [0, 2]
    assert cfg.sampling.num_steps == 10  # the SamplingParams default, not restated anywhere


def test_prompt_order_follows_run_seed_unless_data_seed_is_set(tmp_path):
    from omnirl.trainer.data import PromptSource

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(f'{{"prompt": "p{i}"}}\n' for i in range(50)))
    path = _write(tmp_path, f"model: {{path: /m}}\ndata: {{prompts: {prompts}}}\n")

    def first_prompts(*overrides):
        cfg = load_config(path, list(overrides))
        source = PromptSource.from_config(cfg.data)
        return cfg.data.seed, [source.next().text for _ in range(10)]

    seed0, order0 = first_prompts()
    seed1, order1 = first_prompts("run.seed=1")
    assert (seed0, seed1) == (0, 1) and order0 != order1  # another replicate, another order
    assert first_prompts("run.seed=1", "data.seed=0") == (0, order0)  # the order pinned


def test_example_config_loads():
    cfg = load_config("examples/tiny_sd3_jpeg.yaml", ["runtime.control_port=0"])
    assert cfg.runtime.control_port == 0
    assert cfg.model.lora.r == 4


def test_shared_initial_noise_with_an_ode_sampler_is_refused():
    shapes = "examples/shapes_flow_grpo.yaml"  # same_initial_noise: true
    assert load_config(shapes).sampling.same_initial_noise is True
    for algorithm in ("diffusion_nft", "diffusion_dpo"):
        with pytest.raises(ConfigError, match=r"same_initial_noise.*identical"):
            load_config(shapes, [f"algorithm.name={algorithm}"])
        fixed = load_config(
            shapes, [f"algorithm.name={algorithm}", "sampling.same_initial_noise=null"]
        )
        assert fixed.sampling.same_initial_noise is None
    with pytest.raises(ConfigError, match="'ode' sampler"):
        load_config(shapes, ["sampling.sde_type=ode"])
