"""GEMM benchmark (GPU): tune, then tuned tritune vs cuBLAS (through torch) vs tritune's untuned heuristic.

    PYTHONPATH=src python3 benchmarks/bench_gemm.py --out DIR [--kernels bf16,a8w8_blockscale] [--quick]

Tunes M ∈ {1,16,64,256,1024,4096,8192} × (N, K) ∈ {(4096,4096), (14336,4096), (4096,14336)} into DIR/configs
with a fresh Triton cache (so compile times are real), then times every op with the engine's own timer
(CUDA events, L2 flushed, median). Also times one (N, K) with 8 M values tuned from scratch (the 3-minute target).
Writes DIR/bench_gemm.json and prints a markdown table for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

MS = (1, 16, 64, 256, 1024, 4096, 8192)
SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336))
TARGET_MS = (16, 32, 64, 128, 256, 512, 2048, 4096)


def peaks() -> dict:
    from tritune.tuning.bench import time_kernel

    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    t = time_kernel(lambda: y.copy_(x), iters=20, flush_l2=False).median_us
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    tm = time_kernel(lambda: a @ b, iters=20).median_us
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones(8192, 1, device="cuda")
    t8 = time_kernel(lambda: torch._scaled_mm(a8, b8.T, scale_a=one, scale_b=one.T, out_dtype=torch.bfloat16),
                     iters=20).median_us
    return {"copy_TBps": 2 * x.numel() / t / 1e6, "bf16_TFLOPs": 2 * 8192**3 / tm / 1e6,
            "fp8_TFLOPs": 2 * 8192**3 / t8 / 1e6}


def tune(kernel: str, shapes, out: Path, journal: Path):
    from tritune.device import current_device, gpu_count
    from tritune.tuners.gemm import GemmShape, GemmTuneRequest, tune_gemm
    from tritune.tuning.tuner import TuneSettings
    from tritune.tuning.types import BenchSettings

    req = GemmTuneRequest(kernel, tuple(GemmShape(tuple(ms), n, k) for ms, n, k in shapes), out)
    settings = TuneSettings(journal_path=journal, bench=BenchSettings(iters=30, warmup=5),
                            num_gpus=max(1, gpu_count()), progress=False)
    t0 = time.perf_counter()
    report = tune_gemm(req, current_device(), settings)
    return time.perf_counter() - t0, report


def cublas_and_ops(kernel: str, M: int, N: int, K: int):
    """(tuned op fn, heuristic op fn, cuBLAS fn) on one set of random inputs."""
    from tritune import ops
    from tritune.kernels.quant import quantize_blocks, quantize_rows
    from tritune.ops.gemm import heuristic_config

    a = torch.randn(M, K, device="cuda")
    b = torch.randn(N, K, device="cuda") / math.sqrt(K)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    heur = heuristic_config(kernel, M, N, K, sms)
    if kernel == "bf16":
        a16, b16 = a.bfloat16(), b.bfloat16()
        return (lambda: ops.gemm(a16, b16), lambda: ops.gemm(a16, b16, config=heur), lambda: a16 @ b16.T)
    qa, sa = quantize_rows(a)
    qb, sb = quantize_rows(b)

    def scaled_mm():
        return torch._scaled_mm(qa, qb.T, scale_a=sa[:, None], scale_b=sb[None, :], out_dtype=torch.bfloat16)

    if kernel == "a8w8":
        return (lambda: ops.gemm_a8w8(qa, qb, sa, sb), lambda: ops.gemm_a8w8(qa, qb, sa, sb, config=heur), scaled_mm)
    ba, bsa = quantize_blocks(a, 1)
    bb, bsb = quantize_blocks(b, 128)
    return (lambda: ops.gemm_a8w8_blockscale(ba, bb, bsa, bsb),
            lambda: ops.gemm_a8w8_blockscale(ba, bb, bsa, bsb, config=heur), scaled_mm)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--kernels", default="bf16,a8w8_blockscale")
    ap.add_argument("--skip-target", action="store_true", help="skip the 8-M from-scratch tuning timing")
    args = ap.parse_args()
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="tritune-triton-cache-")
    from tritune.ops.gemm import reload_configs, select_config
    from tritune.tuning.bench import time_kernel

    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "triton": __import__("triton").__version__, "date": time.strftime("%Y-%m-%d"), "peaks": peaks(),
              "tuning": [], "rows": []}
    print("peaks", json.dumps(result["peaks"]), flush=True)
    cfg_dir = args.out / "configs"
    if not args.skip_target:
        kernel = "a8w8_blockscale" if "a8w8_blockscale" in args.kernels else args.kernels.split(",")[0]
        scratch = Path(tempfile.mkdtemp())
        wall, report = tune(kernel, [(TARGET_MS, 4096, 4096)], scratch / "cfg", scratch / "j.sqlite")
        s = report.summary
        result["target"] = {"kernel": kernel, "N": 4096, "K": 4096, "Ms": TARGET_MS, "wall_s": wall,
                            "summary": s.lines()}
        print(f"TARGET {kernel} 8 M values tuned in {wall:.1f}s", *s.lines(), sep="\n  ", flush=True)
        shutil.rmtree(scratch, ignore_errors=True)
    for kernel in args.kernels.split(","):
        wall, report = tune(kernel, [(MS, n, k) for n, k in SHAPES], cfg_dir, args.out / "journal.sqlite")
        result["tuning"].append({"kernel": kernel, "wall_s": wall, "summary": report.summary.lines(),
                                 "compile_speedup": report.summary.compile_speedup})
        print(f"TUNED {kernel} in {wall:.1f}s", *report.summary.lines(), sep="\n  ", flush=True)
        os.environ["TRITUNE_CONFIG_DIR"] = str(cfg_dir)
        reload_configs()
        for n, k in SHAPES:
            for m in MS:
                tuned, heur, ref = cublas_and_ops(kernel, m, n, k)
                t_tuned = time_kernel(tuned, iters=50).median_us
                t_heur = time_kernel(heur, iters=50).median_us
                t_ref = time_kernel(ref, iters=50).median_us
                flops = 2 * m * n * k
                _, source = select_config(kernel, m, n, k, torch.device("cuda"))
                row = {"kernel": kernel, "M": m, "N": n, "K": k, "tuned_us": t_tuned, "default_us": t_heur,
                       "cublas_us": t_ref, "tuned_tflops": flops / t_tuned / 1e6,
                       "cublas_tflops": flops / t_ref / 1e6, "ratio": t_ref / t_tuned,
                       "default_ratio": t_ref / t_heur, "source": source}
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
        (args.out / "bench_gemm.json").write_text(json.dumps(result, indent=1))
    print("\n| kernel | M | N | K | cuBLAS us | tuned us | default us | tuned TFLOP/s | tuned/cuBLAS "
          "| default/cuBLAS |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        print(f"| {r['kernel']} | {r['M']} | {r['N']} | {r['K']} | {r['cublas_us']:.1f} | {r['tuned_us']:.1f} | "
              f"{r['default_us']:.1f} | {r['tuned_tflops']:.0f} | {r['ratio']:.2f} | {r['default_ratio']:.2f} |")
    for kernel in args.kernels.split(","):
        rows = [r for r in result["rows"] if r["kernel"] == kernel]
        big = [r["ratio"] for r in rows if r["M"] >= 64]
        print(f"{kernel}: geomean tuned/cuBLAS all M {math.prod(r['ratio'] for r in rows) ** (1 / len(rows)):.3f}; "
              f"M>=64 {math.prod(big) ** (1 / len(big)):.3f}")


if __name__ == "__main__":
    main()
