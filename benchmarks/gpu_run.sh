#!/usr/bin/env bash
# The GPU path on one H200, in one device call (issue 9): the tiny-model tests on CUDA, the
# FSDP2 world-size-1 check, then benchmarks/gpu_sd35m.py in the time that is left.
#
#   bash benchmarks/gpu_run.sh          # device tool: carry [".whl"], $OUT set by the tool
#
# The image lacks diffusers, msgspec, pyzmq, omegaconf and torchdata: they travel as wheels
# in .whl/ (benchmarks/device_env.sh installs them). TOTAL_S (default 530) is the wall-clock
# the whole script may take; each step is cut by `timeout` so that the benchmark keeps the
# rest and everything it wrote to $OUT (at most 6 files) comes back. BENCH_ARGS adds
# arguments to gpu_sd35m.py; TESTS_S and FSDP_S cut the first two steps (a dry run on a CPU: DEVICE=cpu BENCH_ARGS="--tiny
# --compile-backend aot_eager").
set -uo pipefail  # no -e: a failed step must not stop the next
cd "$(dirname "$0")/.."
START=$(date +%s)
OUT=${OUT:-runs/gpu_run}
TOTAL_S=${TOTAL_S:-530}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
elapsed() { echo $(($(date +%s) - START)); }

. benchmarks/device_env.sh  # wheels from .whl/, workspace sources, entry points
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
export TORCHINDUCTOR_CACHE_DIR=/tmp/omnirl_inductor HF_HUB_OFFLINE=1

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, diffusers, transformers, peft; print('torch', torch.__version__,
        'cuda', torch.version.cuda, 'diffusers', diffusers.__version__, 'transformers',
        transformers.__version__, 'peft', peft.__version__)"
    git log --oneline -1 2>/dev/null || true
} >"$OUT/env.txt" 2>&1

echo "== [$(elapsed) s] tiny-model tests on $DEVICE"
OMNIRL_TEST_DEVICE=$DEVICE timeout ${TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider \
    tests/models/test_sd3_parity.py tests/models/test_compile_backend.py \
    tests/trainer/test_train_step_sd3.py tests/trainer/test_gpu_path.py \
    >"$OUT/tests.log" 2>&1
echo "tests: exit $? ($(tail -n 1 "$OUT/tests.log"))"

echo "== [$(elapsed) s] FSDP2 TrainStep, world size 1 (torchrun, nccl)"
timeout ${FSDP_S:-90} python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
    benchmarks/fsdp_step.py --mode fsdp \
    --device "$DEVICE" --dtype bfloat16 >"$OUT/fsdp_ws1.log" 2>&1
echo "fsdp: exit $? ($(grep '^{' "$OUT/fsdp_ws1.log" | tail -n 1))"

BUDGET=$((TOTAL_S - $(elapsed) - 25))
echo "== [$(elapsed) s] gpu_sd35m.py, budget ${BUDGET} s"
timeout $((BUDGET + 20)) python3 benchmarks/gpu_sd35m.py --device "$DEVICE" \
    --budget-s "$BUDGET" --out "$OUT" ${BENCH_ARGS:-} >"$OUT/gpu_sd35m.log" 2>&1
echo "gpu_sd35m: exit $?"
grep -h '^RESULT' "$OUT/gpu_sd35m.log" | cut -c1-300 | tail -n 40
echo "== [$(elapsed) s] done"
