#!/usr/bin/env bash
# The test suite (CPU, Triton interpreter where there is no GPU). .ci/run calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m pytest -q "$@"
