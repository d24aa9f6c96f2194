"""Every online algorithm on ShapesEval, over the wire on this machine, for one wall-clock budget.

For each algorithm, one after another: ``omnirl launch examples/shapes_flow_grpo_lora.yaml
--rollout 1 --reward 1 algorithm.name=ALGO max_minutes=M run.output_dir=OUT/ALGO ...`` (the
quick start with a LoRA, the config these runs were measured with; a trainer, one rollout
worker, one reward worker scoring ``shapes_eval``), the same config and budget for all, plus the
few overrides an algorithm needs (``OVERRIDES``). Then it reads each run's ``metrics.jsonl`` and
writes ``OUT/algorithms_compare.png`` (smoothed reward against the trainer's minutes, every
algorithm) and a markdown table (``compare_report.py`` defines every column). ``--heldout N``
also scores each run's last checkpoint and the base model on the first N held-out prompts
(``omnirl.tools.eval_shapes`` / ``shapes_curve``: ODE, the run's steps / guidance / size, strict
accuracy, paired bootstrap gain over prompts). ``--write`` puts the table into
``docs/benchmarks.md`` (between ``<!-- algorithms_compare:begin -->`` and ``:end -->``) and the
PNG into ``docs/images/``.

    uv run python benchmarks/algorithms_compare.py --minutes 20 --heldout 200 --write
    uv run python benchmarks/algorithms_compare.py --minutes 0.5 --algorithms flow_grpo,diffusion_nft
    uv run python benchmarks/algorithms_compare.py --no-run --out outputs/algorithms_compare --write

A full run takes about ``len(algorithms) x (minutes + ~1.5)`` minutes (model loads, worker start,
shutdown; measured below in docs/benchmarks.md), plus the held-out scoring.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_report import (  # a sibling module: benchmarks/ is on sys.path
    RunSummary,
    markdown_table,
    plot,
    read_metrics,
    replace_section,
    summarise,
)

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "shapes_flow_grpo_lora.yaml"
HELDOUT = ROOT / "examples" / "prompts" / "shapes_heldout.jsonl"
DOC = ROOT / "docs" / "benchmarks.md"
DOC_PNG = ROOT / "docs" / "images" / "algorithms_compare.png"
MARKER = ".algorithms_compare"
SECTION = "algorithms_compare"

ALGORITHMS = (
    "flow_grpo",
    "flow_grpo_fast",
    "mix_grpo",
    "dance_grpo",
    "grpo_guard",
    "flow_dppo",
    "diffusion_nft",
    "diffusion_dpo",
)
# The example's `sampling.sde_window: [0, 3]` is the task's stochastic region, kept for every
# algorithm without a window policy of its own. Those with one place their own window; the
# forward-process ones sample with the ODE and record no window.
OVERRIDES: dict[str, list[str]] = {
    "flow_grpo_fast": ["sampling.sde_window=null"],  # random window, size 2 in [0, 5)
    "mix_grpo": ["sampling.sde_window=null"],  # progressive window, size 4, +1 every 25 steps
    # ODE samplers: a group's samples differ only by their x_T, so the shapes config's shared
    # x_T (sampling.same_initial_noise) would make them identical; null = the algorithm's own
    "diffusion_nft": ["sampling.sde_window=null", "sampling.same_initial_noise=null"],
    "diffusion_dpo": ["sampling.sde_window=null", "sampling.same_initial_noise=null"],
}


# The comparison's own batch shape, whatever the quick start uses now: 32 groups of 8 an
# update (the setting of the table in docs/benchmarks.md), and each algorithm's own reward std
# (the example config sets `std: group` for FlowGRPO).
SETUP: list[str] = ["data.group_size=8", "train.groups_per_step=32"]


def comparison_overrides(algorithm: str) -> list[str]:
    """What every run of ``algorithm`` gets on top of the example config."""
    from omnirl.trainer.algorithms.registry import get_algorithm

    std = get_algorithm(algorithm).defaults.get("std", "global")
    return [*SETUP, f"algorithm.overrides.std={std}", *OVERRIDES.get(algorithm, [])]


def launch_command() -> list[str]:
    found = shutil.which("omnirl", path=str(Path(sys.executable).parent))
    return [found, "launch"] if found else [sys.executable, "-m", "omnirl.tools.cli", "launch"]


def fresh_dir(path: Path) -> None:
    """Empty ``path`` for a run: only a folder this script made before may be removed."""
    if path.exists():
        if not (path / MARKER).is_file():
            raise SystemExit(f"{path} exists and was not made by this script; pick another --out")
        shutil.rmtree(path)
    path.mkdir(parents=True)
    (path / MARKER).write_text("made by benchmarks/algorithms_compare.py\n")


def run_one(algorithm: str, args: argparse.Namespace) -> tuple[int, float]:
    """Launch one run and wait for it; ``(exit code, wall seconds)``."""
    out = args.out / algorithm
    fresh_dir(out)
    overrides = [
        f"algorithm.name={algorithm}",
        f"run.name=compare_{algorithm}",
        f"run.output_dir={out}",
        f"max_minutes={args.minutes:g}",
        "runtime.control_port=0",
        "logging.progress_bar=false",
        *comparison_overrides(algorithm),
        *args.set.get(algorithm, []),
        *args.set.get("*", []),
    ]
    # overrides right after the config: argparse takes positionals only before the options
    cmd = [*launch_command(), str(args.config), *overrides, "--rollout", "1", "--reward", "1"]
    cmd += ["--address-timeout", f"{args.setup_s:g}"]  # a loaded box imports torch slowly
    print(f"[compare] {algorithm}: {' '.join(cmd)}", flush=True)
    t0 = time.monotonic()
    with (out / "launch.log").open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=args.minutes * 60 + args.setup_s)
        except subprocess.TimeoutExpired:
            print(f"[compare] {algorithm}: over its time, stopping it", flush=True)
            os.killpg(proc.pid, signal.SIGINT)
            try:
                code = proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                code = proc.wait()
    wall = time.monotonic() - t0
    print(f"[compare] {algorithm}: exit {code} after {wall / 60:.1f} min", flush=True)
    if code != 0:
        tail = (out / "launch.log").read_text(errors="replace").splitlines()[-15:]
        print("\n".join(f"    {line}" for line in tail), flush=True)
    return code, wall


def run_config(algorithm: str, args: argparse.Namespace) -> dict:
    """The run's resolved trainer config: its last checkpoint's copy, else the config file with
    this script's overrides for it (a run that never reached a checkpoint)."""
    import yaml

    ckpts = sorted((args.out / algorithm / "checkpoints").glob("step_*"))
    if ckpts:
        return yaml.safe_load((ckpts[-1] / "config.yaml").read_text())
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(args.config)
    extra = [*comparison_overrides(algorithm), *args.set.get(algorithm, []), *args.set.get("*", [])]
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([*extra, f"max_minutes={args.minutes:g}"]))
    return OmegaConf.to_container(cfg)


def heldout_scores(runs: list[RunSummary], args: argparse.Namespace) -> None:
    """Fill ``run.heldout`` with the last checkpoint's strict accuracy and paired gain."""
    from omnirl.tools.eval_shapes import evaluate, load_prompt_file, summarise
    from omnirl.tools.policy_loading import apply_policy, load_adapter
    from omnirl.tools.shapes_curve import paired_gain

    specs = load_prompt_file(HELDOUT)[: args.heldout]
    base_cfg = run_config(runs[0].algorithm, args)
    model, sampling = base_cfg["model"]["path"], base_cfg["sampling"]

    def score(adapter):
        return evaluate(
            adapter,
            specs,
            seeds=args.heldout_seeds,
            guidance_scale=sampling["guidance_scale"],
            num_steps=sampling["num_steps"],
            image_size=sampling["height"],
        )

    t0 = time.monotonic()
    base = score(load_adapter(model))
    base_strict = summarise(base)["overall"]["strict"]
    print(f"[compare] base model: held-out strict {base_strict:.3f}", flush=True)
    for run in runs:
        ckpts = sorted((args.out / run.algorithm / "checkpoints").glob("step_*"))
        if not ckpts:
            continue
        adapter = load_adapter(model)
        apply_policy(adapter, ckpts[-1] / "policy", run_config(run.algorithm, args))
        after = score(adapter)
        strict = summarise(after)["overall"]["strict"]
        run.heldout = {"strict": strict, "gain": paired_gain(base, after)["overall"]}
        print(f"[compare] {run.algorithm}: held-out strict {strict:.3f}", flush=True)
    args.heldout_base = base_strict
    args.heldout_minutes = (time.monotonic() - t0) / 60


def report(args: argparse.Namespace, walls: dict[str, float]) -> str:
    import yaml

    window = yaml.safe_load(args.config.read_text()).get("sampling", {}).get("sde_window")
    runs, configs = [], {}
    for a in args.algorithms:
        configs[a] = cfg = run_config(a, args)  # each run's own sizes (--set may change them)
        runs.append(
            summarise(
                a,
                read_metrics(args.out / a / "metrics.jsonl"),
                group_size=int(cfg["data"]["group_size"]),
                groups_per_step=int(cfg["train"]["groups_per_step"]),
                smooth_groups=args.smooth_groups,
            )
        )
    cfg = configs[args.algorithms[0]]
    g, gps = int(cfg["data"]["group_size"]), int(cfg["train"]["groups_per_step"])
    minutes = float(cfg.get("max_minutes") or args.minutes)
    if args.heldout:
        heldout_scores(runs, args)
    title = (
        f"ShapesEval, {minutes:g} min per algorithm, 1 rollout + 1 reward worker, "
        f"{gps} groups x {g} samples a step"
    )
    png = plot(runs, args.out / "algorithms_compare.png", title=title,
               smooth_groups=args.smooth_groups)  # fmt: skip
    run_min = sum(walls.values()) / 60
    lines = [
        f"Measured {dt.date.today().isoformat()}: `{args.command}`",
        "",
        f"Budget {minutes:g} min per algorithm (`max_minutes`, trainer clock), config "
        f"`examples/shapes_flow_grpo_lora.yaml` (lr {cfg['train']['lr']}, max_staleness "
        f"{cfg['train']['max_staleness']}, window {window} unless an "
        "algorithm places its own: `flow_grpo_fast`, `mix_grpo`; `diffusion_nft` and "
        "`diffusion_dpo` sample with the ODE). Load average before the runs: "
        f"{args.load_before:.1f}." + (f" Runs took {run_min:.1f} min in all." if walls else ""),
        "",
        markdown_table(runs),
        "",
        f"Smoothed: trailing moving average over {args.smooth_groups} groups; gain: final "
        "smoothed minus the first minute's mean reward (`benchmarks/compare_report.py`). "
        "Reward: ShapesEval `partial` of the training prompts (the reward the runs train on).",
    ]
    if args.heldout:
        lines.append(
            f"Held-out: first {args.heldout} prompts of `examples/prompts/shapes_heldout.jsonl` "
            f"x {args.heldout_seeds} seeds, last checkpoint, ODE; base model strict "
            f"{args.heldout_base:.3f}; vs base: paired bootstrap over prompts "
            f"({args.heldout_minutes:.1f} min to score)."
        )
    lines += ["", "![reward against minutes](images/algorithms_compare.png)"]
    text = "\n".join(lines)
    (args.out / "algorithms_compare.md").write_text(text + "\n")
    (args.out / "summary.json").write_text(json.dumps([r.__dict__ for r in runs], indent=1))
    if args.write:
        DOC_PNG.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(png, DOC_PNG)
        replace_section(DOC, SECTION, text, "## Algorithms compared on ShapesEval")
    return text


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=20.0, help="wall-clock budget per algorithm")
    p.add_argument("--algorithms", default=",".join(ALGORITHMS), help="comma-separated")
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "algorithms_compare")
    p.add_argument("--config", type=Path, default=CONFIG)
    p.add_argument("--smooth-groups", type=int, default=64, help="moving-average window, groups")
    p.add_argument("--heldout", type=int, default=0, help="score last checkpoints on N prompts")
    p.add_argument("--heldout-seeds", type=int, default=2)
    p.add_argument("--setup-s", type=float, default=600.0, help="allowance beyond the budget")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="ALGO:key=value",
        help="an extra override for one algorithm (ALGO '*': all); repeatable",
    )
    p.add_argument(
        "--retries", type=int, default=1, help="again, a run cut short before its first step"
    )
    p.add_argument("--no-run", action="store_true", help="only report the runs already in --out")
    p.add_argument("--write", action="store_true", help="update docs/benchmarks.md and its PNG")
    args = p.parse_args(argv)
    args.algorithms = [a for a in args.algorithms.split(",") if a]
    unknown = sorted(set(args.algorithms) - set(ALGORITHMS))
    if unknown:
        p.error(f"unknown algorithms {unknown}; known: {', '.join(ALGORITHMS)}")
    extra: dict[str, list[str]] = {}
    for item in args.set:
        algo, _, kv = item.partition(":")
        if not kv or "=" not in kv:
            p.error(f"--set {item!r} is not ALGO:key=value")
        extra.setdefault(algo, []).append(kv)
    args.set = extra
    args.command = "uv run python benchmarks/algorithms_compare.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.load_before = os.getloadavg()[0]
    walls: dict[str, float] = {}
    failed = []
    if not args.no_run:
        args.out.mkdir(parents=True, exist_ok=True)
        for algorithm in args.algorithms:
            for attempt in range(1 + args.retries):
                code, walls[algorithm] = run_one(algorithm, args)
                trained = read_metrics(args.out / algorithm / "metrics.jsonl")
                cut_short = code != 0 or walls[algorithm] < 60 * args.minutes
                if trained or not cut_short or attempt == args.retries:
                    break  # a run that trained is kept, even if it ended badly
                print(f"[compare] {algorithm}: stopped before its first step; again", flush=True)
            if code != 0:
                failed.append(algorithm)
    print(report(args, walls))
    if failed:
        print(f"[compare] runs that failed: {', '.join(failed)} (see OUT/ALGO/logs)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
