#!/usr/bin/env bash
# The main job: tune the shipped examples (examples/gemm_shapes.csv, examples/untuned_fmoe.csv) on the GPU into tritune-out/.
# Without a GPU it says so and runs a tiny example through Triton's interpreter (correctness only).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m tritune.cli example "$@"
