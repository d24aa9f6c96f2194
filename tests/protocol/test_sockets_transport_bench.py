"""The transport benchmark runs end to end (tiny message) and finds no copies on decode."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_transport_benchmark_smoke():
    cmd = [sys.executable, str(ROOT / "benchmarks/transport.py"), "--size-mb", "1"]
    cmd += ["--runs", "2", "--warmup", "0", "--transports", "tcp"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "| tcp | raw pyzmq multipart, copy=False |" in out.stdout
    assert "| tcp | omnirl encode+send / recv+decode |" in out.stdout
    assert "tcp: 0 of 10." in out.stdout


def test_write_docs_replaces_only_its_own_section(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location(
        "transport_bench", ROOT / "benchmarks/transport.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# B\n\n## Transport\n\n{bench.BEGIN}\nold\n{bench.END}\n\n## Other\nkeep\n")
    monkeypatch.setattr(bench, "DOCS", doc)
    bench.write_docs("| new table |", "uv run python benchmarks/transport.py")
    text = doc.read_text()
    assert "old" not in text and "| new table |" in text and text.endswith("## Other\nkeep\n")
    assert "Command: `uv run python benchmarks/transport.py`" in text
