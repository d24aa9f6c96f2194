"""GPU-path options of the trainer: work the config makes unnecessary is skipped, model
options are read from ``train``, data-parallel shares line up, rollout warm-up shapes."""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil

import msgspec
import pytest
import torch

from omnirl.models.compile import is_compiled
from omnirl.models.registry import get_rollout_adapter, get_training_adapter
from omnirl.protocol.messages import PromptSpec, Rewards, SamplingParams, Topology, Welcome
from omnirl.rollout.model import warmup_lease
from omnirl.trainer.algorithms.update_metrics import MetricsAccumulator
from omnirl.trainer.backend import AdapterBackend, train_step_config
from omnirl.trainer.config import ConfigError, load_config
from omnirl.trainer.distributed import resolve_mode, split_rows
from omnirl.trainer.step import TrainStep

ARCH = "StableDiffusion3Pipeline"
DEVICE = os.environ.get("OMNIRL_TEST_DEVICE", "cpu")  # as tests/conftest.py's test_device
LORA = {"r": 4, "lora_alpha": 4}


@pytest.fixture(scope="module")
def groups(tiny_sd3_path):
    rollout = get_rollout_adapter(ARCH, "flow_grpo").from_pretrained(tiny_sd3_path, device=DEVICE)
    sampling = SamplingParams(
        group_size=2, num_steps=3, guidance_scale=1.0, height=32, width=32, sde_window=(0, 2)
    )
    prompts = [PromptSpec(group_id=f"g{i}", text=f"thing {i}") for i in range(2)]
    out = rollout.sample(prompts, sampling, lease_id="l", worker_id="w", policy_version=0)
    return [
        msgspec.structs.replace(g, rewards=Rewards(group_id=g.group_id, total=[0.0, float(i + 1)]))
        for i, g in enumerate(out)
    ]


@pytest.mark.parametrize(("kl_beta", "reference_passes"), [(0.0, 0), (0.1, 4)])
def test_reference_pass_only_with_a_kl_term(
    tiny_sd3_path, groups, torch_one_thread, kl_beta, reference_passes
):
    adapter = get_training_adapter(ARCH, "flow_grpo").from_pretrained(
        tiny_sd3_path, device=DEVICE, lora=LORA
    )
    entered = []
    reference = adapter.reference

    @contextlib.contextmanager
    def counting():
        entered.append(1)
        with reference():
            yield

    adapter.reference = counting
    config = TrainStep.Config(lr=1e-3, kl_beta=kl_beta, micro_batch_size=2)
    TrainStep(adapter, "flow_grpo", config).step(groups, policy_version=0)
    assert len(entered) == reference_passes  # 2 window steps x 2 micro-batches


def test_model_options_are_read_from_train_and_not_passed_to_the_step(
    tiny_sd3_path, tmp_path, caplog
):
    overrides = [
        f"model.path={tiny_sd3_path}",
        f"data.prompts={tmp_path / 'p.jsonl'}",
        "train.gradient_checkpointing=true",
        "train.compile=true",
        f"train.compile_cache={tmp_path / 'cache'}",
        "train.activation_memory_budget=0.5",
        "train.kl_beta=0.01",
    ]
    cfg = load_config(None, overrides)
    assert train_step_config(cfg).kl_beta == 0.01
    with caplog.at_level("INFO", logger="omnirl.models.compile"):
        backend = AdapterBackend(cfg)
    transformer = backend.adapter.transformer
    assert transformer.is_gradient_checkpointing and is_compiled(transformer)
    assert (tmp_path / "cache").is_dir()
    assert "activation memory budget 0.5, attention kept saved" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="omnirl.models.compile"):
        AdapterBackend(load_config(None, [*overrides, "train.recompute_attention=true"]))
    assert "activation memory budget 0.5, attention recomputable" in caplog.text
    plain = AdapterBackend(load_config(None, overrides[:2]))
    assert not plain.adapter.transformer.is_gradient_checkpointing
    assert not is_compiled(plain.adapter.transformer)


def test_only_train_step_fields_of_train_reach_the_step_config(tmp_path):
    """Every model and loop option of ``train`` set at once: none reaches TrainStep.Config
    (``activation_memory_budget`` once did, and the trainer refused its own key)."""
    base = [f"model.path={tmp_path}", f"data.prompts={tmp_path / 'p.jsonl'}"]
    overrides = [
        *base,
        "train.compile=true",
        "train.compile_mode=max-autotune-no-cudagraphs",
        f"train.compile_cache={tmp_path / 'cache'}",
        "train.activation_memory_budget=0.5",
        "train.recompute_attention=true",
        "train.gradient_checkpointing=true",
        "train.lr_warmup_steps=3",
        "train.lr=3e-4",
        "train.max_grad_norm=0.5",
    ]
    step = train_step_config(load_config(None, overrides))
    assert (step.lr, step.max_grad_norm) == (3e-4, 0.5)
    bad = load_config(None, [*base, "algorithm.overrides.nope=1"])
    with pytest.raises(ConfigError, match=r"unknown TrainStep.Config keys \['nope'\]"):
        train_step_config(bad)


def test_the_backend_converts_float8_layers_as_the_float8_keys_say(tiny_sd3_path, tmp_path):
    from omnirl.models.float8 import float8_layers

    # on the test device: a torch that refuses row-wise float8 on the CPU (2.11) has a GPU
    base = [
        f"model.path={tiny_sd3_path}",
        f"data.prompts={tmp_path / 'p.jsonl'}",
        f"run.device={DEVICE}",
    ]
    static = ["train.float8=true", "train.float8_activation=static"]
    reference = [*static, "train.float8_scope=reference"]
    backend = AdapterBackend(load_config(None, [*base, *reference, "train.kl_beta=0.01"]))
    layers = float8_layers(backend.adapter.transformer)
    assert layers and all(layer.activation == "static" and not layer.active for layer in layers)
    assert backend.adapter.float8.scope == "reference"
    with pytest.raises(ConfigError, match=r"float8_scope.*has no KL term"):
        AdapterBackend(load_config(None, [*base, *reference, "train.kl_beta=0"]))
    # refused before the model loads: a folder with the pipeline's index and no weights
    index_only = tmp_path / "index_only"
    index_only.mkdir()
    shutil.copy(pathlib.Path(tiny_sd3_path) / "model_index.json", index_only)
    no_weights = [f"model.path={index_only}", *base[1:], *reference, "train.kl_beta=0"]
    with pytest.raises(ConfigError, match=r"float8_scope.*has no KL term"):
        AdapterBackend(load_config(None, no_weights))
    # a forward-process objective: the same check on its step; static scales it would never
    # calibrate are refused
    nft = [*base, "algorithm.name=diffusion_nft"]
    with pytest.raises(ConfigError, match=r"diffusion_nft.*has no KL term"):
        AdapterBackend(
            load_config(
                None, [*nft, "train.kl_beta=0", "train.float8=true", "train.float8_scope=reference"]
            )
        )
    with pytest.raises(ConfigError, match=r"'static'.*forward-process objective"):
        AdapterBackend(load_config(None, [*nft, *static]))


@pytest.mark.parametrize(("rows", "chunk", "world"), [(5, 1, 2), (7, 2, 3), (1, 4, 2), (8, 4, 1)])
def test_data_parallel_shares_line_up(rows, chunk, world):
    all_rows = torch.arange(10, 10 + rows)
    shares = [split_rows(all_rows, chunk, rank=r, world_size=world) for r in range(world)]
    assert len({len(s) for s in shares}) == 1  # the same number of micro-batches everywhere
    assert all(len(m) <= chunk for s in shares for m in s)
    assert torch.equal(torch.cat([m for s in shares for m in s]), all_rows)
    if world == 1:
        assert [m.tolist() for m in shares[0]] == [m.tolist() for m in all_rows.split(chunk)]


def test_data_parallel_mode_resolution():
    assert resolve_mode("auto", world_size=1, lora=True) == "none"
    assert resolve_mode("auto", world_size=4, lora=True) == "ddp"
    assert resolve_mode("auto", world_size=4, lora=False) == "fsdp"
    assert resolve_mode("fsdp", world_size=1, lora=True) == "fsdp"
    with pytest.raises(ValueError, match="known"):
        resolve_mode("zero3", world_size=2, lora=True)


def test_metrics_merge_covers_every_rank():
    a, b = MetricsAccumulator(), MetricsAccumulator()
    a.add_samples({"ratio": torch.tensor([1.0, 1.0])})
    b.add_samples({"ratio": torch.tensor([3.0])})
    a.add_parity(torch.tensor([1e-6]))
    b.add_parity(torch.tensor([-4e-6]))
    a.add_update(grad_norm=1.0, loss=torch.tensor(0.5), policy_loss=0.5, kl=0.0)
    summary = a.to_cpu().merge([b.to_cpu()]).summary()
    assert summary["ratio_mean"] == pytest.approx(5 / 3)
    assert summary["behav_prox_logp_absdiff_max"] == pytest.approx(4e-6)
    assert summary["loss"] == 0.5


def test_rollout_warmup_lease_has_the_runs_shapes():
    topology = Topology(control="c", intake="i", weights="w")
    config = {
        "sampling": {"num_steps": 7, "height": 64, "width": 48, "guidance_scale": 3.0},
        "data": {"group_size": 4, "prompts_per_lease": 3},
    }
    welcome = Welcome(worker_id="w", run_id="r", topology=topology, policy_version=0, config=config)
    prompts, sampling = warmup_lease(welcome, capacity=2)
    assert len(prompts) == 2 and sampling.group_size == 4
    assert (sampling.num_steps, sampling.height, sampling.width) == (7, 64, 48)
    assert sampling.guidance_scale == 3.0


def test_attention_backend_is_validated_and_listed_alike_by_trainer_and_rollout():
    from omnirl.models.device import ATTENTION_BACKENDS, attention_backend
    from omnirl.rollout.cli import build_parser

    assert load_config(None, ["model.path=x", "data.prompts=p", "train.attention=cudnn"])
    with pytest.raises(ConfigError, match=r"train\.attention.*'fast'"):
        load_config(None, ["model.path=x", "data.prompts=p", "train.attention=fast"])
    action = next(a for a in build_parser()._actions if a.dest == "attention")
    assert tuple(action.choices) == ATTENTION_BACKENDS
    with pytest.raises(ValueError, match="unknown attention backend"):
        attention_backend("fast")


def test_compile_scope_is_validated_and_listed_alike_by_trainer_and_rollout():
    from omnirl.models.compile import COMPILE_SCOPES
    from omnirl.rollout.cli import build_parser

    base = ["model.path=x", "data.prompts=p"]
    assert load_config(None, [*base, "train.compile_scope=whole"]).train.compile_scope == "whole"
    with pytest.raises(ConfigError, match=r"train\.compile_scope.*'layers'"):
        load_config(None, [*base, "train.compile_scope=layers"])
    with pytest.raises(ConfigError, match=r"cannot run under train\.parallel=fsdp"):
        load_config(None, [*base, "train.compile_scope=whole", "train.parallel=fsdp"])
    # a compiled trainer's activation memory budget: in (0, 1], and only with compile
    budget = ["train.compile=true", "train.activation_memory_budget=0.5"]
    assert load_config(None, [*base, *budget]).train.activation_memory_budget == 0.5
    with pytest.raises(ConfigError, match=r"train\.recompute_attention.*only under"):
        load_config(None, [*base, "train.compile=true", "train.recompute_attention=true"])
    with pytest.raises(ConfigError, match=r"train\.activation_memory_budget.*needs train\.compile"):
        load_config(None, [*base, "train.activation_memory_budget=0.5"])
    with pytest.raises(ConfigError, match=r"train\.activation_memory_budget.*\(0, 1\], not 0\.0"):
        load_config(None, [*base, "train.compile=true", "train.activation_memory_budget=0"])
    # float8 training: LoRA runs only (no weight gradients through a float8 forward)
    assert load_config(None, [*base, "train.float8=true"]).train.float8 is True
    with pytest.raises(ConfigError, match=r"train\.float8.*needs model\.lora"):
        load_config(None, [*base, "train.float8=true", "model.lora=null"])
    static = ["train.float8=true", "train.float8_activation=static", "train.float8_scope=reference"]
    assert load_config(None, [*base, *static]).train.float8_scope == "reference"
    with pytest.raises(
        ConfigError, match=r"train\.float8_\*.*unknown float8 input gradient 'fp16'"
    ):
        load_config(None, [*base, "train.float8_input_grad=fp16"])
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "compile_scope")
    assert tuple(action.choices) == COMPILE_SCOPES
    args = parser.parse_args(["--trainer", "tcp://x:1", "--compile-scope", "whole"])
    assert args.compile_scope == "whole"


@pytest.mark.parametrize("name", ["default", "cudnn", "flash", "efficient", "math"])
def test_every_attention_backend_computes_attention_here(name):
    """A preferred kernel this device lacks falls back to one it has (same values)."""
    from omnirl.models.device import attention_backend

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 7, 16, generator=gen).to(DEVICE) for _ in range(3))
    expected = torch.softmax(q @ k.transpose(-1, -2) / 4.0, dim=-1) @ v
    with attention_backend(name):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(120)
def test_trainer_and_rollout_hold_the_chosen_attention_kernel_for_the_run(tmp_path):
    """`train.attention` and `rollout --attention` stay in force past start-up (a context
    entered and dropped was undone at once, and both ran with torch's default order)."""
    import subprocess
    import sys

    rollout = subprocess.run(
        [
            *(sys.executable, "-m", "omnirl.rollout.cli", "--trainer", "tcp://127.0.0.1:9"),
            *("--trainer-timeout", "1", "--attention", "math", "--worker-id", "r-att"),
        ],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert rollout.returncode == 2, rollout.stderr
    assert "r-att: attention math > " in rollout.stdout + rollout.stderr
    trainer = subprocess.run(
        [
            *(sys.executable, "-m", "omnirl.trainer.cli"),
            *("--config", "examples/shapes_flow_grpo.yaml", "--replay", str(tmp_path / "absent")),
            "train.attention=cudnn",
        ],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert trainer.returncode == 2 and "not a recording directory" in trainer.stderr
    assert "trainer: attention cudnn > " in trainer.stdout + trainer.stderr
