#!/usr/bin/env bash
# GPU check of the user-kernel API and of GEMM / user-kernel bundles (each bundle built with no GPU visible).
#   OUT=/tmp/out bash scripts/aot_gpu_smoke.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src
OUT=${OUT:-/tmp/tritune-smoke}; W=/tmp/tritune-smoke-work; rm -rf "$W"; mkdir -p "$OUT" "$W"
T=tritune.cli
step() { echo "== $*"; }
step "flash attention example: tune, then reuse"
python examples/flash_attention.py --store "$W/fa_store.json" > "$OUT/flash_attention.log" 2>&1; echo "rc=$?"
tail -45 "$OUT/flash_attention.log"
cp "$W/fa_store.json" "$OUT/" 2>/dev/null
step "user-kernel bundle (flash attention, causal, fp16)"
CUDA_VISIBLE_DEVICES= python -m $T aot build --kernel examples/flash_attention.py:attention \
  --problem '{"Z": 4, "H": 16, "N_CTX": 2048, "HEAD_DIM": 64, "CAUSAL": true, "dtype": "fp16"}' -o "$W/fa_bundle" 2>&1 | tail -4
python -m $T aot run "$W/fa_bundle" --reps 50 --no-progress 2>&1 | tail -6
python -m $T aot import "$W/fa_bundle" -o "$W/fa_tuned" 2>&1 | tail -3
cp "$W/fa_bundle/perf_stats.csv" "$OUT/fa_perf_stats.csv"; cp "$W/fa_bundle/perf_stats.svg" "$OUT/fa_perf_stats.svg"
step "GEMM bundle (M=512 N=4096 K=4096 bf16)"
echo '{"BLOCK_SIZE_M": [64, 128], "BLOCK_SIZE_N": [128, 256], "BLOCK_SIZE_K": [64], "GROUP_SIZE_M": [8], "num_warps": [4, 8], "num_stages": [3, 4], "cache_modifier": ["", ".cg"]}' > "$W/gemm_space.json"
CUDA_VISIBLE_DEVICES= python -m $T aot build --kernel gemm --m 512 --n 4096 --k 4096 --search-space "$W/gemm_space.json" -o "$W/gemm_bundle" 2>&1 | tail -4
python -m $T aot run "$W/gemm_bundle" --reps 50 --no-progress 2>&1 | tail -6
python -m $T aot import "$W/gemm_bundle" -o "$W/gemm_tuned" 2>&1 | tail -3
cp "$W/gemm_bundle/perf_stats.csv" "$OUT/gemm_perf_stats.csv"
python - "$W" <<'PY'
import sys, torch, json
from pathlib import Path
from tritune.tuning.bench import time_kernel
w = Path(sys.argv[1])
a = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16); b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
t = time_kernel(lambda: torch.matmul(a, b.T), iters=50, warmup=5).median_us
print(f"cuBLAS 512x4096x4096 bf16: {t:.1f} us ({2*512*4096*4096/t/1e6:.0f} TFLOP/s)")
print(sorted(Path(w / "gemm_tuned").iterdir()))
PY
