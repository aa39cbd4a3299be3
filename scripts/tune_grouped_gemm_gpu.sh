#!/usr/bin/env bash
# Tune the grouped GEMMs of Qwen3-30B-A3B and Mixtral-8x7B at 8192 tokens on this GPU (the focused space in
# examples/grouped_gemm_space.json), then benchmark with the tuned store. Writes under ${OUT:-tritune-out}.
set -euo pipefail
out=${OUT:-tritune-out}
mkdir -p "$out/configs"
for model in qwen3-30b-a3b mixtral-8x7b; do
  PYTHONPATH=src python -m tritune.cli grouped-gemm --model "$model" --seqlen 8192 --search-space examples/grouped_gemm_space.json \
    --iters 10 --warmup 2 --top-n 3 --no-progress --config-dir "$out/configs" -o "$out/grouped_gemm_${model}_8192.csv" \
    > "$out/tune_${model}.log" 2>&1 || { tail -30 "$out/tune_${model}.log"; exit 1; }
  tail -45 "$out/tune_${model}.log"
done
