"""cuDNN's float8 attention through cuDNN's Python frontend: what it supports, and its forward.

Issue 9's last lead for a faster attention was a float8 one with a backward (Transformer
Engine's float8 attention is cuDNN's). torch 2.11 has none; cuDNN's (``sdpa_fp8`` /
``sdpa_fp8_backward``) is reachable from Python through the ``nvidia-cudnn-frontend`` wheel
(``import cudnn``; ``benchmarks/device_wheels.sh --cudnn`` fetches it for the device).

- :func:`support` builds the forward and backward graphs for a shape and asks cuDNN's own
  checks (``validate``) whether a GPU architecture runs them. It needs no GPU: the
  architecture is named (``sm_version``), so it runs on this CPU machine too:

      uv run --with nvidia-cudnn-frontend==1.21.0 python benchmarks/cudnn_fp8_attention.py

- :class:`CudnnFp8Forward` runs the forward on a GPU (the attention probe times it).

Tensors are [B, H, S, D] in the caller's strides (``x.transpose(1, 2)`` of a [B, S, H, D]
projection is fine). Scaling, one float32 on the device per tensor, no host round trip:
``q``, ``k``, ``v`` are quantised to e4m3 with their current amax (``x * 448 / amax``); the
softmax probabilities, in [0, 1], with a fixed 256; the output, a convex combination of the
rows of ``v``, with ``v``'s own scale, so it cannot overflow.
"""

from __future__ import annotations

import json
import sys

import torch

E4M3_MAX = 448.0
PROBS_SCALE = 256.0  # softmax probabilities are <= 1; a power of two under e4m3's 448
_SCALAR = ((1, 1, 1, 1), (1, 1, 1, 1))


def quantize_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` as e4m3 with one scale for the tensor, and its descale ([1, 1, 1, 1] float32):
    ``x ~ x8.float() * descale``. Keeps ``x``'s strides."""
    amax = x.detach().abs().amax().float().clamp(min=1e-12)
    scale = E4M3_MAX / amax
    return (x.float() * scale).to(torch.float8_e4m3fn), (1.0 / scale).reshape(1, 1, 1, 1)


def _scalar(value: float, device: torch.device) -> torch.Tensor:
    """A [1, 1, 1, 1] float32 on ``device``: the shape cuDNN's graphs take a scale in."""
    return torch.full((1, 1, 1, 1), value, dtype=torch.float32, device=device)


class _Uids:
    """Declares a graph's tensors with consecutive uids, remembered by name."""

    def __init__(self, graph) -> None:
        self.graph, self.uids = graph, {}

    def input(self, name, dim, stride, dtype):
        self.uids[name] = len(self.uids) + 1
        return self.graph.tensor(uid=self.uids[name], dim=dim, stride=stride, data_type=dtype)

    def output(self, name, tensor, dim, stride, dtype) -> None:
        self.uids[name] = len(self.uids) + 1
        tensor.set_uid(self.uids[name]).set_output(True).set_dim(dim).set_stride(stride)
        tensor.set_data_type(dtype)


def _graph(cudnn, sm_version: int | None):
    kwargs = {"sm_version": sm_version, "sm_count": 132} if sm_version else {}
    return cudnn.pygraph(
        io_data_type=cudnn.data_type.FP8_E4M3,
        intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT,
        **kwargs,
    )


def forward_graph(cudnn, shape, stride, attn_scale, sm_version=None):
    """The float8 forward: e4m3 q, k, v -> e4m3 o and the float32 softmax statistics."""
    graph = _graph(cudnn, sm_version)
    t, fp8, f32 = _Uids(graph), cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    q, k, v = (t.input(n, shape, stride, fp8) for n in ("q", "k", "v"))
    scalars = {
        n: t.input(n, *_SCALAR, f32)
        for n in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
    }
    o, stats, amax_s, amax_o = graph.sdpa_fp8(
        q=q, k=k, v=v, **scalars, generate_stats=True, attn_scale=attn_scale,
        use_causal_mask=False,
    )  # fmt: skip
    b, h, s, _ = shape
    t.output("o", o, shape, stride, fp8)
    t.output("stats", stats, (b, h, s, 1), (h * s, s, 1, 1), f32)
    t.output("amax_s", amax_s, *_SCALAR, f32)
    t.output("amax_o", amax_o, *_SCALAR, f32)
    return graph, t.uids


def backward_graph(cudnn, shape, stride, attn_scale, sm_version=None, grad_dtype=None):
    """The float8 backward: e4m3 q, k, v, o, dO and the statistics -> dQ, dK, dV in
    ``grad_dtype`` (bf16 unless named)."""
    graph = _graph(cudnn, sm_version)
    t, fp8, f32 = _Uids(graph), cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    grad_dtype = grad_dtype or cudnn.data_type.BFLOAT16
    b, h, s, _ = shape
    q, k, v, o, d_o = (t.input(n, shape, stride, fp8) for n in ("q", "k", "v", "o", "dO"))
    stats = t.input("stats", (b, h, s, 1), (h * s, s, 1, 1), f32)
    descales = ("q", "k", "v", "o", "dO", "s", "dP")
    scales = ("s", "dQ", "dK", "dV", "dP")
    names = [f"descale_{n}" for n in descales] + [f"scale_{n}" for n in scales]
    scalars = {n: t.input(n, *_SCALAR, f32) for n in names}
    outs = graph.sdpa_fp8_backward(
        q=q, k=k, v=v, o=o, dO=d_o, stats=stats, **scalars, attn_scale=attn_scale,
        use_causal_mask=False,
    )  # fmt: skip
    for name, tensor in zip(("dQ", "dK", "dV"), outs[:3], strict=True):
        t.output(name, tensor, shape, stride, grad_dtype)
    for name, tensor in zip(("amax_dQ", "amax_dK", "amax_dV", "amax_dP"), outs[3:], strict=True):
        t.output(name, tensor, *_SCALAR, f32)
    return graph, t.uids


def support(shape, sm_version: int | None) -> dict[str, str]:
    """Whether cuDNN runs the float8 forward and backward of ``shape`` ([B, H, S, D],
    contiguous) on architecture ``sm_version`` (90: Hopper, 100: Blackwell; None: this
    machine's GPU): "supported" or cuDNN's reason. Only cuDNN's graph checks run, so a named
    architecture needs no GPU."""
    import cudnn

    _, h, s, d = shape
    stride = (h * s * d, s * d, d, 1)
    verdicts = {}
    builds = {
        "forward": lambda: forward_graph(cudnn, shape, stride, d**-0.5, sm_version),
        "backward_bf16_grads": lambda: backward_graph(cudnn, shape, stride, d**-0.5, sm_version),
        "backward_fp8_grads": lambda: backward_graph(
            cudnn, shape, stride, d**-0.5, sm_version, cudnn.data_type.FP8_E4M3
        ),
    }
    for name, build in builds.items():
        try:
            graph, _ = build()
            graph.validate()
            verdicts[name] = "supported"
        except cudnn.cudnnGraphNotSupportedError as err:
            verdicts[name] = f"not supported: {err}"
    return verdicts


class CudnnFp8Forward:
    """cuDNN's float8 attention forward for one shape and layout, on a GPU.

    ``__call__(q, k, v)`` takes bf16 [B, H, S, D] and returns the bf16 output (dequantised
    from e4m3); ``quantized(q8, k8, v8, dq, dk, dv)`` is the kernel alone on e4m3 inputs
    and returns the e4m3 output with its descale.
    """

    def __init__(self, shape, stride, device: torch.device) -> None:
        import cudnn

        self.cudnn, self.shape, self.stride, self.device = cudnn, shape, stride, device
        self.handle = cudnn.create_handle()
        self.graph, self.uids = forward_graph(cudnn, shape, stride, shape[-1] ** -0.5)
        self.graph.validate()
        self.graph.build_operation_graph()
        self.graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        self.graph.check_support()
        self.graph.build_plans()
        self.workspace = torch.empty(
            self.graph.get_workspace_size(), dtype=torch.uint8, device=device
        )
        self.scale_s = _scalar(PROBS_SCALE, device)
        self.descale_s = _scalar(1.0 / PROBS_SCALE, device)
        b, h, s, _ = shape
        self.o = torch.empty_strided(shape, stride, dtype=torch.float8_e4m3fn, device=device)
        self.stats = torch.empty((b, h, s, 1), dtype=torch.float32, device=device)
        self.amax_s, self.amax_o = _scalar(0.0, device), _scalar(0.0, device)

    def quantized(self, q8, k8, v8, descale_q, descale_k, descale_v):
        for x in (q8, k8, v8):
            if tuple(x.shape) != tuple(self.shape) or tuple(x.stride()) != tuple(self.stride):
                raise ValueError(
                    f"cuDNN float8 attention built for shape {self.shape} strides "
                    f"{self.stride}, given {tuple(x.shape)} {tuple(x.stride())}"
                )
        tensors = {
            "q": q8, "k": k8, "v": v8, "descale_q": descale_q, "descale_k": descale_k,
            "descale_v": descale_v, "descale_s": self.descale_s, "scale_s": self.scale_s,
            "scale_o": 1.0 / descale_v, "o": self.o, "stats": self.stats,
            "amax_s": self.amax_s, "amax_o": self.amax_o,
        }  # fmt: skip
        self.cudnn.set_stream(self.handle, torch.cuda.current_stream(self.device).cuda_stream)
        self.graph.execute(
            {self.uids[n]: x for n, x in tensors.items()}, self.workspace, handle=self.handle
        )
        return self.o, descale_v

    def __call__(self, q, k, v) -> torch.Tensor:
        (q8, dq), (k8, dk), (v8, dv) = quantize_e4m3(q), quantize_e4m3(k), quantize_e4m3(v)
        o8, descale_o = self.quantized(q8, k8, v8, dq, dk, dv)
        return (o8.float() * descale_o).to(q.dtype)


def main() -> int:
    """Print cuDNN's verdicts for SD3.5-Medium's training shape (32 rows x 24 heads x 1,357
    tokens, head dim 64) and for head dim 128, on Hopper (sm 90) and Blackwell (sm 100), and
    on this machine's GPU if it has one."""
    import cudnn

    print(json.dumps({"cudnn_frontend": cudnn.__version__, "cudnn": cudnn.backend_version()}))
    for sm in (90, 100, None) if torch.cuda.is_available() else (90, 100):
        for head_dim in (64, 128):
            shape = (32, 24, 1357, head_dim)
            row = {"sm_version": sm, "shape": shape, **support(shape, sm)}
            print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
