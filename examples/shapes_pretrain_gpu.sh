#!/usr/bin/env bash
# Pretrain ShapesEval base-model candidates on one GPU, side by side, and keep snapshots of
# each so that a base model of the wanted held-out accuracy can be chosen. The candidates are
# latent models (a tiny VAE first, then the transformer on 4x8x8 latents). The committed base
# (examples/checkpoints/shapes_t2i, latent step 5220, structural caption noise 0.45) came from
# `MINUTES=7.7 EVAL_EVERY=0.5 EVAL_HELDOUT=240 EVAL_TRAIN=0 WORKERS=3 KEEP_NEAR=0.25,0.3,0.35
# KEEP_LAST=0 VAE_FROM=examples/checkpoints/shapes_t2i RUNS="latent:0.45:extra+missing+miscount"`
# (with three other runs beside it; the VAE it reused is the one the base before it trained,
# `MINUTES=3.4 VAE_MINUTES=0.9`, latent_small step 2565); RUNS=small gives the pixel-space
# model committed before those.
#
# On the device tool's nvidia-h200 (16 cores; its image lacks diffusers, msgspec, pyzmq:
# carry them as wheels in .whl/, see /work/.library/device/README.md):
#
#   bash examples/shapes_pretrain_gpu.sh          # run: carry [".whl"], OUT set by the tool
#
# Anywhere else with a GPU and `uv sync` done: `OUT=runs/pretrain uv run bash examples/...`.
# The runs are small and launch-bound, so they share one GPU at little cost; each renders
# its own data in 6 processes. Every minute each evaluates its EMA model on 240
# held-out and 120 train prompts (10 ODE steps, CFG 3) and keeps a snapshot. At the end
# the script keeps, per run, the snapshots nearest the held-out strict accuracies in KEEP_NEAR
# (default 0.25,0.35) and the last KEEP_LAST (default 1), in tarballs of at most 15 MB (the
# device tool returns at most 8 files of 16 MB), and the logs in logs.tgz.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/pretrain_gpu}
MINUTES=${MINUTES:-5.5}  # the flow-matching stage; the VAE stage adds VAE_MINUTES
VAE_MINUTES=${VAE_MINUTES:-1.5}
DEVICE=${DEVICE:-cuda}
EVAL_HELDOUT=${EVAL_HELDOUT:-240}
EVAL_TRAIN=${EVAL_TRAIN:-120}
WORK=${WORK:-/tmp/shapes_pretrain}
# one run each, side by side: PRESET, PRESET:CAPTION_NOISE or PRESET:CAPTION_NOISE:KINDS
# (shapes_caption_noise; KINDS '+'-separated, e.g. extra+missing; default CAPTION_KINDS, a
# comma-separated list, default all)
RUNS=${RUNS:-"latent latent_small"}
# a trained ShapesT2I folder whose VAE every latent run reuses instead of training its own
# (e.g. examples/checkpoints/shapes_t2i); the snapshots are then packed without vae/
VAE_FROM=${VAE_FROM:-}
THREADS=${THREADS:-1}  # torch threads per run (DEVICE=cpu: the cores it may use)
WORKERS=${WORKERS:-6}  # render processes per run
EVAL_EVERY=${EVAL_EVERY:-1}  # minutes
mkdir -p "$OUT" "$WORK"
. benchmarks/device_env.sh  # wheels from .whl/, workspace sources, entry points
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true

run() {
    local name=$1
    shift
    python3 -m omnirl.tools.pretrain_shapes "$WORK/$name" --device "$DEVICE" \
        --minutes "$MINUTES" --vae-minutes "$VAE_MINUTES" --threads "$THREADS" --workers "$WORKERS" \
        --eval-every "$EVAL_EVERY" --snapshots \
        --eval-prompts "$EVAL_HELDOUT" --eval-train-prompts "$EVAL_TRAIN" --log-every 200 \
        "$@" >"$WORK/$name.log" 2>&1 &
}
vae_args=()
[[ -n $VAE_FROM ]] && vae_args=(--vae-from "$VAE_FROM")
for spec in $RUNS; do
    IFS=: read -r preset noise kinds <<<"$spec"
    noise=${noise:-0}
    kinds=${kinds//+/,}
    kinds=${kinds:-${CAPTION_KINDS:-extra,missing,miscount,relation,colour}}
    name=$preset
    [[ $noise != 0 ]] && name=${preset}_noise${noise}
    [[ $spec == *:*:* ]] && name=${name}_${kinds//,/-}
    run "$name" --preset "$preset" --batch 256 --lr 1e-3 --caption-noise "$noise" \
        --caption-noise-kinds "$kinds" "${vae_args[@]}"
done
wait

python3 - "$WORK" "$OUT" "${KEEP_NEAR:-0.25,0.35}" "${KEEP_LAST:-1}" "$VAE_FROM" <<'PY'
import json, shutil, subprocess, sys
from pathlib import Path

work, out = Path(sys.argv[1]), Path(sys.argv[2])
KEEP_NEAR = [float(x) for x in sys.argv[3].split(",") if x]
KEEP_LAST = int(sys.argv[4])
SKIP_VAE = bool(sys.argv[5])  # reused: the same bytes as VAE_FROM's, not sent back
for run in sorted(p for p in work.iterdir() if (p / "pretrain_log.jsonl").is_file()):
    rows = [json.loads(l) for l in (run / "pretrain_log.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["event"] == "eval"]
    for r in evals:
        print(run.name, r["step"], r["train_minutes"], r["heldout_strict"], r.get("train_strict"))
    if not evals:
        continue
    keep = {min(evals, key=lambda r: abs(r["heldout_strict"] - t))["step"] for t in KEEP_NEAR}
    keep.update(r["step"] for r in evals[len(evals) - KEEP_LAST :])
    shutil.copy(run / "pretrain_log.jsonl", work / f"{run.name}_log.jsonl")
    chunks, size = [[]], 0
    for name in (f"step_{s:07d}" for s in sorted(keep)):
        files = (run / "snapshots" / name).rglob("*")
        n = sum(f.stat().st_size for f in files if f.is_file() and not (SKIP_VAE and "vae" in f.parts))
        if chunks[-1] and size + n > 15e6:
            chunks.append([])
            size = 0
        chunks[-1].append(name)
        size += n
    for i, names in enumerate(chunks):
        tar = out / f"{run.name}_{i}.tgz"
        exclude = ["--exclude=*/vae"] if SKIP_VAE else []
        subprocess.run(["tar", "czf", tar, *exclude, "-C", run / "snapshots", *names], check=True)
        print("packed", tar.name, names, tar.stat().st_size)
logs = [p.name for p in work.iterdir() if p.suffix in (".log", ".jsonl")]
subprocess.run(["tar", "czf", out / "logs.tgz", "-C", work, *sorted(logs)], check=True)
PY
