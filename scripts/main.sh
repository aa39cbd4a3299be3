#!/usr/bin/env bash
# The main job: tune the shipped example shapes (examples/gemm_shapes.csv) on the GPU into tritune-out/.
# Without a GPU it says so and runs a tiny example through Triton's interpreter (correctness only).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m tritune.cli example "$@"
