"""Exploration probe (not the benchmark): peaks, a hand-picked config sweep vs cuBLAS, and compile-pool cache hits."""

import os
import sys
import time
import json
import concurrent.futures as cf
import multiprocessing as mp

import torch
import triton
from triton.testing import do_bench

from tritune.kernels.gemm import GemmConfig, compile_only, gemm, gemm_reference
from tritune.kernels.quant import quantize_blocks, quantize_rows

OUT = os.environ.get("OUT", "/tmp")


def _compile(args):
    kernel, M, N, K, cfg = args
    t = time.time()
    try:
        compile_only(kernel, M, N, K, cfg)
        return ("ok", time.time() - t)
    except Exception as e:  # noqa
        return (f"{type(e).__name__}: {str(e)[:200]}", time.time() - t)


PTR = [
    (128, 256, 64, 8, 8, 3), (128, 128, 64, 8, 4, 4), (128, 128, 64, 8, 8, 4), (64, 128, 64, 8, 4, 4),
    (128, 64, 64, 8, 4, 4), (64, 64, 64, 8, 4, 4), (64, 256, 64, 8, 8, 3), (256, 128, 64, 8, 8, 3),
    (128, 128, 128, 8, 8, 3), (64, 128, 128, 8, 4, 3), (16, 64, 128, 1, 4, 4), (16, 128, 128, 1, 4, 4),
    (32, 64, 128, 1, 4, 4), (16, 64, 256, 1, 4, 3), (32, 128, 128, 1, 4, 4), (64, 64, 128, 1, 4, 4),
]
TMA = [(128, 256, 64, 8, 8, 3), (128, 128, 64, 8, 4, 4), (128, 128, 64, 8, 8, 4), (128, 256, 64, 8, 8, 4),
       (128, 128, 128, 8, 8, 3), (64, 128, 64, 8, 4, 4), (64, 256, 64, 8, 4, 4), (256, 128, 64, 8, 8, 3)]


def configs(M):
    out = []
    for bm, bn, bk, g, w, s in PTR:
        for split in (1, 2, 4, 8):
            if split > 1 and M > 256:
                continue
            out.append(GemmConfig(bm, bn, bk, g, w, s, split))
    for bm, bn, bk, g, w, s in TMA:
        out.append(GemmConfig(bm, bn, bk, g, w, s, 1, "", True))
    return out


def main():
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(0)
    print(props.name, props.multi_processor_count, "SMs", triton.__version__, torch.__version__, flush=True)
    # peaks
    x = torch.empty(2**30, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    t = do_bench(lambda: y.copy_(x), return_mode="median")
    copy_bw = 2 * x.numel() / (t * 1e-3) / 1e12
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    t = do_bench(lambda: a @ b, return_mode="median")
    mm_peak = 2 * 8192**3 / (t * 1e-3) / 1e12
    a8 = a.to(torch.float8_e4m3fn)
    b8 = b.to(torch.float8_e4m3fn)
    one = torch.ones(8192, 1, device=dev)
    t = do_bench(lambda: torch._scaled_mm(a8, b8.T, scale_a=one, scale_b=one.T, out_dtype=torch.bfloat16),
                 return_mode="median")
    fp8_peak = 2 * 8192**3 / (t * 1e-3) / 1e12
    print(f"PEAKS copy {copy_bw:.2f} TB/s  bf16 mm {mm_peak:.0f} TFLOP/s  fp8 scaled_mm {fp8_peak:.0f} TFLOP/s", flush=True)
    del x, y, a, b, a8, b8

    shapes = [(4096, 4096), (14336, 4096), (4096, 14336)]
    Ms = [1, 16, 64, 256, 1024, 4096, 8192]
    # compile everything in a spawn pool first
    jobs = []
    seen = set()
    for kernel in ("bf16", "a8w8_blockscale"):
        for (N, K) in shapes:
            for M in (16, 4096):
                for cfg in configs(M):
                    if kernel == "a8w8_blockscale" and 128 % cfg.BLOCK_SIZE_K:
                        continue
                    key = (kernel, N, K, cfg)
                    if key in seen:
                        continue
                    seen.add(key)
                    jobs.append((kernel, M, N, K, cfg))
    t0 = time.time()
    ctx = mp.get_context("spawn")
    with cf.ProcessPoolExecutor(16, mp_context=ctx) as pool:
        res = list(pool.map(_compile, jobs))
    wall = time.time() - t0
    serial = sum(r[1] for r in res)
    fails = [(j[0], str(j[4]), r[0]) for j, r in zip(jobs, res) if r[0] != "ok"]
    print(f"COMPILE {len(jobs)} configs in {wall:.1f}s wall on 16 procs; sum of per-config times {serial:.1f}s; "
          f"failures {len(fails)}", flush=True)
    for f in fails[:10]:
        print("  FAIL", f)

    rows = []
    log = open(f"{OUT}/probe_log.txt", "w")
    for kernel in ("bf16", "a8w8_blockscale"):
        for (N, K) in shapes:
            bw = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
            for M in Ms:
                aw = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
                flops = 2 * M * N * K
                if kernel == "bf16":
                    ref_fn = lambda: aw @ bw.T  # noqa
                    args = (aw, bw)
                    kw = {}
                    ref = gemm_reference("bf16", aw, bw)
                else:
                    qa, sa = quantize_blocks(aw, 1)
                    qb, sb = quantize_blocks(bw, 128)
                    qa2, sa2 = quantize_rows(aw)
                    qb2, sb2 = quantize_rows(bw)
                    ref_fn = lambda: torch._scaled_mm(qa2, qb2.T, scale_a=sa2[:, None], scale_b=sb2[None, :],  # noqa
                                                      out_dtype=torch.bfloat16)
                    args = (qa, qb)
                    kw = dict(a_scale=sa, b_scale=sb)
                    ref = gemm_reference("a8w8_blockscale", qa, qb, sa, sb)
                t_ref = do_bench(ref_fn, return_mode="median")
                best = (1e9, None)
                first_call = []
                out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
                ws = torch.empty(8 * M * N, device=dev, dtype=torch.float32)
                for cfg in configs(M):
                    if kernel == "a8w8_blockscale" and 128 % cfg.BLOCK_SIZE_K:
                        continue
                    try:
                        t1 = time.time()
                        gemm(kernel, *args, cfg, out=out, workspace=ws, **kw)
                        torch.cuda.synchronize()
                        first_call.append(time.time() - t1)
                        err = ((out.float() - ref).norm() / ref.norm()).item()
                        if not err < 2e-2:
                            print(f"  WRONG {kernel} M={M} N={N} K={K} {cfg} err={err}", file=log)
                            continue
                        t = do_bench(lambda: gemm(kernel, *args, cfg, out=out, workspace=ws, **kw),  # noqa
                                     warmup=5, rep=20, return_mode="median")
                    except Exception as e:  # noqa
                        print(f"  ERR {kernel} {cfg}: {type(e).__name__} {str(e)[:200]}", file=log)
                        continue
                    print(f"{kernel} M={M} N={N} K={K} {cfg} {t*1e3:.1f}us", file=log)
                    if t < best[0]:
                        best = (t, cfg)
                fc = sorted(first_call)
                row = dict(kernel=kernel, M=M, N=N, K=K, ref_us=t_ref * 1e3, best_us=best[0] * 1e3,
                           ratio=t_ref / best[0], tflops=flops / best[0] / 1e9, cfg=str(best[1]),
                           first_call_median_ms=fc[len(fc) // 2] * 1e3, first_call_max_ms=fc[-1] * 1e3)
                rows.append(row)
                print(json.dumps(row), flush=True)
    json.dump(rows, open(f"{OUT}/probe.json", "w"), indent=1)
    print("\nkernel M N K ref_us best_us ratio tflops | first-call median/max ms")
    for r in rows:
        print(f"{r['kernel']:>16} {r['M']:5d} {r['N']:5d} {r['K']:5d} {r['ref_us']:8.1f} {r['best_us']:8.1f} "
              f"{r['ratio']:5.2f} {r['tflops']:6.0f} | {r['first_call_median_ms']:.0f}/{r['first_call_max_ms']:.0f}  {r['cfg']}")


if __name__ == "__main__":
    main()
