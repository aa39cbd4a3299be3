#!/usr/bin/env bash
# The test modules whose kernels run on the GPU when there is one (conftest.py switches to the interpreter
# otherwise), run on the GPU: what a CPU CI cannot check (Triton's real compiler and launcher, bf16 dots, TMA,
# tl.dot_scaled, warp specialisation). Full log under $OUT, the summary on stdout.
#   OUT=/tmp/out bash scripts/gpu_tests.sh [extra pytest args]
#   TESTS="tests/test_launch.py tests/test_gemm.py" OUT=/tmp/out bash scripts/gpu_tests.sh   (those modules only;
#   all of them take over 10 minutes on an H100)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src
OUT=${OUT:-/tmp/tritune-gpu-tests}; mkdir -p "$OUT"
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_tests.sh: no GPU here')" || exit 2
MODULES=${TESTS:-$(grep -l "torch.cuda.is_available()" tests/test_*.py)}
python -m pytest -q -p no:cacheprovider $MODULES "$@" > "$OUT/gpu_tests.log" 2>&1
rc=$?
grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -40
tail -1 "$OUT/gpu_tests.log"
exit $rc
