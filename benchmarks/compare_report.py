"""Reading and reporting the runs of ``algorithms_compare.py``: per-run summary, the markdown
table, the reward-vs-minutes PNG. No model code: only the runs' ``metrics.jsonl``.

Definitions (also printed under the table):

- *smoothed reward*: trailing moving average of the per-step ``reward_mean`` over the last
  ``window`` steps (``window`` = smoothing groups / ``groups_per_step``), so the value at a time
  uses only the steps finished by then;
- *first-minute reward*: mean ``reward_mean`` of the steps that ended within the first 60 s of
  the trainer's clock (``elapsed_s``), or of the first step when none did;
- *gain*: final smoothed reward minus first-minute reward;
- *samples*: groups trained x samples per group (``ledger/groups_trained`` x ``group_size``);
- *first step s*: ``elapsed_s`` of the first step: the budget's clock starts when the trainer
  listens, so worker start-up (model loads) and the first step's sampling are inside it;
- *step s*: mean ``step_s`` (the optimisation step itself); *wall s/step*: ``elapsed_s`` of the
  last step / steps (sampling, scoring, transport and waiting included).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FIRST_MINUTE_S = 60.0


@dataclass
class RunSummary:
    algorithm: str
    steps: int = 0
    samples: int = 0
    minutes: list[float] = field(default_factory=list)  # per step, trainer clock
    reward: list[float] = field(default_factory=list)  # per step reward_mean
    smoothed: list[float] = field(default_factory=list)
    first_minute: float = math.nan
    first_step_s: float = math.nan
    final: float = math.nan
    step_s: float = math.nan
    wall_s_per_step: float = math.nan
    staleness: float = math.nan
    heldout: dict[str, Any] | None = None
    note: str = ""

    @property
    def gain(self) -> float:
        return self.final - self.first_minute


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` that carry a step's reward, in step order."""
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "reward_mean" in r and "elapsed_s" in r]
    return sorted(rows, key=lambda r: r["step"])


def trailing_mean(values: list[float], window: int) -> list[float]:
    """``out[i]`` = mean of ``values[max(0, i - window + 1) : i + 1]``."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def summarise(
    algorithm: str, rows: list[dict[str, Any]], *, group_size: int, groups_per_step: int,
    smooth_groups: int,
) -> RunSummary:  # fmt: skip
    s = RunSummary(algorithm)
    if not rows:
        s.note = "no steps"
        return s
    window = max(1, smooth_groups // max(1, groups_per_step))
    s.steps = len(rows)
    s.samples = int(rows[-1].get("ledger/groups_trained", s.steps * groups_per_step)) * group_size
    s.minutes = [r["elapsed_s"] / 60 for r in rows]
    s.reward = [float(r["reward_mean"]) for r in rows]
    s.smoothed = trailing_mean(s.reward, window)
    early = [r["reward_mean"] for r in rows if r["elapsed_s"] <= FIRST_MINUTE_S] or s.reward[:1]
    s.first_minute = sum(early) / len(early)
    s.first_step_s = rows[0]["elapsed_s"]
    s.final = s.smoothed[-1]
    s.step_s = sum(r.get("step_s", math.nan) for r in rows) / s.steps
    s.wall_s_per_step = rows[-1]["elapsed_s"] / s.steps
    s.staleness = sum(r.get("staleness_mean", math.nan) for r in rows) / s.steps
    return s


def _f(x: float, digits: int = 3, sign: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:+.{digits}f}" if sign else f"{x:.{digits}f}"


def markdown_table(runs: list[RunSummary]) -> str:
    heldout = any(r.heldout for r in runs)
    head = ["algorithm", "steps", "samples", "final smoothed reward", "first-minute reward",
            "gain", "first step s", "step s", "wall s/step", "staleness"]  # fmt: skip
    if heldout:
        head += ["held-out strict", "vs base (95% CI)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        cells = [f"`{r.algorithm}`", str(r.steps), f"{r.samples:,}", _f(r.final),
                 _f(r.first_minute), _f(r.gain, sign=True), _f(r.first_step_s, 0), _f(r.step_s, 1),
                 _f(r.wall_s_per_step, 1), _f(r.staleness, 2)]  # fmt: skip
        if heldout:
            h = r.heldout or {}
            g = h.get("gain") or {}
            ci = g.get("ci95") or [math.nan, math.nan]
            cells += [
                _f(h.get("strict", math.nan)),
                f"{_f(g.get('gain', math.nan), sign=True)} [{_f(ci[0], sign=True)}, "
                f"{_f(ci[1], sign=True)}]"
                if g
                else "-",
            ]
        if r.note:
            cells[0] += f" ({r.note})"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: list[RunSummary], path: Path, *, title: str, smooth_groups: int) -> Path:
    """Smoothed reward (thick) and per-step reward (faint) against the trainer's minutes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=120)
    colours = plt.get_cmap("tab10")
    for i, r in enumerate(runs):
        if not r.steps:
            continue
        c = colours(i % 10)
        ax.plot(r.minutes, r.reward, color=c, alpha=0.2, linewidth=0.8)
        ax.plot(r.minutes, r.smoothed, color=c, linewidth=2.0, label=r.algorithm)
    ax.set_xlabel("minutes (trainer clock, elapsed_s)")
    ax.set_ylabel(f"reward (partial), moving average over {smooth_groups} groups")
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=9)
    if any(r.steps for r in runs):
        ax.legend(fontsize=8, loc="lower right", ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def replace_section(doc: Path, name: str, text: str, heading: str) -> None:
    """Put ``text`` between ``<!-- name:begin -->`` and ``<!-- name:end -->`` of ``doc``; a
    page without them gets a new ``heading`` section at its end."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    page = doc.read_text()
    if begin in page and end in page:
        head, rest = page.split(begin, 1)
        page = head + begin + "\n" + text + "\n" + end + rest.split(end, 1)[1]
    else:
        page = page.rstrip("\n") + f"\n\n{heading}\n\n{begin}\n{text}\n{end}\n"
    doc.write_text(page)
