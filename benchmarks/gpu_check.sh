#!/usr/bin/env bash
# The GPU check (docs/gpu.md): on one CUDA GPU, in at most 8 minutes,
#   1. install the project (editable, offline: no dependency is fetched),
#   2. run the tests marked `cuda` or `triton` (pytest -m "cuda or triton"),
#   3. `collage bench optimizer --device cuda` at 16M, 100M and 1B parameters, beside torch's
#      fused AdamW on fp32 and bf16 weights, optimi and torchao where installed,
#   4. `collage bench train --device cuda` on a ~125M-parameter GPT (GPT-2 small's width and
#      heads, 18 layers: the byte-level vocabulary has no 38M-parameter embedding),
#   5. the model's prediction for the same kernels (benchmarks/gpu_model.py: compiled for the
#      GPU's architecture, read off the SASS; the host time of a step measured on this GPU's
#      host, launches included, beside torch's fused AdamW's),
#   6. read the goals off the results (benchmarks/gpu_goals.py), the model's prediction
#      beside each measurement,
# writing JSON and markdown under OUT (10 files: what a device run brings back).
#
# Usage: benchmarks/gpu_check.sh [--dry-run] OUT
#   --dry-run   print the commands, run nothing (no GPU needed)
# Environment: PYTHON (default python3); *_TIMEOUT (seconds per stage, see below).
set -euo pipefail

usage() {
    echo "usage: $0 [--dry-run] OUT" >&2
    echo "  OUT: folder for the results (created); --dry-run: print the commands only" >&2
}

# [--dry-run] OUT; sets dry_run, out (absolute), python; cd to the repository; run_stage
source "$(dirname "$0")/gpu_common.sh"
# per-stage limits (seconds): 450 s in all, 30 s of the 8 minutes left for slack
install_timeout=${INSTALL_TIMEOUT:-45}
tests_timeout=${TESTS_TIMEOUT:-115}
optimizer_timeout=${OPTIMIZER_TIMEOUT:-140}
train_timeout=${TRAIN_TIMEOUT:-80}
model_timeout=${MODEL_TIMEOUT:-55}
goals_timeout=15

# the test selection: the CUDA matrix and the interpreter tests, nothing else
test_marks="cuda or triton"
sizes="16m,100m,1b"
baselines="torch-fused-bf16,optimi-kahan,torchao-sr"
gpt="--d-model 768 --n-layers 18 --n-heads 12 --context 1024 --batch-size 8"

declare -a names=() commands=() limits=()
stage() {  # name, limit (s), command
    names+=("$1"); limits+=("$2"); commands+=("$3")
}
xdist=""
if [ "$dry_run" -eq 0 ] && "$python" -c "import xdist" 2>/dev/null; then
    xdist="-n 8"  # kernel variants compile in parallel (one Triton compile per worker)
fi
stage install "$install_timeout" \
    "$python -m pip install --no-deps --no-build-isolation -q -e ."
stage tests "$tests_timeout" \
    "$python -m pytest -q -p no:cacheprovider -m \"$test_marks\" $xdist --junitxml=$out/tests.xml tests > $out/tests.log 2>&1"
stage bench_optimizer "$optimizer_timeout" \
    "TRITON_CACHE_DIR=\$(mktemp -d) $python -m collage bench optimizer --device cuda --size $sizes --paths fused --baselines $baselines --repeats 5 --warmup 2 --min-time 0.3 --json --quiet --markdown $out/bench_optimizer.md > $out/bench_optimizer.json"
stage bench_train "$train_timeout" \
    "$python -m collage bench train --device cuda $gpt --modes autocast,plus,light,mixed --rounds 1 --steps 10 --warmup 3 --json --quiet --markdown $out/bench_train.md > $out/bench_train.json"
stage model "$model_timeout" \
    "$python benchmarks/gpu_model.py --arch auto --default-only --rules adamw --host-device cuda --json --markdown $out/gpu_model.md > $out/gpu_model.json"
stage goals "$goals_timeout" \
    "$python benchmarks/gpu_goals.py $out > $out/goals.md"

if [ "$dry_run" -eq 1 ]; then
    for i in "${!names[@]}"; do
        echo "[${names[$i]}] timeout ${limits[$i]}s: ${commands[$i]}"
    done
    exit 0
fi

mkdir -p "$out"
log="$out/gpu_check.log"
: > "$log"
export PYTHONUNBUFFERED=1
status=0
for i in "${!names[@]}"; do
    code=0
    run_stage "${names[$i]}" "${limits[$i]}" 10 "${commands[$i]}" "$log" || code=$?
    if [ "$code" -ne 0 ]; then status=1; fi
    if [ "${names[$i]}" = install ] && [ "$code" -ne 0 ]; then exit 1; fi
done
exit "$status"
