"""Checkpoints: save everything a trainer needs to continue, atomically; find and load them.

Layout of ``<checkpoint dir>/step_XXXXXXXX/``::

    policy/               adapter.save_pretrained(): a LoRA loadable by diffusers'
                          load_lora_weights (+ adapter_config.json: rank, alpha, targets),
                          or the full weights as safetensors
    policy_ema/           the same with the TrainStep's EMA of the trainable parameters
                          swapped in (only when the EMA is on: ``ema_decay``)
    trainable.safetensors every trainable parameter, in trainable_parameters() order
                          (what resume copies back; independent of naming schemes)
    train_step.pt         TrainStep.state_dict(): optimiser, EMA, algorithm state, static
                          float8 scales (a resumed float8 trainer does not recalibrate)
    state.pt              version, step, data-loader state, ledger, RNG states
    config.yaml           the resolved config of the run

A checkpoint is written into a temporary sibling folder and renamed into place, and
``latest`` (a one-line file naming the folder) is replaced atomically afterwards, so a
crash at any point leaves the previous checkpoint intact and ``latest`` valid.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, or does not fit the model being resumed."""


def rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _save_policy(adapter: Any, folder: Path) -> None:
    adapter.save_pretrained(str(folder))
    if adapter.weight_format == "lora":  # the LoRA file holds no alpha: keep the scale
        config = json.dumps(adapter.adapter_config(), indent=2, sort_keys=True, default=list)
        (folder / "adapter_config.json").write_text(config + "\n")


def save_checkpoint(
    root: str | Path,
    step: int,
    *,
    state: dict[str, Any],
    adapter: Any = None,
    train_step: Any = None,
    config_yaml: str = "",
    keep_last: int = 0,
) -> Path:
    """Write checkpoint ``step`` under ``root``; returns its folder.

    ``state`` holds plain data and tensors (version, data-loader state, ledger, ...); RNG
    states are added here. ``keep_last > 0`` deletes older checkpoints beyond that many.
    """
    from safetensors.torch import save_file

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:08d}"
    final = root / name
    tmp = root / f".{name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    if adapter is not None:
        _save_policy(adapter, tmp / "policy")
        ema = getattr(train_step, "ema", None)
        if ema is not None:
            with ema.swapped_in():
                _save_policy(adapter, tmp / "policy_ema")
        params = list(adapter.trainable_parameters())
        save_file(
            {f"p{i:05d}": p.detach().to("cpu").contiguous() for i, p in enumerate(params)},
            str(tmp / "trainable.safetensors"),
        )
    if train_step is not None:
        torch.save(train_step.state_dict(), tmp / "train_step.pt")
    torch.save({**state, "step": step, "rng": rng_state()}, tmp / "state.pt")
    (tmp / "config.yaml").write_text(config_yaml)
    if final.exists():  # re-saving a step (e.g. after a resume): replace it
        old = root / f".{name}.old-{os.getpid()}"
        os.replace(final, old)
        shutil.rmtree(old)
    os.replace(tmp, final)
    _atomic_write_text(root / LATEST, name + "\n")
    if keep_last > 0:
        for old in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoint folders under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step_*") if p.is_dir() and (p / "state.pt").is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The folder named by ``latest``, else the newest complete folder, else None."""
    root = Path(root)
    pointer = root / LATEST
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if (candidate / "state.pt").is_file():
            return candidate
    found = list_checkpoints(root)
    return found[-1] if found else None


@dataclass
class LoadedCheckpoint:
    path: Path
    step: int
    state: dict[str, Any]  # as saved, RNG included (restore it with set_rng_state)


def load_checkpoint(
    path: str | Path, *, adapter: Any = None, train_step: Any = None
) -> LoadedCheckpoint:
    """Read a checkpoint; copy its trainable parameters into ``adapter`` and its optimiser
    state into ``train_step`` when given. RNG states are returned, not applied."""
    path = Path(path)
    if not (path / "state.pt").is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no state.pt)")
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    if adapter is not None:
        from safetensors.torch import load_file

        saved = load_file(str(path / "trainable.safetensors"))
        params = list(adapter.trainable_parameters())
        if len(saved) != len(params):
            raise CheckpointError(
                f"{path}: {len(saved)} saved trainable tensors, the model has {len(params)}"
            )
        with torch.no_grad():
            for i, p in enumerate(params):
                t = saved[f"p{i:05d}"]
                if tuple(t.shape) != tuple(p.shape):
                    raise CheckpointError(
                        f"{path}: trainable tensor {i} has shape {tuple(t.shape)}, "
                        f"the model's is {tuple(p.shape)}"
                    )
                p.copy_(t.to(device=p.device, dtype=p.dtype))
    if train_step is not None and (path / "train_step.pt").is_file():
        train_step.load_state_dict(
            torch.load(path / "train_step.pt", map_location="cpu", weights_only=False)
        )
    return LoadedCheckpoint(path=path, step=int(state["step"]), state=state)
