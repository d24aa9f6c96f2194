"""Project-wide fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_sd3_path(tmp_path_factory):
    """A tiny random StableDiffusion3Pipeline folder, built once per test session."""
    from omnirl.models.sd3.tiny import make_tiny_sd3

    return make_tiny_sd3(tmp_path_factory.mktemp("tiny_sd3") / "model", seed=0)
