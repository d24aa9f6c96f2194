"""Under an activation memory budget the compiled backward keeps the attention's outputs
(``omnirl.models.compile_attention``) instead of running the attention's forward again.

Inductor on the CPU (the pass is inductor's), a block with SDPA between a norm and an MLP:
at budget 0.05 the partitioner recomputes what it may; the attention kernel is counted with
the profiler over one forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

from omnirl.models.compile import CompileConfig, compile_module
from omnirl.models.compile_attention import ATTENTION_KERNELS, SaveAttention, attention_saved

pytestmark = pytest.mark.usefixtures("torch_one_thread")


class Block(nn.Module):
    """Pre-norm attention and MLP, as a diffusion transformer's block computes them."""

    def __init__(self, dim: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(F.layer_norm(x, (d,))).chunk(3, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, d)
        x = x + self.out(a)
        return x + self.down(F.gelu(self.up(F.layer_norm(x, (d,)))))


def _attention_calls_and_grads(config: CompileConfig):
    """Forward attention kernels run in one compiled forward + backward (after the compiling
    call), and the input and weight gradients."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = Block()
    compile_module(block, config)
    x = torch.randn(2, 64, 32, requires_grad=True)
    block(x).square().mean().backward()  # compiles
    x.grad = None
    block.zero_grad()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        block(x).square().mean().backward()
    calls = sum(1 for e in prof.events() if e.name.removeprefix("aten::") in ATTENTION_KERNELS)
    grads = {"x": x.grad.clone(), **{n: p.grad.clone() for n, p in block.named_parameters()}}
    return calls, grads


def test_a_budget_keeps_the_attention_saved_unless_told_to_recompute_it():
    saved_calls, saved_grads = _attention_calls_and_grads(
        CompileConfig(activation_memory_budget=0.05)
    )
    recomputed_calls, recomputed_grads = _attention_calls_and_grads(
        CompileConfig(activation_memory_budget=0.05, recompute_attention=True)
    )
    assert saved_calls == 1  # the forward's own
    assert recomputed_calls == 2  # torch's partitioner alone runs it again in the backward
    for name, grad in saved_grads.items():
        torch.testing.assert_close(recomputed_grads[name], grad, msg=name)


def test_the_pass_marks_only_forward_attention_kernels():
    from torch.utils.checkpoint import CheckpointPolicy

    graph = torch.fx.Graph()
    q = graph.placeholder("q")
    fwd = graph.call_function(
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q)
    )
    mm = graph.call_function(torch.ops.aten.mm.default, (q, q))
    graph.output((fwd, mm))
    SaveAttention()(graph)
    assert fwd.meta["recompute"] == CheckpointPolicy.MUST_SAVE
    assert "recompute" not in mm.meta


def test_a_joint_pass_set_by_someone_else_is_left_in_place():
    from torch._inductor import config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class Theirs(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            pass

        def uuid(self) -> str:
            return "theirs"

    theirs = Theirs()
    warned = pytest.warns(UserWarning, match="may recompute attention")
    with warned, config.patch(joint_custom_pre_pass=theirs), attention_saved():
        assert config.joint_custom_pre_pass is theirs
    with attention_saved():
        assert isinstance(config.joint_custom_pre_pass, SaveAttention)
    assert config.joint_custom_pre_pass is None
