#!/usr/bin/env bash
# The paper's comparison at the paper's scale (docs/gpu.md, "The GPU study"): on one CUDA
# GPU (H100/H200 class), in at most 6 minutes, `collage compare --preset gpu-study`:
#   a 112M-parameter GPT-2-style model (width 768, 12 heads, 14 layers, context 512) on the
#   standard library's source with a BPE tokenizer of 8,192 tokens, beta2 = 0.999, trained
#   under bf16, mixed, light and plus from the same seed, initial weights, batches and
#   schedule (1,000 steps of 16 x 512 tokens: 8.2M tokens per run), one after another;
# then writes the harness's report under OUT: report.md, results.json/.csv, history.json,
# config.json, the plots (loss curves, EDQ), tokens/s and peak memory per strategy, every
# run's record in OUT/runs/, this script's log, and gpu_study.tar.gz holding all of it
# (one file: what a lent machine's 8-file return carries whole).
#
# Sizing: the plan and its arithmetic are Python (collage.train.sizing; tested on CPU):
#   FLOPs per token = 6 N + 12 L d T = 7.39e8 for N = 112.2M, L = 14, d = 768, T = 512
#   assumed throughput = 989 TFLOP/s (H100/H200 dense bf16 peak) x 20 % MFU = 198 TFLOP/s
#                      = 267,548 tokens/s  (an assumption: no GPU has run this harness yet)
#   per run = 30.6 s training + 0.4 s evaluation + 25 s overhead (process, CUDA, compilation)
#   total   = 45 s setup (corpus, BPE) + 4 x 56.0 s = 269 s, inside the 360 s limit
# `--dry-run` prints that plan (and the commands) from the code, not from this comment.
# The run itself is capped below: the comparison gets 320 s; if it is cut short, the runs
# that finished are reported (`--report-only`) and the log says which did not.
#
# Usage: benchmarks/gpu_study.sh [--dry-run] OUT
#   --dry-run   print the plan and the commands, run nothing (no GPU needed)
# Environment: PYTHON (default python3); STUDY_TIMEOUT (seconds for the comparison, 320).
set -euo pipefail

usage() {
    echo "usage: $0 [--dry-run] OUT" >&2
    echo "  OUT: folder for the report (created); --dry-run: print the plan only" >&2
}

# [--dry-run] OUT; sets dry_run, out (absolute), python; cd to the repository; run_stage
source "$(dirname "$0")/gpu_common.sh"
# the checkout's own code, with no install step (the GPU machine has torch, tokenizers,
# matplotlib and tqdm); the comparison's children inherit it
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
# per-stage limits (seconds): 350 s in all, 10 s of the 6 minutes left for slack
study_timeout=${STUDY_TIMEOUT:-320}
report_timeout=25
pack_timeout=5

compare="$python -m collage compare --preset gpu-study --out $out --quiet"
declare -a names=() commands=() limits=()
stage() {  # name, limit (s), command
    names+=("$1"); limits+=("$2"); commands+=("$3")
}
stage study "$study_timeout" "$compare"
stage report "$report_timeout" "$compare --report-only"  # only if the study stage failed
# written outside OUT, then moved in: tar fails on a folder that changes as it reads it
stage pack "$pack_timeout" \
    "tmp=\$(mktemp) && tar -czf \$tmp -C $out --exclude ./gpu_study.tar.gz . && mv \$tmp $out/gpu_study.tar.gz"

if [ "$dry_run" -eq 1 ]; then
    $python -m collage compare --preset gpu-study --dry-run
    for i in "${!names[@]}"; do
        echo "[${names[$i]}] timeout ${limits[$i]}s: ${commands[$i]}"
    done
    exit 0
fi

mkdir -p "$out"
log="$out/gpu_study.log"
: > "$log"
export PYTHONUNBUFFERED=1
{
    echo "started $(date -u +%Y-%m-%dT%H:%M:%SZ) at commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
    $python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
} >> "$log" 2>&1
status=0
for i in "${!names[@]}"; do
    if [ "${names[$i]}" = report ] && [ "$status" -eq 0 ]; then
        continue  # the comparison wrote its report itself
    fi
    code=0
    run_stage "${names[$i]}" "${limits[$i]}" 5 "${commands[$i]}" "$log" || code=$?
    if [ "$code" -ne 0 ]; then status=1; fi
done
exit "$status"
