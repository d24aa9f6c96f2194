"""Device-memory peaks: what the trainer's step metrics and the rollout's lease log report."""

from __future__ import annotations

import torch

from omnirl.models.device import peak_memory_gb, reset_peak_memory


def test_peaks_follow_an_allocation_and_start_again_at_a_reset(test_device):
    device = torch.device(test_device)
    reset_peak_memory(device)
    if device.type == "cpu":
        assert peak_memory_gb(device) == {}  # no allocator statistics on a CPU
        return
    block = torch.empty(64 * 2**20, dtype=torch.uint8, device=device)  # 64 MiB
    peak = peak_memory_gb(device)
    assert peak["allocated"] >= 0.067 and peak["reserved"] >= peak["allocated"]
    del block
    torch.cuda.empty_cache()
    reset_peak_memory(device)
    assert peak_memory_gb(device)["allocated"] < peak["allocated"]
