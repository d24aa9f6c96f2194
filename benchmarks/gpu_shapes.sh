#!/usr/bin/env bash
# The ShapesEval quick start on one GPU machine: the README's run with `run.device=cuda`.
# The launcher gives the trainer and every rollout worker the GPU (`rollout_devices`), the
# reward workers score on the host's CPUs; then the base model and the last checkpoint are
# scored on the held-out prompts (600 x 2 seeds, on the GPU).
#
#   bash benchmarks/gpu_shapes.sh        # device tool: carry [".whl"], $OUT set by the tool
#
# STEPS (default 250, about what the 30-minute CPU run makes) and MINUTES (default 6) bound
# the run, whichever comes first; the learning-rate schedule follows the same progress.
# ROLLOUT, REWARD: workers; OVERRIDES: more config overrides; LIMIT: score the first N
# held-out prompts only. A CPU dry run:
#   DEVICE=cpu STEPS=2 MINUTES=1 ROLLOUT=1 REWARD=1 LIMIT=12 uv run bash benchmarks/gpu_shapes.sh
set -uo pipefail  # no -e: the scoring runs on whatever the run left
cd "$(dirname "$0")/.."
START=$(date +%s)
OUT=${OUT:-runs/gpu_shapes}
DEVICE=${DEVICE:-cuda}
RUN=${RUN_DIR:-/tmp/gpu_shapes_run}
mkdir -p "$OUT"
rm -rf "$RUN"

. benchmarks/device_env.sh
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
omnirl() { python3 -c "import sys; from omnirl.tools.cli import main; sys.exit(main())" "$@"; }

echo "== [$(($(date +%s) - START)) s] launch on $DEVICE"
omnirl launch examples/shapes_flow_grpo.yaml "run.device=$DEVICE" "run.output_dir=$RUN" \
    "max_steps=${STEPS:-250}" "max_minutes=${MINUTES:-6}" ${OVERRIDES:-} \
    --rollout "${ROLLOUT:-2}" --reward "${REWARD:-2}" >"$OUT/launch.log" 2>&1
echo "launch: exit $?"
cp "$RUN/metrics.jsonl" "$OUT/metrics.jsonl" 2>/dev/null
grep -h "built \| attention \|started rollout" "$OUT/launch.log" | cut -c1-300 | head -n 8

echo "== [$(($(date +%s) - START)) s] held-out score"
python3 -m omnirl.tools.shapes_curve "$RUN" --prompts examples/prompts/shapes_heldout.jsonl \
    --seeds 2 --every 1000 --device "$DEVICE" ${LIMIT:+--limit "$LIMIT"} --out "$OUT/curve" \
    >"$OUT/curve.log" 2>&1
echo "curve: exit $?"
tail -n 12 "$OUT/curve.log"
echo "== [$(($(date +%s) - START)) s] done"
