"""Fixtures for the benchmark scripts' tests."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@functools.cache
def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def benchmark_script():
    """``benchmark_script("name")``: ``benchmarks/name.py`` as a module, loaded once per
    session (benchmarks/ is not a package; the script's own imports must resolve)."""
    return _load
