"""The float8 stages of ``gpu_sd35m.py``: the rollout's (``rollout --float8``) and the
trainer's (``train.float8``) variants, as a part of its ``Bench``.

``Float8Stages`` is mixed into ``Bench``: its methods use the bench's models (``rollout``,
``train``), its ``sample``, ``timed_step``, ``iterate`` and ``report``.
"""

from __future__ import annotations

import dataclasses

from gpu_sd35m_profile import profile_kernels
from gpu_sd35m_setup import phases_per_image

from omnirl.models.float8 import Float8Training

# float8 stages: (activation scaling, fast accumulation) of ``rollout --float8``
FP8_VARIANTS: dict[str, tuple[str, bool]] = {
    "fp8": ("rowwise", False),
    "fp8_fast": ("rowwise", True),
    "fp8_static": ("static", False),
    "fp8_static_fast": ("static", True),
}

# the trainer's float8 variants (``train.float8`` and its ``float8_*`` keys)
TRAIN_FP8_VARIANTS: dict[str, Float8Training] = {
    "train_fp8": Float8Training(),
    "train_fp8_fast": Float8Training(fast_accum=True),
    # static activation scales, the input gradient in bf16: no reduction before any matmul
    "train_fp8_static": Float8Training(
        activation="static", input_grad="model_dtype", fast_accum=True
    ),
    "train_fp8_static_f8grad": Float8Training(activation="static", fast_accum=True),
    # the KL reference pass alone in float8: the policy's log-probs and gradients stay bf16
    "train_fp8_ref": Float8Training(activation="static", scope="reference", fast_accum=True),
}


class Float8Stages:
    """The ``fp8*`` and ``train_fp8*`` stages of ``Bench``."""

    def float8_stage(self, name: str) -> bool:
        """Run stage ``name`` if it is a float8 variant; return whether it was one."""
        if name in FP8_VARIANTS:
            self.fp8_variant(name)
        elif name in TRAIN_FP8_VARIANTS:
            self.train_fp8_variant(name)
        else:
            return False
        return True

    def fp8_variant(self, name: str, row: str | None = None) -> None:
        """The rollout with float8 block linear layers (``rollout --float8 ACTIVATION``,
        ``--float8-fast-accum``): speed, kernel split, parity against the bf16 compiled
        trainer, and the same-work iteration. Rows are ``omnirl_rollout_<row>``,
        ``profile_rollout_<row>``, ``omnirl_iteration_same_work_<row>`` (``row``: ``name``
        unless given); a static variant first calibrates on one eager call
        (``calibration_s``)."""
        activation, fast = FP8_VARIANTS[name]
        row = row or name
        fuse = self.args.float8_fuse_projections
        layers = self.rollout.enable_float8(
            activation=activation, fast_accum=fast, fuse_projections=fuse
        )
        calibration_s = None
        if self.rollout.float8_needs_calibration():
            _, calibration_s = self.sample()  # eager, row-wise: gathers the input ranges
        _, first = self.sample()  # the blocks recompile around the (re)configured layers
        runs = [self.sample() for _ in range(self.args.repeats)]
        groups, steady = min(runs, key=lambda r: r[1])
        dec = self.decode_time(groups)
        n = self.setup.images
        # on-policy: parity is precision alone (the KL step's if train_kl ran, else
        # compile_train's; none without a compiled trainer)
        step = getattr(self, "step_kl", None) or getattr(self, "step0", None)
        m = self.timed_step(step, groups)[0] if step is not None else {}
        what = (
            f"float8 ({activation}{', fast accumulation' if fast else ''}"
            f"{', fused q/k/v' if fuse else ''}) compiled rollout"
        )
        self.report.add(
            f"omnirl_rollout_{row}",
            s_per_image=steady / n,
            denoise_s_per_image=(steady - dec) / n,
            compile_s=first - steady,
            calibration_s=calibration_s,
            images_per_call=n,
            **phases_per_image(groups, n),
            layers=layers,
            activation=activation,
            fast_accum=fast,
            fuse_projections=fuse,
            parity_mean=m.get("behav_prox_logp_absdiff_mean"),
            parity_max=m.get("behav_prox_logp_absdiff_max"),
            parity_of=f"{what} vs compiled trainer in the model dtype" if m else None,
        )
        self.sync_weights()
        self.report.add(f"profile_rollout_{row}", **profile_kernels(self.device, self.sample))
        if hasattr(self, "step_kl"):  # the same-work iteration needs the KL step
            self.iterate(
                f"omnirl_iteration_same_work_{row}",
                self.step_kl,
                None,
                True,
                parity_of=f"{what} vs compiled trainer",
            )

    def stage_fp8_best(self) -> None:
        """The fastest configuration measured so far, from a cold start and without the bf16
        compiles before it: the rollout with static float8 scales and fast accumulation, the
        trainer with the ``train_fp8_static_f8grad`` variant and the KL pass, both compiled.
        Rows ``omnirl_rollout_fp8_best``, ``profile_rollout_fp8_best``,
        ``omnirl_train_fp8_best``, ``profile_train_fp8_best`` and
        ``omnirl_iteration_same_work_train_fp8_best`` (the iteration ``train_kl`` and the
        float8 stages measure, after three compiles fewer; the fourteenth session's raw rows
        name the profile ``profile_fp8_best``)."""
        if not hasattr(self, "rollout"):
            self.build_omnirl()
        self.compile_rollout()
        self.fp8_variant("fp8_static_fast", row="fp8_best")  # no trainer yet: no parity
        self.train.compile(self.compile_config(self.args.train_compile_scope))
        self.train_fp8_variant("train_fp8_static_f8grad", row="train_fp8_best")

    def train_fp8_variant(self, name: str, row: str | None = None) -> None:
        """The trainer's frozen block linear layers in float8 as the variant says
        (``train.float8_*``): the compiled training step with the KL pass, its parity against
        the rollout (whatever the rollout runs at this point: bf16, or float8 after an
        ``fp8*`` stage), its kernel time by kind, and the same-work iteration. Rows
        ``omnirl_<row>``, ``profile_<row>`` and ``omnirl_iteration_same_work_<row>`` (``row``:
        ``name`` unless given);
        ``compile_s`` includes a static variant's calibration pass. The trainer stays in
        float8 for later stages."""
        options = dataclasses.replace(
            TRAIN_FP8_VARIANTS[name], fuse_projections=self.args.float8_fuse_projections
        )
        row = row or name
        layers = self.train.enable_float8(options)
        step = self.train_step(self.setup.kl_beta)
        groups, _ = self.sample()  # on-policy: the first step's parity is precision alone
        from omnirl.models.device import peak_memory_gb, reset_peak_memory

        m, first = self.timed_step(step, groups)  # recompiles (and calibrates) first
        reset_peak_memory(self.device)
        _, t = self.timed_step(step, groups)
        peak = peak_memory_gb(self.device)
        rollout = "float8" if self.rollout.float8 else "bf16"
        what = (
            f"{rollout} compiled rollout vs trainer float8 {options.activation}, input gradient "
            f"{options.input_grad}, scope {options.scope}"
            f"{', fast accumulation' if options.fast_accum else ''}"
            f"{', fused q/k/v' if options.fuse_projections else ''}"
        )
        self.report.add(
            f"omnirl_{row}",
            s_per_sample_step=self.per_sample_step(groups, t),
            compile_s=first - t,
            layers=layers,
            fast_accum=options.fast_accum,
            activation=options.activation,
            input_grad=options.input_grad,
            scope=options.scope,
            fuse_projections=options.fuse_projections,
            parity_mean=m["behav_prox_logp_absdiff_mean"],
            parity_max=m["behav_prox_logp_absdiff_max"],
            parity_of=what,
            activation_memory_budget=self.args.activation_memory_budget,
            recompute_attention=self.args.recompute_attention,
            **{f"peak_{kind}_gb": gb for kind, gb in peak.items()},
        )
        # kernel time by kind of one more step: what is left of it for kernel work
        self.report.add(
            f"profile_{row}",
            **profile_kernels(self.device, lambda: self.timed_step(step, groups), top=16),
        )
        self.sync_weights()
        self.iterate(f"omnirl_iteration_same_work_{row}", step, None, True, parity_of=what)
