"""The reward registry and the weighted spec grammar."""

import numpy as np
import pytest

from omnirl.reward.scorers import (
    RewardOptionError,
    ScoreBatch,
    UnknownScorer,
    available_scorers,
    build_reward,
    register_reward,
)
from omnirl.reward.scoring import ScorerSpecError, parse_scorer_spec


@register_reward("test_reg_two_parts")
class TwoParts:
    components = ("strict", "partial")
    reads = frozenset({"prompt"})
    batchable = True
    thread_safe = True

    def __init__(self, offset: float = 0.0):
        self.offset = offset

    def __call__(self, batch: ScoreBatch):
        n = len(batch)
        return {"strict": [self.offset] * n, "partial": [self.offset + 0.5] * n}


def test_builtin_rewards_are_registered():
    names = set(available_scorers())
    assert {"jpeg_compressibility", "ocr", "clip_score", "pickscore", "aesthetic"} <= names
    assert "remote_judge" in names


def test_bare_name_weights_the_primary_component_and_logs_the_rest_at_zero():
    (scorer,) = parse_scorer_spec("test_reg_two_parts:2")
    assert scorer.weights == {"test_reg_two_parts.strict": 2.0, "test_reg_two_parts.partial": 0.0}
    assert scorer.weight == 2.0


def test_components_weighted_separately_and_options_parsed():
    scorers = parse_scorer_spec(
        "test_reg_two_parts.strict(offset=1.5):1, test_reg_two_parts.partial:0.25,"
        "jpeg_compressibility:0.5"
    )
    assert [s.name for s in scorers] == ["test_reg_two_parts", "jpeg_compressibility"]
    assert scorers[0].reward.offset == 1.5
    assert scorers[0].weights == {
        "test_reg_two_parts.strict": 1.0,
        "test_reg_two_parts.partial": 0.25,
    }
    assert scorers[1].weights == {"jpeg_compressibility": 0.5}


@pytest.mark.parametrize(
    ("spec", "error", "needle"),
    [
        ("nope_reward", UnknownScorer, "known scorers"),
        ("jpeg_compressibility:abc", ScorerSpecError, "not a number"),
        ("jpeg_compressibility:inf", ScorerSpecError, "finite"),
        ("jpeg_compressibility,jpeg_compressibility", ScorerSpecError, "twice"),
        ("test_reg_two_parts.bogus", ScorerSpecError, "no component 'bogus'"),
        ("test_reg_two_parts(colour=red)", RewardOptionError, "bad options"),
        ("jpeg_compressibility(x=1)", RewardOptionError, "takes no options"),
        ("test_reg_two_parts(offset=1", ScorerSpecError, "unbalanced"),
        ("test_reg_two_parts(offset)", ScorerSpecError, "KEY=VALUE"),
        ("", ScorerSpecError, "no scorer"),
        ("ocr(min_confidence=0.5),ocr.ocr(min_confidence=0.9):2", ScorerSpecError, "two different"),
    ],
)
def test_bad_specs_fail_with_a_typed_error_naming_the_problem(spec, error, needle):
    with pytest.raises(error, match=needle):
        parse_scorer_spec(spec)


def test_a_reward_declaring_unknown_reads_is_refused_at_build():
    @register_reward("test_reg_bad_reads")
    class BadReads:
        components = ("x",)
        reads = frozenset({"images", "audio"})
        batchable = thread_safe = True

        def __call__(self, batch):
            return {"x": np.zeros(len(batch))}

    with pytest.raises(RewardOptionError, match="audio"):
        build_reward("test_reg_bad_reads")


def test_a_name_cannot_be_registered_twice():
    with pytest.raises(ValueError, match="already registered"):
        register_reward("test_reg_two_parts")(lambda: None)
