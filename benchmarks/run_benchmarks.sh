#!/usr/bin/env bash
# Reproduce docs/benchmarks/<hardware>_<date>.md: the optimizer step benchmark (all sizes,
# every strategy and path, torch/optimi/torchao baselines, compile cost in fresh processes)
# and the training benchmark at two model sizes. Needs: pip install -e ".[bench]".
# On a shared or small machine pass --threads 1 (OpenMP barriers stall when a thread of a
# parallel region is descheduled); numbers are medians, ratios are paired in the same rounds.
set -euo pipefail
out=${1:-bench-results}
threads=${THREADS:-1}
mkdir -p "$out"
collage bench optimizer --threads "$threads" --compile-cost --json \
    --markdown "$out/optimizer.md" > "$out/optimizer.json"
collage bench train --threads "$threads" --json --markdown "$out/train_small.md" \
    > "$out/train_small.json"
collage bench train --threads "$threads" --d-model 512 --n-layers 8 --n-heads 8 \
    --batch-size 4 --steps 6 --warmup 2 --json --markdown "$out/train_medium.md" \
    > "$out/train_medium.json"
echo "results in $out/"
