"""Load a checkpoint for sampling: a model folder, or a trainer checkpoint's policy applied
to the base model its config names, the way a rollout worker applies a weight update.

``load_adapter`` is what the evaluation tools (``eval_shapes``, ``shapes_curve``,
``shapes_preferences``) and benchmarks sample with; ``apply_policy`` swaps one checkpoint's
policy into a loaded adapter; ``read_lora`` reads a trainer-saved LoRA folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LORA_FILE = "pytorch_lora_weights.safetensors"


def read_lora(directory: str | Path, *, alpha: float | None = None) -> tuple[dict, dict]:
    """``(tensors, adapter_config)`` of a LoRA folder as a training adapter's
    ``save_pretrained`` writes it (``pytorch_lora_weights.safetensors``, keys prefixed
    ``transformer.``). The file does not record ``lora_alpha``: it comes from ``alpha``,
    else ``DIRECTORY/adapter_config.json``, else it is taken equal to the rank (scale 1).
    Rank and target modules are read from the tensors."""
    from safetensors.torch import load_file

    directory = Path(directory)
    path = directory / LORA_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {LORA_FILE} in {directory}")
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(path).items()}
    a_keys = [k for k in tensors if k.endswith(".lora_A.weight")]
    if not a_keys:
        raise ValueError(f"{path} holds no lora_A weights")
    rank = int(tensors[a_keys[0]].shape[0])
    targets = sorted({k.removesuffix(".lora_A.weight").split(".", 2)[-1] for k in a_keys})
    config_file = directory / "adapter_config.json"
    if alpha is None and config_file.is_file():
        alpha = json.loads(config_file.read_text()).get("lora_alpha")
    config = {"r": rank, "lora_alpha": float(alpha if alpha is not None else rank)}
    config["target_modules"] = targets
    return tensors, config


def apply_policy(adapter, policy: Path, config: dict[str, Any]) -> None:
    """Load a trainer checkpoint's ``policy/`` (LoRA folder or full transformer) into
    ``adapter``, the way a rollout worker applies a weight update."""
    if (policy / "transformer").is_dir():
        from safetensors.torch import load_file

        tensors = {}
        for f in sorted((policy / "transformer").glob("*.safetensors")):
            tensors.update(load_file(f))
        adapter.load_weights("full", tensors)
        return
    alpha = None
    if not (policy / "adapter_config.json").is_file():  # checkpoints before adapter_config.json
        alpha = (config.get("model", {}).get("lora") or {}).get("alpha")
    tensors, lora_config = read_lora(policy, alpha=alpha)
    adapter.load_weights("lora", tensors, adapter_config=lora_config)


def trainer_checkpoint(path: str | Path) -> Path | None:
    """The trainer checkpoint folder ``path`` names, or None when it is a model folder.

    Accepts ``checkpoints/step_N`` (``config.yaml`` and ``policy/``), the ``checkpoints/latest``
    pointer file, the ``checkpoints`` folder and a run's ``output_dir`` (both via ``latest``).
    """
    from omnirl.trainer.checkpoint import latest_checkpoint

    path = Path(path)
    if path.name == "latest" and path.is_file():
        path = path.parent
    for root in (path, path / "checkpoints"):
        found = latest_checkpoint(root) if not (root / "policy").is_dir() else root
        if found is not None and (found / "config.yaml").is_file() and (found / "policy").is_dir():
            return found
    return None


def load_adapter(
    checkpoint: str | Path,
    *,
    device: str = "cpu",
    lora: str | Path | None = None,
    lora_alpha: float | None = None,
    ema: bool = False,
):
    """The checkpoint's registered rollout adapter, with the LoRA folder ``lora`` applied
    the way a rollout worker applies a weight update (see :func:`read_lora`).

    ``checkpoint`` is a model folder or a trainer checkpoint (see :func:`trainer_checkpoint`):
    then the base model its ``config.yaml`` names is loaded and its policy applied, with
    ``ema`` its ``policy_ema/`` (the trainer's EMA of the weights)."""
    from omnirl.models.registry import architecture_of, get_rollout_adapter

    trained = trainer_checkpoint(checkpoint)
    config: dict[str, Any] = {}
    policy = "policy_ema" if ema else "policy"
    if ema and (trained is None or not (trained / policy).is_dir()):
        raise FileNotFoundError(
            f"{checkpoint}: no trainer checkpoint with a {policy}/ folder (the trainer writes "
            "it only with the EMA on: algorithm.overrides.ema_decay)"
        )
    if trained is not None:
        import yaml

        config = yaml.safe_load((trained / "config.yaml").read_text())
        checkpoint = config["model"]["path"]
    cls = get_rollout_adapter(architecture_of(checkpoint))
    adapter = cls.from_pretrained(checkpoint, device=device)
    if trained is not None:
        apply_policy(adapter, trained / policy, config)
    if lora is not None:
        tensors, lora_config = read_lora(lora, alpha=lora_alpha)
        adapter.load_weights("lora", tensors, adapter_config=lora_config)
    return adapter
