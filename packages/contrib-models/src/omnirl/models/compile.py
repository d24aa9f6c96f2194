"""Regional ``torch.compile`` of a denoiser: each repeated block compiled, the rest eager.

A diffusion transformer is a stack of a few block variants (SD3.5-Medium: 24
``JointTransformerBlock`` of three kinds: with dual attention, without, and the last,
context-pre-only one). Compiling each block instead of the whole model gives the same
fused kernels (the element-wise work between matmuls: q/k RMSNorm, adaLN modulate and gate)
for a fraction of the compile time: one graph per block variant, shape and mode, reused
by every block of that variant. What stays eager (patch embedding, the timestep MLP, the
output projection) is a few kernels per forward.

Each block's ``forward`` is replaced by its compiled version, so module hooks (FSDP2's
all-gathers, gradient checkpointing) run eagerly around it, the module tree and its
``state_dict`` keys stay as they were, and a LoRA adapter added later is traced on the next
call (a guard fails, the block recompiles once).

Shapes are static by default (``dynamic=False``): one graph per input shape. A SD3 text
sequence has a fixed length (CLIP's 77 + ``max_sequence_length`` T5 tokens, padded by the
tokenizers), so prompt length never changes a shape; batch rows and resolution do.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger("omnirl.models.compile")

# what one compiled graph covers: each repeated block (fast to compile, one graph reused by
# every block of a variant) or the whole denoiser (one graph per call: fusion across block
# boundaries and, under "reduce-overhead", one CUDA graph replay per model call; the compile
# time grows with the depth)
COMPILE_SCOPES = ("blocks", "whole")


def regional_scope(scope: str) -> bool:
    """``CompileConfig.regional`` for a scope name: ``"blocks"`` -> True, ``"whole"`` -> False."""
    if scope not in COMPILE_SCOPES:
        raise ValueError(f"unknown compile scope {scope!r}; known: {', '.join(COMPILE_SCOPES)}")
    return scope == "blocks"


@dataclass(frozen=True, kw_only=True, slots=True)
class CompileConfig:
    """How to compile a denoiser.

    ``mode``: ``torch.compile``'s (``None``: default; ``"reduce-overhead"``: CUDA graphs;
    ``"max-autotune-no-cudagraphs"``: autotuned matmuls, slow to compile). ``backend``:
    ``"inductor"``; ``"aot_eager"`` or ``"eager"`` trace without generating kernels (tests).
    ``regional``: compile each repeated block (``False``: the whole module, one graph).
    ``cache_dir``: persistent compile cache (see :mod:`omnirl.models.compile_cache`).
    ``recompile_limit``: graphs dynamo keeps per code object before it falls back to eager;
    every block variant, shape, grad mode and adapter state is one.
    ``activation_memory_budget``: for a compiled graph with a backward, the fraction (0 to
    1] of the activations it would save that it may keep; the rest it recomputes in the
    backward, cheapest first (AOTAutograd's min-cut partitioner,
    ``torch._functorch.config.activation_memory_budget``). ``None``: torch's default (1:
    recompute only what is free). A finer trade than gradient checkpointing, which saves only
    each block's inputs. A forward without a backward (a rollout, a no-grad pass) is
    unchanged. Under a budget the attention kernels' outputs stay saved unless
    ``recompute_attention`` (torch's partitioner alone re-ran cuDNN's attention forward in
    the backward, 279 ms of SD3.5-M's 4.7 s step at 0.5; :mod:`omnirl.models.compile_attention`,
    inductor only).
    """

    mode: str | None = None
    backend: str | Callable = "inductor"
    dynamic: bool | None = False
    fullgraph: bool = False
    regional: bool = True
    cache_dir: str | None = None
    recompile_limit: int = 64
    activation_memory_budget: float | None = None
    recompute_attention: bool = False

    def __post_init__(self) -> None:
        budget = self.activation_memory_budget
        if budget is not None and not 0.0 < budget <= 1.0:
            raise ValueError(f"activation_memory_budget must be in (0, 1], not {budget}")

    @property
    def cudagraphs(self) -> bool:
        return self.mode is not None and "reduce-overhead" in self.mode

    def replace(self, **changes) -> CompileConfig:
        return dataclasses.replace(self, **changes)


def repeated_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The module's repeated blocks, in order.

    Found by class name: the model's ``_repeated_blocks`` (diffusers' regional compilation
    attribute) or else its ``_no_split_modules`` (the blocks device-map and FSDP split at).
    Returns ``[]`` when the model names neither.
    """
    names = getattr(module, "_repeated_blocks", None) or getattr(module, "_no_split_modules", None)
    if not names:
        return []
    names = set(names)
    return [m for m in module.modules() if m is not module and type(m).__name__ in names]


def configure_dynamo(config: CompileConfig) -> None:
    """Raise dynamo's per-code-object recompile limit to ``config.recompile_limit``."""
    import torch._dynamo

    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    if getattr(cfg, name) < config.recompile_limit:
        setattr(cfg, name, config.recompile_limit)
    total = "accumulated_recompile_limit"
    if not hasattr(cfg, total):
        total = "accumulated_cache_size_limit"
    if hasattr(cfg, total) and getattr(cfg, total) < 8 * config.recompile_limit:
        setattr(cfg, total, 8 * config.recompile_limit)


def compile_module(module: torch.nn.Module, config: CompileConfig) -> list[str]:
    """Compile ``module`` in place as ``config`` says; return the names of compiled modules.

    Regional: every block of :func:`repeated_blocks` gets a compiled ``forward``; a model
    without named blocks is compiled whole. Idempotent: an already compiled module is left
    as it is. Compilation itself happens at the first call of each shape.
    """
    if config.cache_dir:
        from omnirl.models.compile_cache import use_cache_dir

        use_cache_dir(config.cache_dir)
    configure_dynamo(config)
    targets = repeated_blocks(module) if config.regional else []
    if not targets:
        targets = [module]
    names = {id(m): n for n, m in module.named_modules()}
    compiled = []
    for target in targets:
        if getattr(target, "_omnirl_compiled", False):
            continue
        compiled_forward = torch.compile(
            target.forward,
            mode=config.mode,
            backend=config.backend,
            dynamic=config.dynamic,
            fullgraph=config.fullgraph,
        )
        if config.activation_memory_budget is not None:
            compiled_forward = _with_memory_budget(
                compiled_forward,
                config.activation_memory_budget,
                save_attention=not config.recompute_attention,
            )
        target.forward = compiled_forward
        target._omnirl_compiled = True
        compiled.append(names.get(id(target), "") or type(target).__name__)
    budget = ""
    if config.activation_memory_budget is not None:
        attention = "recomputable" if config.recompute_attention else "kept saved"
        budget = (
            f", activation memory budget {config.activation_memory_budget}, attention {attention}"
        )
    log.info(
        "compiled %d module(s) (%s, mode %s, backend %s%s)",
        len(compiled),
        "regional" if targets[0] is not module else "whole",
        config.mode,
        config.backend,
        budget,
    )
    return compiled


def _with_memory_budget(forward: Callable, budget: float, *, save_attention: bool) -> Callable:
    """``forward`` with AOTAutograd's activation memory budget set while it runs (and, with
    ``save_attention``, inductor's pass that keeps attention outputs saved): the partitioner
    reads them when a call compiles (a shape's first call), not at ``torch.compile``."""
    import contextlib
    import functools

    import torch._functorch.config as functorch_config

    if save_attention:
        from omnirl.models.compile_attention import attention_saved
    else:
        attention_saved = contextlib.nullcontext

    @functools.wraps(forward)
    def budgeted(*args, **kwargs):
        with functorch_config.patch(activation_memory_budget=budget), attention_saved():
            return forward(*args, **kwargs)

    return budgeted


def is_compiled(module: torch.nn.Module) -> bool:
    """Whether :func:`compile_module` compiled ``module`` or any of its submodules."""
    return any(getattr(m, "_omnirl_compiled", False) for m in module.modules())


def step_begin(config: CompileConfig | None) -> None:
    """Mark a new iteration for CUDA graph trees (call once before each model call under
    ``mode="reduce-overhead"``, so outputs of the previous replay may be overwritten)."""
    if config is not None and config.cudagraphs:
        torch.compiler.cudagraph_mark_step_begin()
