"""Keep the attention's outputs saved when an activation memory budget makes a backward
recompute: a joint-graph pass of inductor that marks every attention kernel "must save".

Under ``CompileConfig.activation_memory_budget`` AOTAutograd's min-cut partitioner chooses,
cheapest first by its estimate, which of a compiled graph's activations to recompute in the
backward. It never recomputes the operators on its list of compute-intensive ones (matmuls,
convolutions, flash and memory-efficient attention), but that list lacks cuDNN's attention
(what SD3 runs on Hopper, ``omnirl.models.device``) and the CPU's flash attention, so a budget
re-runs their forward in the backward: at budget 0.5 on SD3.5-M the recomputed attention
added 279 ms to a step of about 4.7 s that the budget made 9 % slower in all
(``docs/gpu_sessions.md``, "GPU, seventeenth session"), to free a few per cent of the saved
bytes (95 MB of 2.37 GB a sample in the CPU's count, "GPU, twenty-second session").
:class:`SaveAttention` marks those nodes the way selective activation checkpointing marks
what a policy must save (``CheckpointPolicy.MUST_SAVE``), which the partitioner never
recomputes; the rest of the budget's choice is unchanged.

A pass of inductor (``torch._inductor.config.joint_custom_pre_pass``): it runs on the
joint forward-backward graph just before partitioning, and its :meth:`uuid` enters the
compile caches' keys, so a cached graph partitioned without it is not reused with it. Other
backends (``aot_eager``) do not run inductor's joint passes: under them a budget may still
recompute attention.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

log = logging.getLogger("omnirl.models.compile")

# the forward attention kernels SDPA dispatches to, by aten name (their backward kernels are
# never recomputed: they run in the backward already)
ATTENTION_KERNELS = frozenset(
    {
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_fused_attention_overrideable",
        "_flash_attention_forward",
        "_efficient_attention_forward",
        "_cudnn_attention_forward",
    }
)


def is_attention_kernel(node: torch.fx.Node) -> bool:
    """Whether ``node`` calls one of :data:`ATTENTION_KERNELS`."""
    packet = getattr(node.target, "_overloadpacket", None)
    return node.op == "call_function" and getattr(packet, "__name__", None) in ATTENTION_KERNELS


class SaveAttention(CustomGraphPass):
    """Mark every forward attention kernel of a joint graph ``MUST_SAVE`` (its outputs are
    kept for the backward whatever the memory budget)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        from torch.utils.checkpoint import CheckpointPolicy

        marked = 0
        for node in graph.nodes:
            if is_attention_kernel(node):
                node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
                marked += 1
        if marked:
            log.debug("activation memory budget: %d attention kernel(s) kept saved", marked)

    def uuid(self) -> str:
        return "omnirl.SaveAttention/1"


@contextlib.contextmanager
def attention_saved() -> Iterator[None]:
    """While inside, graphs inductor compiles keep their attention outputs saved
    (:class:`SaveAttention`). A joint pre-pass someone else set is left in place, with a
    warning (once per call site, not once per block call): inductor runs one."""
    from torch._inductor import config

    theirs = config.joint_custom_pre_pass
    if theirs is not None and not isinstance(theirs, SaveAttention):
        warnings.warn(
            f"torch._inductor.config.joint_custom_pre_pass is already set ({theirs!r}): the "
            "activation memory budget may recompute attention",
            stacklevel=3,
        )
        yield
        return
    with config.patch(joint_custom_pre_pass=SaveAttention()):
        yield
