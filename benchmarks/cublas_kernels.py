r"""Which kernel cuBLAS runs for `torch.matmul` at each GEMM point (issue 15): name, grid, block, shared memory and
registers from a torch.profiler trace, warm L2. The names say what Triton would have to match (nvjet tiles such as
144x128, cluster shapes, stage counts, split-K).

    PYTHONPATH=src python benchmarks/cublas_kernels.py --out $OUT/cublas_kernels.json [--ms 256,1024,4096]

The (N, K) are bench_gemm_gen2.py's six; one JSON row per kernel launched.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))


def main(argv: list[str] | None = None) -> int:
    from bench_gemm_gen2 import SHAPES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--ms", default="256,1024,4096")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("cublas_kernels: needs a GPU", file=sys.stderr)
        return 2
    rows = []
    for name, (n, k) in SHAPES.items():
        for m in map(int, args.ms.split(",")):
            a = torch.randn(m, k, device="cuda").bfloat16()
            b = torch.randn(n, k, device="cuda").bfloat16()
            for _ in range(3):
                a @ b.T
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                a @ b.T
                torch.cuda.synchronize()
            with tempfile.NamedTemporaryFile(suffix=".json") as trace:
                prof.export_chrome_trace(trace.name)
                events = json.load(open(trace.name))["traceEvents"]
            for e in (e for e in events if e.get("cat") == "kernel"):
                row = {"shape": name, "M": m, "N": n, "K": k, "kernel": e["name"], "grid": e["args"].get("grid"),
                       "block": e["args"].get("block"), "smem": e["args"].get("shared memory"),
                       "regs": e["args"].get("registers per thread"), "dur_us": e.get("dur")}
                print(json.dumps(row), flush=True)
                rows.append(row)
    args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
