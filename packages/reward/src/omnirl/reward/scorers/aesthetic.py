"""Aesthetic predictor, LAION "improved aesthetic predictor" style: CLIP image embedding + MLP.

The L2-normalised CLIP image embedding ``[n, D]`` goes through an MLP
``D -> 1024 -> 128 -> 64 -> 16 -> 1`` (dropout between the first layers at training time,
identity here; no activations, as in the LAION head). The head's state dict uses the keys of
an ``nn.Sequential`` named ``layers``: ``layers.0``, ``layers.2``, ``layers.4``, ``layers.6``,
``layers.7`` (``.weight`` / ``.bias``); ``D`` is read from ``layers.0.weight``.

Real weights: the CLIP model ``openai/clip-vit-large-patch14`` (D = 768) in a folder, and the
head ``sac+logos+ava1-l14-linearMSE.pth`` from ``christophschuhmann/improved-aesthetic-predictor``
(a ``.pth`` state dict; a ``.safetensors`` file with the same keys works too):
``aesthetic(model=/models/clip-vit-large-patch14;head=/models/sac+logos+ava1-l14-linearMSE.pth)``.
Scores are on the LAION 1-10 scale.
"""

from __future__ import annotations

from pathlib import Path

from omnirl.reward.scorers.clip_score import ModelFolderError, image_embeddings, load_clip
from omnirl.reward.scorers.registry import ScoreBatch, register_reward

HEAD_LAYERS = (0, 2, 4, 6, 7)  # indices of the Linear layers in the LAION nn.Sequential
HEAD_WIDTHS = (1024, 128, 64, 16, 1)


def build_head(in_dim: int):
    """The LAION MLP head as ``nn.Sequential`` (dropouts at indices 1, 3, 5)."""
    from torch import nn

    widths = (in_dim, *HEAD_WIDTHS)
    layers: list = []
    for k in range(len(HEAD_WIDTHS)):
        layers.append(nn.Linear(widths[k], widths[k + 1]))
        if k < 3:
            layers.append(nn.Dropout(0.2 if k < 2 else 0.1))
    return nn.Sequential(*layers)


class AestheticHead:
    """Namespace for loading a head file into :func:`build_head`."""

    @staticmethod
    def load(path: str):
        import torch

        file = Path(path)
        if not file.is_file():
            raise ModelFolderError(f"aesthetic head file {path!r} does not exist")
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(file))
        else:
            state = torch.load(str(file), map_location="cpu", weights_only=True)
        state = {k.removeprefix("module."): v for k, v in state.items()}
        if "layers.0.weight" not in state:
            raise ModelFolderError(
                f"{path!r} is not a LAION aesthetic head: no 'layers.0.weight' "
                f"(keys: {sorted(state)[:6]})"
            )
        head = build_head(int(state["layers.0.weight"].shape[1]))
        wrapper = torch.nn.Module()
        wrapper.layers = head
        try:
            wrapper.load_state_dict(state, strict=True)
        except RuntimeError as exc:
            raise ModelFolderError(f"{path!r}: head weights do not fit: {exc}") from exc
        return head.eval().requires_grad_(False).float()


@register_reward("aesthetic")
class AestheticScore:
    """``aesthetic(model=CLIP_FOLDER;head=FILE[;processor=FOLDER;device=cpu;dtype=float32])``."""

    components = ("aesthetic",)
    reads = frozenset({"images"})
    batchable = True
    thread_safe = False

    def __init__(
        self,
        model: str,
        head: str,
        processor: str = "",
        device: str = "cpu",
        dtype: str = "float32",
    ):
        self.clip = load_clip(model, processor=processor, device=device, dtype=dtype)
        self.head = AestheticHead.load(head).to(self.clip.device)
        if self.head[0].in_features != self.clip.model.config.projection_dim:
            raise ModelFolderError(
                f"aesthetic head takes {self.head[0].in_features}-dim embeddings, the CLIP "
                f"model gives {self.clip.model.config.projection_dim}"
            )

    def __call__(self, batch: ScoreBatch) -> dict[str, list[float]]:
        import torch

        emb = image_embeddings(self.clip, batch.images)
        with torch.no_grad():
            return {"aesthetic": self.head(emb).squeeze(-1).tolist()}
