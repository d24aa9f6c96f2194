"""A ``torchrun`` rank ends through ``_exit_rank``: it skips the interpreter's teardown
(``os._exit``), so what it printed must be flushed first and its exit code kept."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import logging
from omnirl.trainer.cli import _exit_rank
logging.basicConfig(level=logging.INFO, format="%(message)s")
logging.getLogger("omnirl.trainer").info("rank log line")
print("rank stdout line", end="")
_exit_rank(3)
print("never")
"""


def test_exit_rank_keeps_the_code_and_flushes_what_was_printed():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "rank stdout line"  # block-buffered into a pipe: lost unless flushed
    assert "rank log line" in proc.stderr
