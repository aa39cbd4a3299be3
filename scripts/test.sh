#!/usr/bin/env bash
# The test suite (CPU, Triton interpreter where there is no GPU). .ci/run calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Ray (the optional extra tritune[ray]) for tests/test_ray_executor.py's local cluster. A machine without a package
# index goes on without it: those tests then skip, saying why.
if ! "${PYTHON:-python3}" -c "import ray" 2>/dev/null; then
    "${PYTHON:-python3}" -m pip install -q --disable-pip-version-check ray \
        || echo "test.sh: could not install ray; the Ray executor tests will skip" >&2
fi
exec "${PYTHON:-python3}" -m pytest -q "$@"
