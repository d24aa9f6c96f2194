"""Stale groups, for every algorithm: the server trains a group exactly ``max_staleness``
versions old and issues an older one again (checked once more when the step starts), and
docs/algorithms.md says, for every registered algorithm, how it treats such a group.

How each algorithm's step treats a stale group is tested beside the algorithm:
``test_algo_sd3_steps.py`` (the log-prob family, two versions old), ``test_train_step_sd3.py``
(FlowGRPO sde / cps / dance, one version old), ``test_algo_nft_sd3.py`` and
``test_algo_dpo.py`` (trained exactly as fresh), ``test_offline_dpo.py`` (never stale).
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "algorithms.md"


class KeepBackend:
    """Trains nothing; remembers which groups each step got."""

    architecture, model_path, sde_type = "Null", "", "sde"
    weight_format, adapter_config = "lora", {"r": 1}
    adapter = train_step = None

    def __init__(self):
        self.batches = []

    def export_weights(self):
        return {}

    def step(self, groups, *, policy_version, lr_scale=1.0):
        self.batches.append(([g.group_id for g in groups], policy_version))
        return {}


@dataclass
class Group:
    group_id: str
    policy_version: int


def test_the_server_trains_groups_max_staleness_old_and_reissues_older_ones(null_server):
    backend = KeepBackend()
    server = null_server(backend, "train.max_staleness=1")
    led = server.ledger
    led.heartbeat("w", 0.0)
    lease = led.issue("w", 3, 0.0, policy_version=0, fresh=server.prompts.next)
    ids = [p.group_id for p in lease.prompts]
    versions = (0, 1, 1)
    for gid, v in zip(ids, versions, strict=True):  # all within K = 1 of version 1
        assert type(led.accept(gid, lease.lease_id, v, 1)).__name__ == "Accepted"
    server.buffer = [Group(gid, v) for gid, v in zip(ids, versions, strict=True)]
    server.version = 2  # the trainer moved on while they waited in the buffer
    server._maybe_start_step()
    server._future.result(timeout=10)
    # staleness 1 == K: trained; staleness 2 > K: counted and issued again
    assert backend.batches == [(ids[1:], 2)]
    assert led.counters["groups_stale_at_step"] == 1
    assert list(led.pending) == [ids[0]]
    # arriving two versions old at intake: refused and issued again as well
    lease2 = led.issue("w", 1, 0.0, policy_version=0, fresh=server.prompts.next)
    stale = led.accept(lease2.prompts[0].group_id, lease2.lease_id, 0, 2)
    assert type(stale).__name__ == "Stale" and stale.staleness == 2


def _stale_table() -> dict[str, str]:
    text = DOC.read_text()
    section = text.split("## Stale groups, algorithm by algorithm", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            for name in re.findall(r"`([a-z_0-9]+)`", cells[0]):
                rows[name] = cells[1]
    return rows


def test_every_registered_algorithm_says_how_it_treats_a_stale_group():
    # a fresh interpreter: other tests register throw-away algorithms in this one
    code = "from omnirl.trainer.algorithms.registry import known_algorithms as k; print(*k())"
    names = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert "flow_grpo" in names and "diffusion_dpo" in names
    rows = _stale_table()
    missing = sorted(set(names) - set(rows))
    assert not missing, f"docs/algorithms.md has no stale-group row for {missing}"
    assert all(rows[name] for name in names)
