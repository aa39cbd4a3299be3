#!/usr/bin/env bash
# Idempotent set-up shared by scripts/main.sh and scripts/test.sh. Installs only what is missing:
# - torch: the CPU build torch==2.13.0 when torch is absent (never the multi-GB CUDA build); an installed
#   torch (the GPU machine's 2.11) is used untouched;
# - triton, numpy, pandas, tqdm, filelock, pytest, pytest-timeout when absent;
# - this package, editable, without touching its dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pip_install() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }

if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "setup: torch not found; installing the CPU build torch==2.13.0" >&2
    pip_install torch==2.13.0
fi
missing=()
for spec in "triton:triton" "numpy:numpy" "pandas:pandas" "tqdm:tqdm" "filelock:filelock" \
            "pytest:pytest" "pytest_timeout:pytest-timeout"; do
    module=${spec%%:*}
    "$PY" -c "import $module" 2>/dev/null || missing+=("${spec#*:}")
done
if ((${#missing[@]})); then
    echo "setup: installing ${missing[*]}" >&2
    pip_install "${missing[@]}"
fi
if ! "$PY" -c "import tritune, sys; sys.exit(0 if tritune.__file__.startswith('$(pwd)/src') else 1)" 2>/dev/null; then
    # Offline machines (the GPU box) have no index for build isolation: fall back to the installed setuptools.
    pip_install --no-deps -e . 2>/dev/null || pip_install --no-deps --no-build-isolation -e .
fi
