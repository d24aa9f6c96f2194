"""Per-step metrics: one JSONL line, TensorBoard scalars, a sample image grid, a progress bar.

Files under ``<output_dir>``: ``metrics.jsonl`` (one JSON object per step, always with
``step`` and ``policy_version``), ``tb/`` (TensorBoard events), ``images/step_XXXXXX.png``
(every ``logging.image_grid_every`` steps: one row per group, one column per sample).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def image_grid(images: list[Any], max_rows: int = 8, max_cols: int = 8):
    """A uint8 ``[rows*H, cols*W, 3]`` numpy grid from per-group ``[G, H, W, 3]`` tensors."""
    import numpy as np

    rows = []
    for imgs in images[:max_rows]:
        arr = imgs.detach().cpu().numpy() if hasattr(imgs, "detach") else np.asarray(imgs)
        if arr.ndim == 5:  # video: first frame
            arr = arr[:, 0]
        arr = arr[:max_cols]
        rows.append(arr)
    if not rows:
        return None
    h, w = rows[0].shape[1:3]
    cols = max(r.shape[0] for r in rows)
    grid = np.zeros((len(rows) * h, cols * w, 3), dtype=np.uint8)
    for i, r in enumerate(rows):
        if r.shape[1:3] != (h, w):
            continue
        for j in range(r.shape[0]):
            grid[i * h : (i + 1) * h, j * w : (j + 1) * w] = r[j, ..., :3]
    return grid


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        if hasattr(v, "item") and getattr(v, "numel", lambda: 1)() == 1:
            v = v.item()
        if isinstance(v, bool | int | float) and math.isfinite(float(v)):
            out[k] = float(v)
    return out


class MetricsLogger:
    def __init__(
        self, output_dir: str | Path, logging_cfg: Any, *, max_steps: int, start_step: int = 0
    ):
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cfg = logging_cfg
        self._jsonl = (
            (self.dir / "metrics.jsonl").open("a", encoding="utf-8") if logging_cfg.jsonl else None
        )
        self._tb = None
        if logging_cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.dir / "tb"))
        self._bar = None
        if logging_cfg.progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(
                total=max_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True
            )

    def log_step(self, step: int, metrics: dict[str, Any], images: list[Any] | None = None) -> None:
        scalars = _scalars(metrics)
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, **scalars}, sort_keys=True) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k.replace(".", "/"), v, step)
        every = self.cfg.image_grid_every
        if every and images and step % every == 0:
            self._write_grid(step, images)
        if self._bar is not None:
            self._bar.update(1)
            shown = {
                k: scalars[k] for k in ("reward_mean", "loss", "staleness_mean") if k in scalars
            }
            self._bar.set_postfix({k: f"{v:.4g}" for k, v in shown.items()}, refresh=False)

    def _write_grid(self, step: int, images: list[Any]) -> None:
        grid = image_grid(images)
        if grid is None:
            return
        from PIL import Image

        path = self.dir / "images" / f"step_{step:06d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(grid).save(path)
        if self._tb is not None:
            self._tb.add_image("samples", grid, step, dataformats="HWC")

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()
