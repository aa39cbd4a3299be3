"""Why one GPU-bound block-fp8 GEMM ran 1.11-1.17x slower eager than as a CUDA graph (issue 11's last miss: M=1024
N=4096 K=14336, shipped persistent TMA config): is the kernel itself slower eager, or are there gaps between kernels?

Per config (the op's own choice, plus the other launch classes): eager and graph time as bench_runtime.py takes them,
and, from the torch profiler, the kernel's mean duration and the mean gap between consecutive kernels in each mode.

    python benchmarks/probe_eager_graph.py --out F [--kernel a8w8_blockscale --mnk 1024,4096,14336]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from bench_runtime import capture, eager_and_graph, gemm_baseline, gemm_call, gemm_inputs, rotated
from profile_moe_kernels import device_events


def kernel_trace(run, rounds: int = 10) -> dict:
    """Mean device duration of each GEMM kernel and mean idle gap between consecutive kernels (µs)."""
    events = [e for e in device_events(run, rounds, warmup=1) if e.device_time > 0]
    gemm = [e for e in events if "gemm" in e.name.lower() or "kernel" in e.name.lower()]
    gaps = [b.time_range.start - a.time_range.end for a, b in zip(gemm, gemm[1:], strict=False)]
    return {"kernels": len(gemm), "names": sorted({e.name[:60] for e in gemm}),
            "kernel_us": statistics.mean(e.device_time for e in gemm) if gemm else None,
            "gap_us": statistics.median(gaps) if gaps else None}


def probe(kernel: str, M: int, N: int, K: int, configs: dict) -> list[dict]:
    sets = rotated(lambda s: gemm_inputs(kernel, M, N, K, s), (M + N) * K)
    rows = []
    for name, cfg in configs.items():
        calls = [gemm_call(kernel, x, cfg) for x in sets]
        rec = {"config": name, **eager_and_graph(calls)}

        def eager(calls=calls):
            for fn in calls:
                fn()
        graph, _ = capture(eager)
        rec["trace_eager"] = kernel_trace(eager)
        rec["trace_graph"] = kernel_trace(graph.replay)
        rows.append(rec)
    base = [gemm_baseline(kernel, x) for x in sets]
    rows.append({"config": "cuBLAS", **eager_and_graph(base)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--kernel", default="a8w8_blockscale")
    ap.add_argument("--mnk", default="1024,4096,14336")
    args = ap.parse_args()
    from tritune.kernels.gemm import GemmConfig
    from tritune.ops.gemm import select_config

    M, N, K = (int(x) for x in args.mnk.split(","))
    chosen, source = select_config(args.kernel, M, N, K, torch.device("cuda"))
    configs = {f"op's choice ({source[:40]})": chosen,
               "pointer 128x128x128 w8 s3": GemmConfig(128, 128, 128, 8, 8, 3),
               "pointer 64x128x128 w4 s4": GemmConfig(64, 128, 128, 8, 4, 4),
               "tma 128x128x128 w8 s3": GemmConfig(128, 128, 128, 8, 8, 3, PERSISTENT_TMA=True)}
    rows = probe(args.kernel, M, N, K, configs)
    args.out.write_text(json.dumps({"kernel": args.kernel, "mnk": [M, N, K], "chosen": str(chosen), "rows": rows},
                                   indent=1, default=str))
    print("| config | eager µs | graph µs | eager/graph | kernel µs eager / graph | gap µs eager / graph |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        te, tg = r.get("trace_eager", {}), r.get("trace_graph", {})
        fmt = lambda v: f"{v:.1f}" if isinstance(v, (int, float)) else "-"  # noqa: E731
        print(f"| {r['config']} | {r['eager_us']:.1f} | {r['graph_us']:.1f} | {r['eager_us'] / r['graph_us']:.2f} | "
              f"{fmt(te.get('kernel_us'))} / {fmt(tg.get('kernel_us'))} | {fmt(te.get('gap_us'))} / "
              f"{fmt(tg.get('gap_us'))} |")


if __name__ == "__main__":
    main()
