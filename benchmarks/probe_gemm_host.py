r"""Host cost of one block-scaled GEMM call as a user makes it (`ops.gemm_a8w8_blockscale`), per kernel path: the
Gluon kernel (one tile a program / persistent), the persistent TMA Triton kernel and the pointer kernel; and whether
each bound launch took the direct C launch and the cached descriptor encoding (`kernels.launch.BoundKernel`).

    PYTHONPATH=src python benchmarks/probe_gemm_host.py [--m 256] [--n 1536] [--k 1536] [--calls 2000]

Host µs a call: the wall time of `calls` back-to-back calls with no synchronization inside, over `calls` (the
GPU kernel is far shorter than the host path at these sizes only if the GPU keeps up; the GPU time is printed
beside it).
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main(argv: list[str] | None = None) -> None:
    from tritune.kernels import gemm as gk
    from tritune.kernels import launch as kl
    from tritune.kernels.quant import quantize_blocks
    from tritune.ops import gemm_a8w8_blockscale
    from tritune.ops.gemm import _PLANS
    from tritune.tuning.bench import time_kernel

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, default=256)
    ap.add_argument("--n", type=int, default=1536)
    ap.add_argument("--k", type=int, default=1536)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args(argv)
    a = torch.randn(args.m, args.k, device="cuda")
    b = torch.randn(args.n, args.k, device="cuda") / args.k ** 0.5
    (qa, sa), (qb, sb) = quantize_blocks(a, 1), quantize_blocks(b, 128)
    out = torch.empty(args.m, args.n, device="cuda", dtype=torch.bfloat16)
    configs = {
        "gluon": gk.GemmConfig(64, 128, 128, 8, 4, 4, GLUON=True),
        "gluon persistent": gk.GemmConfig(64, 128, 128, 8, 4, 4, PERSISTENT_TMA=True, GLUON=True),
        "triton persistent TMA": gk.GemmConfig(64, 128, 128, 8, 4, 4, PERSISTENT_TMA=True),
        "triton pointer": gk.GemmConfig(64, 128, 128, 8, 4, 4),
    }
    rows = {}
    for name, cfg in configs.items():
        def call(cfg=cfg):
            return gemm_a8w8_blockscale(qa, qb, sa, sb, out=out, config=cfg)

        call()
        torch.cuda.synchronize()
        plan = next(p for p in reversed(list(_PLANS.values())) if p.cfg == cfg)
        direct = "direct" in plan.main.launch.__code__.co_freevars  # BoundKernel's C-launch branch
        walls = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                call()
            walls.append((time.perf_counter() - t0) / args.calls * 1e6)
            torch.cuda.synchronize()
        rows[name] = {"host_us": sorted(walls)[2], "gpu_us": time_kernel(call, iters=50, warmup=5).median_us,
                      "direct_launch": direct, "descriptors_encoded_once": plan.main.encode is not kl._as_is}
        print(name, json.dumps(rows[name]), flush=True)


if __name__ == "__main__":
    main()
