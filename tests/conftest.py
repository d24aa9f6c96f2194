"""Project-wide fixtures.

``OMNIRL_TEST_DEVICE`` (default ``cpu``) is the device the tiny-model tests that take the
``test_device`` fixture run on, e.g. ``OMNIRL_TEST_DEVICE=cuda pytest tests/models``.
"""

from __future__ import annotations

import os

import pytest

TEST_DEVICE = os.environ.get("OMNIRL_TEST_DEVICE", "cpu")


@pytest.fixture(scope="session")
def test_device() -> str:
    """The torch device of the device-aware tiny-model tests (``OMNIRL_TEST_DEVICE``)."""
    if TEST_DEVICE.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            pytest.skip("OMNIRL_TEST_DEVICE asks for CUDA, which is not available")
    return TEST_DEVICE


@pytest.fixture(scope="session")
def tiny_sd3_path(tmp_path_factory):
    """A tiny random StableDiffusion3Pipeline folder, built once per test session."""
    from omnirl.models.sd3.tiny import make_tiny_sd3

    return make_tiny_sd3(tmp_path_factory.mktemp("tiny_sd3") / "model", seed=0)


@pytest.fixture(scope="session")
def make_welcome():
    """A factory of the trainer's ``Welcome`` to a rollout worker (no trainer behind its
    addresses): ``make_welcome(model_path, architecture, config=None)``."""
    from omnirl.protocol.messages import Topology, Welcome

    def make(path, architecture: str, config: dict | None = None) -> Welcome:
        addr = "tcp://127.0.0.1:1"
        return Welcome(
            worker_id="w",
            run_id="r",
            topology=Topology(control=addr, intake=addr, weights=addr),
            policy_version=0,
            model_path=str(path),
            architecture=architecture,
            config=config or {},
        )

    return make


@pytest.fixture
def torch_one_thread():
    """Run a test with one torch thread (restored after).

    Tiny models gain nothing from intra-op threads, and on a shared 2-core machine two
    spinning threads per process make them several times slower.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_shapes_path(tmp_path_factory):
    """A tiny random ShapesT2IPipeline folder (preset ``tiny``, the whole ShapesEval
    vocabulary), built once per test session."""
    from omnirl.models.shapes_t2i import PRESETS, build_pipeline
    from omnirl.tools.pretrain_shapes import shapes_vocabulary

    pipe = build_pipeline(shapes_vocabulary(), PRESETS["tiny"], seed=0)
    return pipe.save_pretrained(tmp_path_factory.mktemp("tiny_shapes") / "model")


@pytest.fixture(scope="session")
def tiny_shapes_latent_path(tmp_path_factory):
    """A tiny random latent ShapesT2IPipeline folder (preset ``tiny_latent``: a 4x8x8 VAE
    latent, f = 4), built once per test session. The VAE's latent scaling is set away from
    (1, 0), as a trained one's would be, so that tests see it applied and undone."""
    from omnirl.models.shapes_t2i import PRESETS, build_pipeline
    from omnirl.tools.pretrain_shapes import shapes_vocabulary

    pipe = build_pipeline(shapes_vocabulary(), PRESETS["tiny_latent"], seed=0)
    pipe.vae.register_to_config(scaling_factor=1.7, shift_factor=0.1)
    return pipe.save_pretrained(tmp_path_factory.mktemp("tiny_shapes_latent") / "model")
