"""Algorithm / advantage / loss registries."""

import subprocess
import sys

import pytest

from omnirl.trainer.algorithms.registry import (
    AlgorithmSpec,
    DuplicateNameError,
    UnknownNameError,
    get_advantage,
    get_algorithm,
    get_loss,
    known_algorithms,
    register_algorithm,
    register_alias,
)


def test_unknown_names_fail_listing_the_known_ones():
    with pytest.raises(UnknownNameError) as err:
        get_algorithm("flow_gpro")
    msg = str(err.value)
    assert "flow_gpro" in msg
    for name in ("flow_grpo", "flow_grpo_cps", "dance_grpo"):
        assert name in msg
    assert err.value.known == sorted(err.value.known)
    with pytest.raises(UnknownNameError, match=r"known losses: .*flow_grpo"):
        get_loss("ppo")
    with pytest.raises(UnknownNameError, match=r"known advantage estimators: .*group"):
        get_advantage("rloo")


def test_builtin_algorithms_share_estimator_and_loss_by_name():
    base = get_algorithm("flow_grpo")
    cps = get_algorithm("flow_grpo_cps")
    dance = get_algorithm("dance_grpo")
    assert (base.sde_type, cps.sde_type, dance.sde_type) == ("sde", "cps", "dance_sde")
    for spec in (cps, dance):
        assert spec.alias_of == "flow_grpo"
        assert spec.loss == base.loss == "flow_grpo"
        assert spec.advantage == base.advantage == "group"
        assert spec.adapter_algorithm == "flow_grpo"
        assert spec.needs_log_probs
    assert get_loss(cps.loss) is get_loss(base.loss)
    assert base.defaults["clip_range"] == 1e-4
    assert cps.defaults["clip_range"] == 1e-5  # CPS log-probs are not likelihood ratios
    assert cps.defaults["adv_clip_max"] == base.defaults["adv_clip_max"]  # merged from base
    assert dance.defaults["std"] == "group"
    assert cps.sampling_defaults["sde_type"] == "cps"


def test_register_alias_and_duplicates():
    spec = register_algorithm(
        AlgorithmSpec(
            name="test_registry_algo",
            sde_type="sde",
            advantage="group",
            loss="flow_grpo",
            adapter_algorithm="flow_grpo",
            defaults={"clip_range": 3e-4, "kl_beta": 0.1},
        )
    )
    assert register_algorithm(spec) is spec  # the same spec again is fine
    alias = register_alias(
        "test_registry_alias", of="test_registry_algo", defaults={"kl_beta": 0.0}
    )
    assert dict(alias.defaults) == {"clip_range": 3e-4, "kl_beta": 0.0}
    assert "test_registry_alias" in known_algorithms()
    with pytest.raises(DuplicateNameError):
        register_algorithm(AlgorithmSpec(**{**_fields(spec), "sde_type": "cps"}))
    with pytest.raises(UnknownNameError):
        register_alias("test_registry_orphan", of="no_such_algorithm")
    with pytest.raises(TypeError, match="unknown AlgorithmSpec fields"):
        register_alias("test_registry_typo", of="flow_grpo", sde_typ="cps")
    with pytest.raises(ValueError, match="sde_type"):
        AlgorithmSpec(name="x", sde_type="ddim", advantage="a", loss="b", adapter_algorithm="c")
    with pytest.raises(TypeError):
        spec.defaults["clip_range"] = 1.0  # type: ignore[index]


def _fields(spec: AlgorithmSpec) -> dict:
    return {f: getattr(spec, f) for f in AlgorithmSpec.__dataclass_fields__}


def test_importing_the_registry_imports_no_algorithm():
    code = (
        "import sys, omnirl.trainer.algorithms.registry as r\n"
        "assert 'omnirl.trainer.algorithms.flow_grpo' not in sys.modules\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
