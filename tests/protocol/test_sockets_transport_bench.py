"""The transport benchmark runs end to end (tiny message) and finds no copies on decode."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench(monkeypatch):
    """benchmarks/transport.py as a module (its sender process imports it by name)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    module = importlib.import_module("transport")
    yield module
    sys.modules.pop("transport", None)


@pytest.mark.slow
def test_transport_benchmark_smoke(bench, capsys):
    args = ["--size-mb", "1", "--runs", "2", "--warmup", "0", "--transports", "tcp,ipc"]
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    assert "| tcp | raw pyzmq multipart, copy=False |" in out
    assert "| ipc | omnirl encode+send / recv+decode |" in out
    for transport in ("tcp", "ipc"):
        for allocator in ("glibc default", "retain freed memory"):
            assert f"{transport} ({allocator}): 0 of 10" in out


def test_write_docs_replaces_only_its_own_section(bench, tmp_path, monkeypatch):
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# B\n\n## Transport\n\n{bench.BEGIN}\nold\n{bench.END}\n\n## Other\nkeep\n")
    monkeypatch.setattr(bench, "DOCS", doc)
    bench.write_docs("| new table |", "uv run python benchmarks/transport.py")
    text = doc.read_text()
    assert "old" not in text and "| new table |" in text and text.endswith("## Other\nkeep\n")
    assert "Command: `uv run python benchmarks/transport.py`" in text
