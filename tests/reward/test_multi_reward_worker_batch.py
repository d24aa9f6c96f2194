"""The reward worker scores queued groups as one batch, on a thread pool, per-group refusals."""

import numpy as np
import torch
from test_multi_reward_scoring import CALLS, make_group

from omnirl.protocol.codec import decode, encode
from omnirl.protocol.messages import Refusal
from omnirl.reward.scoring import parse_scorer_spec
from omnirl.reward.worker import RewardWorker, RewardWorkerConfig


def test_a_batch_of_groups_is_scored_together_and_a_bad_group_refused_alone():
    worker = RewardWorker(
        RewardWorkerConfig(
            trainer="tcp://127.0.0.1:1",
            scorers=parse_scorer_spec("test_multi_mean_pixel.mean:1,jpeg_incompressibility:0.1"),
            batch_groups=8,
            score_threads=2,
        )
    )
    groups = [make_group(0, "fine"), make_group(1, "nan please"), make_group(2, "fine")]
    groups[0].latents = torch.randn(3, 2, 4, 8, 8)  # forwarded, not read
    messages = [encode(g) for g in groups] + [[b"not msgpack"]]
    CALLS.clear()
    out = worker.process_batch(messages)
    assert sorted(n for n, _ in CALLS) == [3, 6]  # 3 groups over 2 threads, whole groups
    assert worker.counters.scored == 2 and worker.counters.refused == 1
    assert worker.counters.malformed == 1
    decoded = [decode(frames) for frames in out]
    refusal = next(m for m in decoded if isinstance(m, Refusal))
    assert refusal.ref == "g1" and refusal.code == "reward_failed"
    scored = {m.group_id: m for m in decoded if not isinstance(m, Refusal)}
    assert set(scored) == {"g0", "g2"}
    assert torch.equal(scored["g0"].latents, groups[0].latents)
    mean = groups[2].images.numpy().reshape(3, -1).mean(axis=1)
    assert np.allclose(scored["g2"].rewards.components["test_multi_mean_pixel.mean"], mean)
    assert "reward_s" in scored["g2"].timings
