"""A reward of another package is found through the entry-point group ``omnirl.rewards``:
a real distribution (``dist-info`` with ``entry_points.txt``) on the path of a fresh
interpreter, named by a spec, with no edit to omnirl; a broken one is skipped with a log."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path


def _distribution(root: Path, name: str, module_source: str) -> None:
    """``name`` (a module) and its ``dist-info``, declaring it in ``omnirl.rewards``."""
    (root / f"{name}.py").write_text(textwrap.dedent(module_source))
    info = root / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[omnirl.rewards]\n{name} = {name}\n")


def _run(root: Path, code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter with ``root`` on its path (a clean registry)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(root)},
    )


def test_a_third_party_reward_is_named_by_a_spec(tmp_path):
    _distribution(
        tmp_path,
        "brightness_reward",
        """
        import numpy as np
        from omnirl.reward.scorers import register_scorer

        @register_scorer("brightness")
        def brightness(images, prompts=None):
            return [float(np.asarray(image, dtype=np.float64).mean() / 255) for image in images]
        """,
    )
    _distribution(tmp_path, "broken_reward", "raise RuntimeError('cannot import me')\n")
    proc = _run(
        tmp_path,
        """
        import numpy as np
        from omnirl.reward.scorers import available_scorers, build_reward
        from omnirl.reward.scorers.registry import ScoreBatch

        assert "brightness" in available_scorers(), available_scorers()
        reward = build_reward("brightness")
        images = np.stack([np.zeros((4, 4, 3), np.uint8), np.full((4, 4, 3), 255, np.uint8)])
        print(reward(ScoreBatch(images=images, prompts=["a", "b"], metadata=[{}, {}])))
        """,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "{'brightness': [0.0, 1.0]}" in proc.stdout
    # the broken package is named in the log and skipped; the others still load
    assert "broken_reward" in proc.stderr and "failed to import" in proc.stderr
