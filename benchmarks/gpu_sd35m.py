"""SD3.5-Medium on one GPU: omnirl's rollout and training against a flow_grpo-style eager loop.

One process, random weights (bf16), 512x512, 10 steps, CFG 4.5, 333 text tokens, LoRA r 32:

- the **matmul ceiling** (8192^3 bf16), measured here, for MFU;
- the **baseline** (``gpu_sd35m_baseline.py``): flow_grpo-style eager iterations (rollout
  recording every step, VAE decode, 9 trained timesteps with CFG, LoRA and a KL reference
  pass), timed per part;
- **omnirl**: ``SD3RolloutAdapter.sample`` eager, then on the compiled backend (compile time
  reported), ``TrainStep`` eager and compiled (with and without the KL reference pass, and
  with gradient checkpointing), full iterations (sample, score, train, weights back to the
  rollout) of the same work as the baseline, with ``kl_beta = 0``, and with a 2-step window;
- **parity**: |behaviour - recomputed| log-probs, compiled rollout against the eager and the
  compiled trainer (``TrainStep``'s ``behav_prox_logp_absdiff_*``);
- **warm start**: a fresh process with an empty compile cache loads the first process's
  compile artifacts (``torch.compiler`` mega-cache) and samples its first group.

A wall-clock budget (``--budget-s``) skips the stages that no longer fit; results are
written as they come (``$OUT/gpu_sd35m.jsonl`` and ``gpu_sd35m.md``), so a run cut short
still reports what it measured. ``--tiny`` runs the same stages on a toy model (CPU, seconds).

    python benchmarks/gpu_sd35m.py --device cuda --budget-s 420          # one H200
    python benchmarks/gpu_sd35m.py --tiny --compile-backend aot_eager     # CPU smoke test
    python benchmarks/gpu_sd35m.py --from-jsonl runs/gpu_sd35m.jsonl --write-docs
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_sd35m_args import apply_inductor_settings, parse_args
from gpu_sd35m_float8 import Float8Stages
from gpu_sd35m_memory import MemoryStages
from gpu_sd35m_profile import profile_kernels
from gpu_sd35m_report import Report
from gpu_sd35m_setup import (
    SETUPS,
    Budget,
    Clock,
    FakeTextPipeline,
    build_transformer,
    build_vae,
    dynamo_counts,
    phases_per_image,
)
from gpu_sd35m_warm_start import measure_warm_start, warm_start_child

from omnirl.models.device import attention_backend as sdpa_context

# Stages in run order: (rough GPU seconds it needs, compiles dominating; the stage it needs).
# Tiny runs scale the seconds by 1/20.
STAGES: dict[str, tuple[float, str | None]] = {
    "baseline": (40, None),
    "omnirl_eager": (10, None),
    "compile_rollout": (90, None),
    "train_eager": (15, "compile_rollout"),
    "compile_train": (150, "compile_rollout"),
    "iterations": (25, "compile_train"),
    "train_kl": (60, "compile_train"),
    "profile": (30, "train_kl"),
    # float8 stages: parity only after compile_train, the iteration only after train_kl
    "fp8_static": (75, "compile_rollout"),
    "fp8_static_fast": (60, "compile_rollout"),
    "fp8": (60, "compile_rollout"),
    "fp8_fast": (60, "compile_rollout"),
    "warm_start": (45, "compile_rollout"),
    "decode_memory": (30, None),
    # the fastest configuration alone, from a cold start (needs no other stage; not in
    # "all": it reconfigures the rollout and the trainer the later stages expect as they were)
    "fp8_best": (150, None),
    "checkpointing": (120, "compile_train"),
    # last: the trainer stays in float8 after them
    "train_fp8": (90, "train_kl"),
    "train_fp8_fast": (60, "train_kl"),
    "train_fp8_ref": (60, "train_kl"),
    "train_fp8_static": (90, "train_kl"),
    "train_fp8_static_f8grad": (90, "train_kl"),
}


class Bench(Float8Stages, MemoryStages):
    """The models and the measurements of one run; each ``stage_*`` adds rows to the report."""

    def __init__(self, args, report: Report):
        self.args, self.report = args, report
        self.setup = SETUPS["tiny" if args.tiny else "sd35m"]
        if args.prompts:
            self.setup = dataclasses.replace(self.setup, prompts=args.prompts)
        self.device = torch.device(args.device)
        self.dtype = getattr(torch, args.dtype)
        self.clock = Clock(self.device)
        self.flops: dict[str, float] = {}

    # ------------------------------------------------------------------------ baseline
    def stage_baseline(self) -> None:
        import gpu_sd35m_baseline as base
        from gpu_sd35m_setup import matmul_ceiling, model_flops

        from omnirl.models.sd3.lora import add_lora

        s, dev = self.setup, self.device
        self.report.add("ceiling", tflops=matmul_ceiling(dev, self.dtype, n=self.args.matmul_n))
        self.vae = build_vae(s.vae, dev, self.dtype)
        model = build_transformer(s.transformer, dev, self.dtype)
        torch.manual_seed(1)
        add_lora(model, s.lora, cast_inputs=True)  # PEFT's default, as flow_grpo runs it
        pipe = FakeTextPipeline(model, self.vae, s, dev, self.dtype)
        self.flops = model_flops(pipe, s, model)
        params = sum(p.numel() for p in model.parameters())
        self.report.add("model", params=params, **{f"flops_{k}": v for k, v in self.flops.items()})
        cond = base.expand_cond(pipe, s)
        pipe.scheduler.set_timesteps(s.steps)
        sigmas = [float(x) for x in pipe.scheduler.sigmas]
        opt = base.make_optimizer(model)
        gen = torch.Generator(device=dev).manual_seed(0)
        run = lambda times, kl: base.iteration(  # noqa: E731
            model, self.vae, opt, sigmas, cond, s, gen, self.dtype, self.clock, times, kl_beta=kl
        )
        run({}, s.kl_beta)  # warm-up
        times: dict[str, float] = {}
        reps = self.args.repeats
        with self.clock(times, "iteration_s"):
            for _ in range(reps):
                run(times, s.kl_beta)
        nokl: dict[str, float] = {}
        run(nokl, 0.0)
        per = {k: v / (reps * s.images) for k, v in times.items()}
        self.report.add(
            "baseline",
            rollout_s_per_image=per["rollout_s"],
            decode_s_per_image=per["decode_s"],
            train_s_per_sample_step=per["train_s"] / s.trained_steps,
            train_nokl_s_per_sample_step=nokl["train_s"] / (s.images * s.trained_steps),
            iteration_s_per_image=per["iteration_s"],
        )

    # -------------------------------------------------------------------------- omnirl
    def build_omnirl(self, *, trainer: bool = True) -> None:
        from omnirl.models.schedulers import FlowMatchSDEScheduler
        from omnirl.models.sd3 import SD3RolloutAdapter, SD3TrainingAdapter

        s, dev = self.setup, self.device
        if not hasattr(self, "vae"):
            self.vae = build_vae(s.vae, dev, self.dtype)
        # a compiled decoder gets its own VAE (same seed, same weights): the baseline's stays eager
        vae = build_vae(s.vae, dev, self.dtype) if self.args.compile_decoder else self.vae
        self.pipe = FakeTextPipeline(
            build_transformer(s.transformer, dev, self.dtype), vae, s, dev, self.dtype
        )
        torch.manual_seed(1)
        self.rollout = SD3RolloutAdapter(self.pipe, device=dev, lora=s.lora)
        self.version = 0
        if not trainer:  # a rollout worker alone (the warm-start child)
            return
        sched = FlowMatchSDEScheduler.from_config(self.pipe.scheduler.config)
        torch.manual_seed(1)
        self.train = SD3TrainingAdapter(
            build_transformer(s.transformer, dev, self.dtype), sched, device=dev, lora=s.lora
        )
        self.rollout.load_weights("lora", self.train.export_weights())

    def sampling(self, window=None):
        from omnirl.protocol.messages import SamplingParams

        s = self.setup
        return SamplingParams(
            group_size=s.group,
            num_steps=s.steps,
            guidance_scale=s.guidance,
            height=s.side,
            width=s.side,
            noise_level=s.noise_level,
            sde_window=window or (0, s.trained_steps),
            seed=self.version,
        )

    def sample(self, window=None) -> tuple[list, float]:
        """One lease of ``prompts x group`` images with rewards; returns (groups, seconds)."""
        import msgspec

        from omnirl.protocol.messages import PromptSpec, Rewards

        prompts = [
            PromptSpec(group_id=f"v{self.version}-p{i}", text=f"prompt {i}")
            for i in range(self.setup.prompts)
        ]
        t: dict[str, float] = {}
        with self.clock(t, "s"):
            groups = self.rollout.sample(
                prompts,
                self.sampling(window),
                lease_id="l",
                worker_id="w",
                policy_version=self.version,
            )
        gen = torch.Generator().manual_seed(self.version)
        scored = [
            msgspec.structs.replace(
                g,
                rewards=Rewards(
                    group_id=g.group_id, total=torch.rand(self.setup.group, generator=gen).tolist()
                ),
            )
            for g in groups
        ]
        return scored, t["s"]

    def train_step(self, kl_beta: float):
        from omnirl.trainer.step import TrainStep

        micro = self.args.micro or self.setup.micro  # --micro: omnirl's alone
        config = TrainStep.Config(lr=1e-4, kl_beta=kl_beta, micro_batch_size=micro)
        return TrainStep(self.train, "flow_grpo", config)

    def timed_step(self, step, groups) -> tuple[dict, float]:
        t: dict[str, float] = {}
        with self.clock(t, "s"):
            metrics = step.step(groups, policy_version=self.version)
        return metrics, t["s"]

    def per_sample_step(self, groups, seconds: float) -> float:
        n = sum(int(g.latents.shape[0]) * int(g.latents.shape[1]) for g in groups)
        return seconds / n

    def decode_time(self, groups) -> float:
        latents = torch.cat([g.final_latents for g in groups]).to(self.device)
        t: dict[str, float] = {}
        # no_grad as in the adapter's sample: a compiled decoder's graph is guarded on grad mode
        with torch.no_grad(), self.clock(t, "s"):
            self.rollout._decode(latents)
        return t["s"]

    def stage_omnirl_eager(self) -> None:
        self.build_omnirl()
        self.sample()
        groups, secs = self.sample()
        dec = self.decode_time(groups)
        n = self.setup.images
        self.report.add(
            "omnirl_rollout_eager",
            s_per_image=secs / n,
            denoise_s_per_image=(secs - dec) / n,
            **phases_per_image(groups, n),
        )

    def compile_config(self, scope: str | None = None):
        """The run's ``CompileConfig``; ``scope``: ``blocks`` or ``whole`` (default
        ``--compile-scope``)."""
        from omnirl.models.compile import CompileConfig, regional_scope

        return CompileConfig(
            backend=self.args.compile_backend,
            mode=self.args.compile_mode,
            cache_dir=self.args.cache_dir,
            regional=regional_scope(scope or self.args.compile_scope),
            # changes only graphs with a backward: the trainer's, not the rollout's
            activation_memory_budget=self.args.activation_memory_budget,
            recompute_attention=self.args.recompute_attention,
        )

    def compile_rollout(self) -> None:
        """The rollout's compiled backend (``--rollout-compile-mode``), and its VAE decoder
        with ``--compile-decoder``."""
        config = self.compile_config()
        config = config.replace(mode=self.args.rollout_compile_mode or self.args.compile_mode)
        self.rollout.compile(config)
        if self.args.compile_decoder:
            self.rollout.compile_decoder(config)

    def stage_compile_rollout(self) -> None:
        if not hasattr(self, "rollout"):
            self.build_omnirl()
        self.compile_rollout()
        _, first = self.sample()
        runs = [self.sample() for _ in range(self.args.repeats)]
        self.groups, steady = min(runs, key=lambda r: r[1])
        dec = self.decode_time(self.groups)
        n = self.setup.images
        self.report.add(
            "omnirl_rollout_compiled",
            s_per_image=steady / n,
            denoise_s_per_image=(steady - dec) / n,
            compile_s=first - steady,
            images_per_call=n,
            **phases_per_image(self.groups, n),
        )

    def stage_train_eager(self) -> None:
        step = self.train_step(0.0)
        m, _ = self.timed_step(step, self.groups)  # on-policy: the rollout's LoRA is ours
        _, t = self.timed_step(step, self.groups)
        self.report.add(
            "omnirl_train_eager",
            s_per_sample_step=self.per_sample_step(self.groups, t),
            parity_mean=m["behav_prox_logp_absdiff_mean"],
            parity_max=m["behav_prox_logp_absdiff_max"],
            parity_of="compiled rollout vs eager trainer",
        )
        self.sync_weights()

    def sync_weights(self) -> None:
        self.rollout.load_weights("lora", self.train.export_weights())
        self.version += 1

    def stage_compile_train(self) -> None:
        self.train.compile(self.compile_config(self.args.train_compile_scope))
        groups, _ = self.sample()  # fresh and on-policy: parity of compiled against compiled
        self.step0 = self.train_step(0.0)
        m, first = self.timed_step(self.step0, groups)
        _, t = self.timed_step(self.step0, groups)
        self.report.add(
            "omnirl_train_compiled",
            s_per_sample_step=self.per_sample_step(groups, t),
            compile_s=first - t,
            parity_mean=m["behav_prox_logp_absdiff_mean"],
            parity_max=m["behav_prox_logp_absdiff_max"],
            parity_of="compiled rollout vs compiled trainer",
        )
        self.sync_weights()

    def iterate(
        self,
        name: str,
        step,
        window,
        kl: bool,
        parity_of: str = "compiled rollout vs compiled trainer",
    ) -> None:
        """Full iterations: sample (decode included), score, train, weights back."""
        times: dict[str, float] = {}
        metrics = {}
        for _ in range(self.args.repeats):
            with self.clock(times, "iteration_s"):
                groups, t = self.sample(window)
                times["rollout_s"] = times.get("rollout_s", 0.0) + t
                metrics, t = self.timed_step(step, groups)
                times["train_s"] = times.get("train_s", 0.0) + t
                self.sync_weights()
        n = self.setup.images * self.args.repeats
        trained = int(groups[0].latents.shape[1])
        self.report.add(
            name,
            iteration_s_per_image=times["iteration_s"] / n,
            rollout_s_per_image=times["rollout_s"] / n,
            train_s_per_sample_step=times["train_s"] / (n * trained),
            trained_steps=trained,
            kl=kl,
            parity_mean=metrics["behav_prox_logp_absdiff_mean"],
            parity_max=metrics["behav_prox_logp_absdiff_max"],
            parity_of=parity_of + " (staleness 0)",
        )

    def stage_iterations(self) -> None:
        self.iterate("omnirl_iteration_kl0", self.step0, None, False)
        self.iterate("omnirl_iteration_window2", self.step0, (1, 3), False)

    def stage_train_kl(self) -> None:
        step = self.train_step(self.setup.kl_beta)
        groups, _ = self.sample()
        _, first = self.timed_step(step, groups)
        _, t = self.timed_step(step, groups)
        self.report.add(
            "omnirl_train_compiled_kl",
            compile_s=first - t,
            s_per_sample_step=self.per_sample_step(groups, t),
        )
        self.sync_weights()
        self.iterate("omnirl_iteration_same_work", step, None, True)
        self.step_kl = step

    def stage_profile(self) -> None:
        """Kernel time by kind over one same-work iteration (rollout, then training)."""
        groups, _ = self.sample()  # compiled graphs warm; fresh on-policy groups
        self.report.add("profile_rollout", **profile_kernels(self.device, self.sample))
        self.report.add(
            "profile_train_kl",
            **profile_kernels(self.device, lambda: self.timed_step(self.step_kl, groups)),
        )
        self.sync_weights()

    def stage_checkpointing(self) -> None:
        self.train.transformer.enable_gradient_checkpointing()
        try:
            groups, _ = self.sample()
            _, first = self.timed_step(self.step0, groups)
            _, t = self.timed_step(self.step0, groups)
        finally:
            self.train.transformer.disable_gradient_checkpointing()
        self.report.add(
            "omnirl_train_compiled_checkpointing",
            compile_s=first - t,
            s_per_sample_step=self.per_sample_step(groups, t),
        )
        self.sync_weights()

    def stage_warm_start(self) -> None:
        self.report.add("warm_start", **measure_warm_start(self.args, self.budget.left() - 5))

    def _free(self) -> None:
        import gc

        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, description=__doc__.splitlines()[0])
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.warm_start_child:
        return warm_start_child(args, Bench(args, Report(None)))
    report = Report.load(Path(args.from_jsonl)) if args.from_jsonl else run(args)
    if args.write_docs:
        report.write_docs(Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md")
    print(report.markdown())
    return 0


def run(args) -> Report:
    wanted = (
        [s for s in STAGES if s != "fp8_best"] if args.stages == "all" else args.stages.split(",")
    )
    unknown = sorted(set(wanted) - set(STAGES))
    if unknown:
        raise SystemExit(f"unknown stage(s) {unknown}; known: {', '.join(STAGES)}")
    apply_inductor_settings(args.inductor)
    out = Path(args.out)
    report = Report(out, command=" ".join([Path(sys.argv[0]).name, *sys.argv[1:]]))
    bench = Bench(args, report)
    # A graph that fails to compile runs eagerly (and is counted) instead of ending the run.
    torch._dynamo.config.suppress_errors = True
    s = bench.setup
    report.add(
        "env",
        torch=torch.__version__,
        device=args.device,
        dtype=args.dtype,
        gpu=torch.cuda.get_device_name() if args.device.startswith("cuda") else "",
        setup="tiny" if args.tiny else "sd35m",
        budget_s=args.budget_s,
        steps=s.steps,
        trained_steps=s.trained_steps,
        images=s.images,
        side=s.side,
        text_len=s.text_len,
        micro=s.micro,  # the baseline's
        omnirl_micro=args.micro or s.micro,
        lora_r=s.lora_r,
        inductor=args.inductor,
    )
    bench.budget = budget = Budget(args.budget_s, 1 / 20 if args.tiny else 1.0)
    done: set[str] = set()
    for name, (seconds, needs) in STAGES.items():
        if name not in wanted:
            continue
        estimate = seconds * budget.scale
        if needs and needs not in done:
            report.skip(name, f"needs {needs}")
            continue
        if budget.left() < estimate:
            report.skip(name, f"budget: {budget.left():.0f} s left, about {estimate:.0f} s needed")
            continue
        start = time.perf_counter()
        attention = contextlib.nullcontext() if name == "baseline" else sdpa_context(args.sdpa)
        try:
            with attention:
                if not bench.float8_stage(name):
                    getattr(bench, f"stage_{name}")()
            done.add(name)
        except Exception as err:  # one failed stage must not lose the others' results
            report.add(f"{name}_error", error=repr(err)[:400], where=traceback.format_exc()[-1500:])
        bench._free()
        report.add(f"{name}_wall", seconds=time.perf_counter() - start)
    report.add("dynamo", **dynamo_counts())
    report.finish()
    return report


if __name__ == "__main__":
    sys.exit(main())
