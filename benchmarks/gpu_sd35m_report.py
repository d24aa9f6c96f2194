"""Results of ``gpu_sd35m.py``: JSON lines as they come, a markdown summary, the docs section.

Every measurement is one JSON object ``{"stage": name, ...}`` appended to
``<out>/gpu_sd35m.jsonl`` at once; ``<out>/gpu_sd35m.md`` is rewritten after each, so a run
cut short keeps everything it measured. MFU = model FLOPs (counted by
``torch.utils.flop_counter`` on the real shapes) / time / the matmul rate measured in the
same run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

BEGIN, END = "<!-- gpu_sd35m:begin -->", "<!-- gpu_sd35m:end -->"


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1e4 else f"{value:.3e}"
    return str(value)


def _float8_trainer(row: dict[str, Any]) -> str:
    """A float8 trainer stage's settings in words (rows from before the settings were
    recorded: row-wise, float8 input gradient, every pass)."""
    accum = ", fast accumulation" if row.get("fast_accum") else ""
    if row.get("scope") == "reference":  # the policy runs in the model dtype
        return f"float8 reference pass ({row.get('activation')}{accum})"
    return (
        f"float8 trainer ({row.get('activation', 'rowwise')}, input gradient "
        f"{row.get('input_grad', 'float8')}{accum})"
    )


class Report:
    def __init__(self, out: Path | None, *, command: str = ""):
        self.out = Path(out) if out is not None else None
        self.rows: list[dict[str, Any]] = []
        self.command = command
        self.start = time.time()
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "gpu_sd35m.jsonl").write_text("")

    @classmethod
    def load(cls, path: Path) -> Report:
        report = cls(None)
        report.rows = [json.loads(line) for line in path.read_text().splitlines() if line]
        env = report.get("env")
        report.command = env.get("command", "") if env else ""
        return report

    def add(self, stage: str, **values: Any) -> None:
        row = {"stage": stage, "t_s": round(time.time() - self.start, 1), **values}
        if stage == "env":
            row["command"] = self.command
        row = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()}
        self.rows.append(row)
        print("RESULT " + json.dumps(row), flush=True)
        if self.out is not None:
            with (self.out / "gpu_sd35m.jsonl").open("a") as f:
                f.write(json.dumps(row) + "\n")
            (self.out / "gpu_sd35m.md").write_text(self.markdown())

    def skip(self, stage: str, reason: str) -> None:
        self.add(f"{stage}_skipped", reason=reason)

    def finish(self) -> None:
        if self.out is not None:
            (self.out / "gpu_sd35m.md").write_text(self.markdown())

    def get(self, stage: str) -> dict[str, Any] | None:
        for row in reversed(self.rows):
            if row["stage"] == stage:
                return row
        return None

    def val(self, stage: str, key: str) -> float | None:
        row = self.get(stage)
        return None if row is None else row.get(key)

    def _float8_trainers(self) -> list[dict[str, Any]]:
        """The rows of the trainer's float8 stages (``omnirl_train_fp8*``), in run order."""
        return [r for r in self.rows if r["stage"].startswith("omnirl_train_fp8")]

    # --------------------------------------------------------------------------- markdown
    def _flops(self) -> dict[str, float] | None:
        model, env = self.get("model"), self.get("env")
        if model is None or env is None:
            return None
        return {
            "fwd": model["flops_cfg_forward"],
            "train": model["flops_cfg_train"],
            "decode": model["flops_decode"],
            "steps": env.get("steps", 10),
            "trained": env.get("trained_steps", 9),
        }

    def _mfu(self, flops: float | None, seconds: float | None) -> str:
        ceiling = self.val("ceiling", "tflops")
        if not flops or not seconds or not ceiling:
            return "-"
        return f"{100 * flops / seconds / (ceiling * 1e12):.0f} %"

    def markdown(self) -> str:
        env = self.get("env") or {}
        f = self._flops()
        lines = [
            f"Command: `{self.command or env.get('command', '')}`",
            "",
            f"torch {env.get('torch', '?')}, {env.get('gpu') or env.get('device', '?')}, "
            f"{env.get('dtype', '?')}, setup `{env.get('setup', '?')}`; matmul ceiling "
            f"{_fmt(self.val('ceiling', 'tflops'))} TFLOP/s (measured in this run).",
            "",
        ]
        fwd = f["fwd"] * f["steps"] if f else None
        # "loop": the denoising loop alone, as the baseline times it (recorded steps copied
        # to the host included); "sample less decode": the adapter's whole `sample` call less
        # a separately timed decode, so also the prompt encoding (random embeddings here)
        # and the packing into groups
        lines += [
            f"| rollout ({env.get('steps', '?')} steps, CFG) | denoising loop s/image | MFU | "
            "`sample` less decode, s/image | compile s |",
            "|---|---:|---:|---:|---:|",
        ]
        rollout_rows = [
            ("baseline, eager (flow_grpo-style)", "baseline"),
            ("omnirl, eager (`diffusers` backend)", "omnirl_rollout_eager"),
            ("omnirl, compiled backend", "omnirl_rollout_compiled"),
            ("omnirl, compiled, float8 linears", "omnirl_rollout_fp8"),
            ("omnirl, float8, fast accumulation", "omnirl_rollout_fp8_fast"),
            ("omnirl, float8, static activation scales", "omnirl_rollout_fp8_static"),
            ("omnirl, float8, static scales, fast accumulation", "omnirl_rollout_fp8_static_fast"),
            ("the same, cold start (`fp8_best`)", "omnirl_rollout_fp8_best"),
        ]
        for label, stage in rollout_rows:
            if stage == "baseline":
                loop, whole = self.val(stage, "rollout_s_per_image"), None
            else:
                loop = self.val(stage, "phase_denoise_s_per_image")
                whole = self.val(stage, "denoise_s_per_image")
            lines.append(
                f"| {label} | {_fmt(loop)} | {self._mfu(fwd, loop)} | {_fmt(whole)} | "
                f"{_fmt(self.val(stage, 'compile_s'), 3)} |"
            )
        dec = self.val("baseline", "decode_s_per_image")
        lines += ["", f"VAE decode: {_fmt(dec)} s/image (baseline, eager).", ""]
        lines += [
            "| training, per sample per timestep (LoRA, CFG) | s | MFU | compile s |",
            "|---|---:|---:|---:|",
        ]
        train_rows = [
            ("baseline, eager, with KL reference pass", "baseline", "train_s_per_sample_step", 1),
            ("baseline, eager, no KL", "baseline", "train_nokl_s_per_sample_step", 0),
            ("omnirl TrainStep, eager, no KL", "omnirl_train_eager", "s_per_sample_step", 0),
            ("omnirl TrainStep, compiled, no KL", "omnirl_train_compiled", "s_per_sample_step", 0),
            (
                "omnirl TrainStep, compiled, with KL",
                "omnirl_train_compiled_kl",
                "s_per_sample_step",
                1,
            ),
            (
                "omnirl, compiled + gradient checkpointing",
                "omnirl_train_compiled_checkpointing",
                "s_per_sample_step",
                0,
            ),
        ]
        train_rows += [
            (
                f"omnirl, compiled, with KL, {_float8_trainer(row)}",
                row["stage"],
                "s_per_sample_step",
                1,
            )
            for row in self._float8_trainers()
        ]
        for label, stage, key, kl in train_rows:
            s = self.val(stage, key)
            flops = (f["train"] + kl * f["fwd"]) if f else None
            lines.append(
                f"| {label} | {_fmt(s)} | {self._mfu(flops, s)} | "
                f"{_fmt(self.val(stage, 'compile_s'), 3)} |"
            )
        base = self.val("baseline", "iteration_s_per_image")
        lines += [
            "",
            "| full iteration (rollout, decode, train, weights) | trained steps | "
            "s/image | images/s | vs baseline | MFU |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        iter_rows = [
            ("baseline: flow_grpo-style eager, KL", "baseline", f["trained"] if f else 9, 1),
            ("omnirl, same work (KL, compiled)", "omnirl_iteration_same_work", None, 1),
            (
                "omnirl, same work, float8 rollout",
                "omnirl_iteration_same_work_fp8",
                None,
                1,
            ),
            (
                "omnirl, same work, float8 rollout, static scales",
                "omnirl_iteration_same_work_fp8_static",
                None,
                1,
            ),
            (
                "omnirl, same work, float8 rollout, static, fast accumulation",
                "omnirl_iteration_same_work_fp8_static_fast",
                None,
                1,
            ),
        ]
        iter_rows += [
            (
                f"omnirl, same work, {_float8_trainer(row)}",
                row["stage"].replace("omnirl_", "omnirl_iteration_same_work_", 1),
                None,
                1,
            )
            for row in self._float8_trainers()
        ]
        iter_rows += [
            ("omnirl, kl_beta 0 (no reference pass)", "omnirl_iteration_kl0", None, 0),
            ("omnirl, kl_beta 0, SDE window of 2", "omnirl_iteration_window2", None, 0),
        ]
        for label, stage, trained, kl in iter_rows:
            s = self.val(stage, "iteration_s_per_image")
            trained = trained or self.val(stage, "trained_steps")
            flops = None
            if f and trained:
                flops = fwd + f["decode"] + trained * (f["train"] + kl * f["fwd"])
            speed = f"{base / s:.2f}x" if s and base else "-"
            ips = f"{1 / s:.2f}" if s else "-"
            lines.append(
                f"| {label} | {_fmt(trained)} | {_fmt(s)} | {ips} | {speed} | "
                f"{self._mfu(flops, s)} |"
            )
        lines += [
            "",
            "Rollout / trainer log-prob parity (|behaviour - recomputed|, on-policy):",
            "",
        ]
        for stage in (
            "omnirl_train_eager",
            "omnirl_train_compiled",
            "omnirl_iteration_kl0",
            "omnirl_iteration_same_work",
            "omnirl_rollout_fp8",
            "omnirl_iteration_same_work_fp8",
            "omnirl_rollout_fp8_fast",
            "omnirl_rollout_fp8_static",
            "omnirl_rollout_fp8_static_fast",
            "omnirl_iteration_same_work_fp8_static_fast",
            *(row["stage"] for row in self._float8_trainers()),
        ):
            row = self.get(stage)
            if row and row.get("parity_mean") is not None:
                what = row.get("parity_of", "compiled rollout vs compiled trainer")
                lines.append(
                    f"- {stage}: {what}: mean {_fmt(row['parity_mean'], 3)}, "
                    f"max {_fmt(row['parity_max'], 3)}"
                )
        ws = self.get("warm_start")
        if ws:
            lines += [
                "",
                f"Warm start (fresh process, empty compile cache, artifacts loaded): "
                f"first group {_fmt(ws.get('process_to_first_group_s'), 3)} s after launch "
                f"(build {_fmt(ws.get('build_s'), 3)} s, compile + first group "
                f"{_fmt(ws.get('compile_and_first_group_s'), 3)} s; artifacts "
                f"{ws.get('artifacts_bytes', 0) / 1e6:.1f} MB).",
            ]
        if f:
            lines += [
                "",
                f"Model FLOPs (per image): CFG forward {f['fwd'] / 1e12:.2f} T, CFG "
                f"forward+backward with LoRA {f['train'] / 1e12:.2f} T, VAE decode "
                f"{f['decode'] / 1e12:.2f} T.",
            ]
        dyn = self.get("dynamo")
        if dyn:
            lines += [
                "",
                f"torch.compile: {dyn['unique_graphs']} graphs, {dyn['graph_breaks']} "
                f"graph breaks, {dyn['frames_not_compiled']} frames dynamo did not compile "
                "(skipped or failed: run eagerly).",
            ]
        notes = [r for r in self.rows if r["stage"].endswith(("_skipped", "_error"))]
        if notes:
            lines += ["", "Skipped or failed stages:", ""]
            lines += [f"- {r['stage']}: {r.get('reason') or r.get('error')}" for r in notes]
        walls = [r for r in self.rows if r["stage"].endswith("_wall")]
        if walls:
            lines += [
                "",
                "Stage wall times (s): "
                + ", ".join(f"{r['stage'][:-5]} {r['seconds']:.0f}" for r in walls)
                + ".",
            ]
        return "\n".join(lines) + "\n"

    def write_docs(self, path: Path) -> None:
        text = path.read_text()
        if BEGIN not in text or END not in text:
            raise SystemExit(f"{path} has no {BEGIN} ... {END} section")
        head, rest = text.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        path.write_text(f"{head}{BEGIN}\n{self.markdown()}{END}{tail}")
