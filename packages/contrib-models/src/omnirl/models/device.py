"""Model dtypes by name, and the precision the model call runs at.

The model runs in its dtype (bf16 on a GPU); the scheduler, latents, log-probs and LoRA
weights stay float32 (``docs/algorithms.md``, "Numerics"). In a half-precision model the
transformer call runs under :func:`model_autocast`, as flow_grpo's does: the float32 LoRA
tensors are cast to the model dtype where they are used (their master copies and gradients
stay float32), so no float32 matmul and no float32 copy of the activations is left on the
hot path. Rollout and trainer make the call through one function
(:func:`omnirl.models.sd3.step.guided_velocity`), so both run the same kernels.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; raises ``ValueError`` naming the known ones."""
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; known: {sorted(DTYPES)}")
    return DTYPES[name]


def synchronize(device: torch.device | str) -> None:
    """Wait for every queued kernel and copy on ``device`` (nothing to wait for on a CPU)."""
    device = torch.device(device)
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _memory_api(device: torch.device, function: str):
    """The module whose ``function`` (``empty_cache``, ``max_memory_reserved``, ...) serves
    ``device``: ``torch.accelerator.memory`` in a torch that has it, else ``torch.cuda``;
    ``None`` on a CPU."""
    if device.type == "cpu":
        return None
    memory = getattr(torch.accelerator, "memory", None)
    if memory is not None and hasattr(memory, function):
        return memory
    return torch.cuda if device.type == "cuda" else None


def empty_cache(device: torch.device | str) -> None:
    """Return the caching allocator's free blocks on ``device`` to the driver, so that another
    process on the same GPU (a rollout worker beside the trainer) can have them; nothing on a
    CPU."""
    api = _memory_api(torch.device(device), "empty_cache")
    if api is not None:
        api.empty_cache()


def reset_peak_memory(device: torch.device | str) -> None:
    """Start :func:`peak_memory_gb`'s count afresh on ``device`` (nothing on a CPU)."""
    api = _memory_api(torch.device(device), "reset_peak_memory_stats")
    if api is not None:
        api.reset_peak_memory_stats(torch.device(device))


def peak_memory_gb(device: torch.device | str) -> dict[str, float]:
    """``{"allocated": GB, "reserved": GB}``: the most this process's tensors held on
    ``device``, and the most its caching allocator held from the driver (what another
    process on the same GPU cannot have), since the last :func:`reset_peak_memory`;
    ``{}`` on a CPU."""
    device = torch.device(device)
    api = _memory_api(device, "max_memory_reserved")
    if api is None:
        return {}
    return {
        "allocated": api.max_memory_allocated(device) / 1e9,
        "reserved": api.max_memory_reserved(device) / 1e9,
    }


def release_memory(device: torch.device | str | None) -> None:
    """After failed work has dropped its references: collect what is left of it (cycles),
    then :func:`empty_cache` on ``device`` (``None``: collect only)."""
    import gc

    gc.collect()
    if device is not None:
        empty_cache(device)


def model_autocast(device_type: str, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Autocast to ``dtype`` for a half-precision model on ``device_type``; a no-op for
    float32 models. On a CPU the attention itself runs in float32 (:class:`Float32Attention`)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return contextlib.nullcontext()
    if device_type != "cpu":
        return torch.autocast(device_type, dtype=dtype)
    stack = contextlib.ExitStack()
    stack.enter_context(torch.autocast(device_type, dtype=dtype))
    stack.enter_context(Float32Attention())
    return stack


class Float32Attention(TorchFunctionMode):
    """Inside it, ``scaled_dot_product_attention`` on half-precision inputs runs in float32
    and returns the inputs' dtype; every other call is untouched.

    For half-precision models on a CPU: torch's CPU attention forward + backward in bf16 is
    4.7x slower than in float32 at ShapesT2I's shape (80 tokens, head dim 24), while the
    matmuls around it are faster in bf16; with the attention in float32 the quick start's
    bf16 training step is 1.56x float32's eagerly and 1.99x compiled (``docs/benchmarks.md``,
    "bf16 on a CPU", ``benchmarks/cpu_precision.py``).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention and args[0].dtype in (
            torch.bfloat16,
            torch.float16,
        ):
            query, key, value, *rest = args
            with torch.autocast(query.device.type, enabled=False):
                out = func(query.float(), key.float(), value.float(), *rest, **kwargs)
            return out.to(query.dtype)
        return func(*args, **kwargs)


# ``torch.nn.functional.scaled_dot_product_attention`` kernels by name; "default" lets torch
# choose. On Hopper, cuDNN's fused attention is faster than FlashAttention-2 for the
# sequence lengths of image models (SD3.5-M at 512 px: 1,357 joint tokens).
ATTENTION_BACKENDS = ("default", "cudnn", "flash", "efficient", "math")


def _sdpa_kernels() -> dict:
    """Kernel name -> ``torch.nn.attention.SDPBackend``."""
    from torch.nn.attention import SDPBackend

    return {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }


def attention_backend(name: str) -> contextlib.AbstractContextManager:
    """A context in which SDPA prefers the named kernel (``"default"``: torch's choice).

    The named kernel goes first and the others follow as fallbacks (for shapes or dtypes it
    does not support). Enter it around compilation as well as the calls: a compiled graph
    keeps the kernel it was traced with; keep it entered for as long as it should hold (an
    entered context that is dropped is undone). Raises ``ValueError`` for an unknown name.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {list(ATTENTION_BACKENDS)}")
    if name == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel

    kernels = _sdpa_kernels()
    order = [kernels[name]] + [k for n, k in kernels.items() if n != name]
    return sdpa_kernel(order, set_priority=True)


def describe_attention_backends() -> str:
    """The SDPA kernels torch's flags allow now, most preferred first, e.g.
    ``"cudnn > flash > efficient > math"``: a GPU takes the first that supports the call; a
    CPU runs flash whenever it is allowed, math otherwise (it does not read the order).
    Logged at start, so a run shows the kernels it ran with."""
    from torch.nn.attention import SDPBackend

    flags = torch.backends.cuda
    enabled = {
        "flash": flags.flash_sdp_enabled(),
        "efficient": flags.mem_efficient_sdp_enabled(),
        "cudnn": flags.cudnn_sdp_enabled(),
        "math": flags.math_sdp_enabled(),
    }
    names = {kernel: name for name, kernel in _sdpa_kernels().items()}
    get_order = getattr(torch._C, "_get_sdp_priority_order", None)  # private; absent: flag order
    order = [SDPBackend(int(i)) for i in get_order()] if get_order else list(names)
    chosen = [names[b] for b in order if b in names and enabled[names[b]]]
    return " > ".join(chosen) or "none"
