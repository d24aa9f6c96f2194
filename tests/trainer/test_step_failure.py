"""A failed optimisation step: its groups are issued again, what it held is freed at once
(not at the next cyclic garbage collection), and ``MAX_STEP_FAILURES`` failures in a row
end the run.

The memory check matters on a GPU: the traceback of an out-of-memory step keeps the step's
activations and autograd graph alive, so the retry found the memory still taken and failed
the same way (SD3.5-M, micro-batch 16 beside a rollout worker on one 80 GB card,
``docs/gpu_sessions.md``, "GPU, twelfth session"). Here the step's tensors are CPU tensors
watched through weak references, with the cyclic collector off.
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass

import pytest
import torch

from omnirl.trainer.server import TrainerServer
from omnirl.trainer.step_cycle import MAX_STEP_FAILURES


@dataclass
class Group:
    group_id: str
    policy_version: int


class FailingBackend:
    """Fails its first ``failures`` steps with an out-of-memory error, as a step does in the
    middle of a forward: the activations and the graph built so far are locals of its frame."""

    architecture, model_path, sde_type = "Null", "", "sde"
    weight_format, adapter_config = "lora", {"r": 1}
    adapter = train_step = None

    def __init__(self, failures: int):
        self.failures = failures
        self.steps = 0
        self.released = 0
        self.held: list[weakref.ref] = []

    def export_weights(self):
        return {}

    def release_memory(self):
        self.released += 1

    def step(self, groups, *, policy_version, lr_scale=1.0):
        self.steps += 1
        weight = torch.ones(64, requires_grad=True)
        activations = torch.ones(256, 64) * weight  # part of an autograd graph
        self.held.append(weakref.ref(activations))
        if self.steps <= self.failures:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 48.00 MiB")
        return {"loss": float(activations.detach().sum())}


def _fill_and_step(server: TrainerServer) -> list[str]:
    """Accept two groups of a fresh lease into the buffer and run one step to its end."""
    led = server.ledger
    led.heartbeat("w", 0.0)
    lease = led.issue("w", 2, 0.0, policy_version=server.version, fresh=server.prompts.next)
    ids = [p.group_id for p in lease.prompts]
    for gid in ids:
        assert type(led.accept(gid, lease.lease_id, server.version, server.version)).__name__ == (
            "Accepted"
        )
    server.buffer = [Group(gid, server.version) for gid in ids]
    server._maybe_start_step()
    server._future.exception(timeout=10)  # wait for the step thread, without raising
    server._finish_step()
    return ids


@pytest.fixture
def no_cyclic_gc():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_a_failed_step_frees_its_tensors_and_issues_its_groups_again(null_server, no_cyclic_gc):
    backend = FailingBackend(failures=1)
    server = null_server(backend)
    ids = _fill_and_step(server)
    assert backend.held[0]() is None, "the failed step's activations are still alive"
    assert backend.released == 1
    assert server.counters["step_failures"] == 1
    assert server.step == 0 and server.version == 0
    assert sorted(server.ledger.pending) == sorted(ids)  # issued again, not lost
    assert server.exit_code == 0


def test_only_max_step_failures_in_a_row_stop_the_run(null_server):
    backend = FailingBackend(failures=MAX_STEP_FAILURES)
    server = null_server(backend)
    for _ in range(MAX_STEP_FAILURES - 1):
        _fill_and_step(server)
        assert server.exit_code == 0
    _fill_and_step(server)
    assert server.exit_code == 1
    assert server.counters["step_failures"] == MAX_STEP_FAILURES
    assert backend.released == MAX_STEP_FAILURES


class NotUndoneBackend(FailingBackend):
    """Fails every step the way a step that changed the weights with no snapshot does."""

    def step(self, groups, *, policy_version, lr_scale=1.0):
        from omnirl.trainer.step_snapshot import StepNotUndone

        self.steps += 1
        raise StepNotUndone("the failed step had made 1 optimiser update(s)")


def test_a_step_that_cannot_be_undone_stops_the_run_with_no_final_checkpoint(null_server):
    backend = NotUndoneBackend(failures=1)
    server = null_server(backend)
    _fill_and_step(server)
    assert backend.steps == 1
    assert server.exit_code == 1 and server._stop_requested
    assert server._diverged  # what keeps run() from writing the final checkpoint
    assert server.step == 0 and server.version == 0
