"""SD3's joint attention with each stream's q, k and v projections as one float8 matmul.

diffusers' ``JointAttnProcessor2_0`` calls ``to_q``, ``to_k`` and ``to_v`` (and the text
stream's ``add_q_proj``, ``add_k_proj``, ``add_v_proj``) one by one. With float8 linear
layers, :class:`FusedProjectionsJointAttnProcessor` computes the same attention with each
triple through :func:`omnirl.models.float8_fused.project_fused` (one quantisation, one
matmul, the LoRA branches per layer); a triple it cannot fuse runs layer by layer, so the
processor is correct for any layer types.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnirl.models.float8 import Float8Linear
from omnirl.models.float8_fused import base_layer, project_fused

SAMPLE_PROJECTIONS = ("to_q", "to_k", "to_v")
CONTEXT_PROJECTIONS = ("add_q_proj", "add_k_proj", "add_v_proj")


def _heads(x: Tensor, batch: int, heads: int) -> Tensor:
    """``[B, S, heads * d]`` -> ``[B, heads, S, d]``."""
    return x.view(batch, -1, heads, x.shape[-1] // heads).transpose(1, 2)


def _project(attn: nn.Module, names: tuple[str, ...], x: Tensor, batch: int):
    q, k, v = (
        _heads(t, batch, attn.heads) for t in project_fused([getattr(attn, n) for n in names], x)
    )
    return q, k, v


class FusedProjectionsJointAttnProcessor:
    """SD3's joint attention (diffusers' ``JointAttnProcessor2_0``'s computation: the sample
    stream, and the text stream when ``encoder_hidden_states`` is given, projected, q/k
    normalised, attended jointly, split back and projected out) with fused q/k/v projections.

    ``hidden_states`` ``[B, S_img, D]``, ``encoder_hidden_states`` ``[B, S_txt, D]`` or
    ``None``. Returns ``[B, S_img, D]``, or that and ``[B, S_txt, D]`` with a text stream.
    """

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor | None = None,
        attention_mask: Tensor | None = None,
    ):
        if attention_mask is not None:
            raise ValueError("SD3's joint attention takes no attention mask")
        batch, image_tokens = hidden_states.shape[:2]
        query, key, value = _project(attn, SAMPLE_PROJECTIONS, hidden_states, batch)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if encoder_hidden_states is not None:
            c_query, c_key, c_value = _project(
                attn, CONTEXT_PROJECTIONS, encoder_hidden_states, batch
            )
            if attn.norm_added_q is not None:
                c_query = attn.norm_added_q(c_query)
            if attn.norm_added_k is not None:
                c_key = attn.norm_added_k(c_key)
            query = torch.cat([query, c_query], dim=2)
            key = torch.cat([key, c_key], dim=2)
            value = torch.cat([value, c_value], dim=2)
        out = F.scaled_dot_product_attention(query, key, value, dropout_p=0.0, is_causal=False)
        out = out.transpose(1, 2).reshape(batch, -1, attn.heads * query.shape[-1]).to(query.dtype)
        context = None
        if encoder_hidden_states is not None:
            out, context = out[:, :image_tokens], out[:, image_tokens:]
            if not attn.context_pre_only:
                context = attn.to_add_out(context)
        out = attn.to_out[1](attn.to_out[0](out))
        return out if encoder_hidden_states is None else (out, context)


def fuse_projections(transformer: nn.Module, fuse: bool = True) -> int:
    """Give every joint attention of ``transformer`` whose q/k/v projections are float8
    layers the fused processor (``fuse=False``: diffusers' ``JointAttnProcessor2_0`` back);
    returns how many attentions have the fused processor afterwards. Idempotent; call after
    the float8 conversion (a compiled block recompiles once on its next call)."""
    from diffusers.models.attention_processor import Attention, JointAttnProcessor2_0

    count = 0
    for module in transformer.modules():
        if not isinstance(module, Attention):
            continue
        fused = isinstance(module.processor, FusedProjectionsJointAttnProcessor)
        if not fuse:
            if fused:
                module.set_processor(JointAttnProcessor2_0())
            continue
        if not fused and type(module.processor) is JointAttnProcessor2_0 and _float8_triple(module):
            module.set_processor(FusedProjectionsJointAttnProcessor())
            fused = True
        count += fused
    return count


def _float8_triple(attn: nn.Module) -> bool:
    return all(type(base_layer(getattr(attn, n))) is Float8Linear for n in SAMPLE_PROJECTIONS)
