r"""Tiles whose width is not a power of two, for the bf16 GEMM (issue 15), as an experiment outside the op: does a
BN + BT wide tile (say 128 + 16 = 144) close the wave gap that power-of-two tiles leave?

Why: at qwen2.5-7b-qkv (N 4608, K 3584), M 1024, the tuned kernel runs 288 tiles of 128×128 on 132 SMs, three waves
for 2.18 waves of work, and is at the per-SM peak inside each wave (63.9 µs against 63.7 for three waves at peak);
cuBLAS runs 144-wide tiles there (256 tiles, 1.94 waves) in 49.0 µs. Triton's block shapes are powers of two, so the
kernel below makes one tile of two: a BN-wide and a BT-wide part of B, two dots into two accumulators sharing the A
tile, two C stores. Persistent, TMA loads and stores (edge tiles zero-filled and clipped by TMA), as the op's
persistent kernel.

    PYTHONPATH=src python benchmarks/probe_gemm_wide_tiles.py --out $OUT/wide.json

Prints a JSON row per point: cuBLAS, the persistent TMA kernel at 128×128×64 (4 warps, 6 stages), and each wide
tile as [µs, tiles, waves, rel err]; then a table of the best wide tile per point.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# (BLOCK_M, BLOCK_N, BLOCK_TAIL, num_warps, num_stages): each fits the H100's 227 KiB with its C tiles
# (shared memory compiled for cuda:90 by Triton 3.9: 205-225 KiB; 64x(256+64) at 4 and 128x(256+64) at 3 stages did
# not fit)
VARIANTS = ((128, 128, 16, 4, 5), (128, 128, 32, 4, 5), (128, 128, 64, 8, 4), (64, 128, 16, 4, 7),
            (64, 128, 64, 4, 6), (64, 256, 64, 4, 3))
POINTS = (("qwen2.5-7b-qkv", 1024), ("qwen2.5-7b-qkv", 256), ("deepseek-v3-q-a", 1024), ("deepseek-v3-q-a", 4096),
          ("llama3-8b-qkv", 1024), ("llama3-70b-tp4-gate-up", 1024), ("qwen2.5-7b-gate-up", 256))


@triton.jit
def _wide_tile_kernel(a_desc, b_desc, bt_desc, c_desc, ct_desc, M, N, K,
                      BM: tl.constexpr, BN: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                      GROUP_SIZE_M: tl.constexpr, NUM_SMS: tl.constexpr):
    """C tiles BM × (BN + BT): B's first BN columns of a tile through `b_desc`, the next BT through `bt_desc`."""
    width: tl.constexpr = BN + BT
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, width)
    k_tiles = tl.cdiv(K, BK)
    num_tiles = num_pid_m * num_pid_n
    num_pid_in_group = GROUP_SIZE_M * num_pid_n
    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=True):
        group_id = tile_id // num_pid_in_group
        first_pid_m = group_id * GROUP_SIZE_M
        group_size_m = min(num_pid_m - first_pid_m, GROUP_SIZE_M)
        off_m = (first_pid_m + (tile_id % group_size_m)) * BM
        off_n = ((tile_id % num_pid_in_group) // group_size_m) * width
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        acc_t = tl.zeros((BM, BT), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([off_m, ki * BK])
            acc = tl.dot(a, b_desc.load([off_n, ki * BK]).T, acc)
            acc_t = tl.dot(a, bt_desc.load([off_n + BN, ki * BK]).T, acc_t)
        c_desc.store([off_m, off_n], acc.to(c_desc.dtype))
        ct_desc.store([off_m, off_n + BN], acc_t.to(ct_desc.dtype))


class WideTile:
    """One bound launch of the wide-tile kernel on A [M, K], B [N, K] and C [M, N]."""

    def __init__(self, a, b, out, bm: int, bn: int, bt: int, bk: int, warps: int, stages: int, group: int = 8,
                 sms: int | None = None) -> None:
        M, K = a.shape
        N = b.shape[0]
        sms = sms or torch.cuda.get_device_properties(a.device).multi_processor_count
        self.tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn + bt)
        self.waves = self.tiles / sms
        self.args = (TensorDescriptor.from_tensor(a, [bm, bk]), TensorDescriptor.from_tensor(b, [bn, bk]),
                     TensorDescriptor.from_tensor(b, [bt, bk]), TensorDescriptor.from_tensor(out, [bm, bn]),
                     TensorDescriptor.from_tensor(out, [bm, bt]), M, N, K)
        self.kw = dict(BM=bm, BN=bn, BT=bt, BK=bk, GROUP_SIZE_M=group, NUM_SMS=sms, num_warps=warps,
                       num_stages=stages)
        self.grid = (min(sms, self.tiles),)
        self.out = out

    def __call__(self) -> torch.Tensor:
        _wide_tile_kernel[self.grid](*self.args, **self.kw)
        return self.out


def main() -> None:
    from bench_gemm_gen2 import SHAPES
    from probe_util import checked_time

    from tritune.kernels.gemm import GemmConfig
    from tritune.ops import gemm
    from tritune.tuning.bench import time_kernel

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--bk", type=int, default=64)
    args = ap.parse_args()
    rows = []
    for name, m in POINTS:
        n, k = SHAPES[name]
        g = torch.Generator(device="cuda").manual_seed(m + n + k)
        a = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        b = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).bfloat16()
        ref = a.float() @ b.float().T
        cfg = GemmConfig(128, 128, 64, GROUP_SIZE_M=8, num_warps=4, num_stages=6, PERSISTENT_TMA=True)
        row = {"shape": name, "M": m, "N": n, "K": k,
               "cublas": time_kernel(lambda a=a, b=b: a @ b.T, iters=50).median_us,
               "persistent 128x128x64 w4 s6": time_kernel(lambda a=a, b=b, cfg=cfg: gemm(a, b, config=cfg),
                                                          iters=50).median_us}
        for bm, bn, bt, warps, stages in VARIANTS:
            key = f"wide {bm}x({bn}+{bt})x{args.bk} w{warps} s{stages}"
            out = torch.zeros(m, n, device="cuda", dtype=torch.bfloat16)
            f = WideTile(a, b, out, bm, bn, bt, args.bk, warps, stages)
            result = checked_time(f, ref, lambda fn: time_kernel(fn, iters=50).median_us)
            row[key] = [result[0], f.tiles, round(f.waves, 2), result[1]] if isinstance(result, tuple) else result
        print(json.dumps(row), flush=True)
        rows.append(row)
    with open(args.out, "w") as fh:
        json.dump(rows, fh, indent=1)
    print("| point | cuBLAS µs | persistent µs | best wide µs | tile | cuBLAS / best wide |\n|---|---|---|---|---|---|")
    for r in rows:
        wide = {k: v[0] for k, v in r.items() if k.startswith("wide") and isinstance(v, list) and v[3] < 2e-2}
        best = min(wide, key=wide.get) if wide else None
        t = wide.get(best, math.nan)
        print(f"| {r['shape']} {r['M']} | {r['cublas']:.1f} | {r['persistent 128x128x64 w4 s6']:.1f} | {t:.1f} | "
              f"{best} | {r['cublas'] / t:.2f} |")


if __name__ == "__main__":
    main()
