"""A lease that runs out of device memory frees what it held before the rollout model hands
the allocator's cache back (a trainer may share the GPU), and the error still reaches the
worker, which gives the lease back (``test_rollout_worker_loop``)."""

from __future__ import annotations

import weakref

import pytest
import torch

from omnirl.protocol.messages import Lease, PromptSpec, SamplingParams
from omnirl.rollout.model import RolloutModel


class OutOfMemoryAdapter:
    """Builds activations, then runs out of memory, as a denoising loop does mid-lease."""

    def __init__(self):
        self.held: list[weakref.ref] = []

    def sample(self, prompts, sampling, **kwargs):
        activations = torch.ones(256, 64)
        self.held.append(weakref.ref(activations))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


class WatchedModel(RolloutModel):
    def release_memory(self):
        self.alive_at_release = [ref() is not None for ref in self.adapter.held]
        super().release_memory()


def test_an_out_of_memory_lease_frees_its_tensors_before_the_cache_is_emptied():
    model = WatchedModel(OutOfMemoryAdapter(), format="lora")
    lease = Lease(
        lease_id="L1",
        worker_id="w",
        prompts=[PromptSpec(group_id="g", text="p")],
        sampling=SamplingParams(group_size=2),
        deadline=0.0,
        policy_version=0,
    )
    with pytest.raises(torch.OutOfMemoryError):
        model.sample(lease, "w", 0)
    assert model.alive_at_release == [False]
