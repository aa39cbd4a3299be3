r"""Stream-K for the bf16 GEMM (issue 15), measured as an experiment, not in the op: does spreading the last wave's
tiles over every SM along K close the wave-quantization gap at M 256-1024?

The kernel: a persistent grid of one program per SM; the first `dp` tiles whole (data-parallel, as the persistent TMA
kernel), the remaining tiles' K iterations split evenly over the programs ("one": the partial last wave; "two": the
last full wave too; all when the grid is under one wave). A tile split between programs is summed by the last of them
to finish (an fp32 partial per program and side, a lock per tile; deterministic order). MODE 1 skips that sum (each
piece stores its own part: wrong results), to time the split without its fix-up.

    PYTHONPATH=src python benchmarks/probe_gemm_streamk.py --out $OUT/sk.json

Prints a JSON row per point: cuBLAS, the persistent TMA kernel (128x128x64, 4 and 6 stages), and the stream-K kernel
per policy and mode as [µs, "dp/sk tiles/SK programs", rel err, same bits on a rerun].
"""
import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import os
import sys

sys.path.insert(0, "src")
sys.path.insert(0, "benchmarks")


@triton.jit
def _coords(tile_id, num_pid_m, num_pid_n, BM: tl.constexpr, BN: tl.constexpr, GROUP_SIZE_M: tl.constexpr):
    num_pid_in_group = GROUP_SIZE_M * num_pid_n
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_SIZE_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_SIZE_M)
    pid_m = first_pid_m + (tile_id % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m * BM, pid_n * BN


@triton.jit
def _streamk_kernel(a_desc, b_desc, c_desc, part_ptr, lock_ptr, M, N, K, dp_tiles, sk_tiles, sk_programs,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_SIZE_M: tl.constexpr,
               NUM_SMS: tl.constexpr, MODE: tl.constexpr = 0):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    kt = tl.cdiv(K, BK)
    for tile_id in tl.range(pid, dp_tiles, NUM_SMS, flatten=True):
        off_m, off_n = _coords(tile_id, num_pid_m, num_pid_n, BM, BN, GROUP_SIZE_M)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(kt):
            a = a_desc.load([off_m, ki * BK])
            b = b_desc.load([off_n, ki * BK])
            acc = tl.dot(a, b.T, acc)
        c_desc.store([off_m, off_n], acc.to(c_desc.dtype))
    total = sk_tiles * kt
    if pid < sk_programs:
        it = pid * total // sk_programs
        end = (pid + 1) * total // sk_programs
        offs_m = tl.arange(0, BM)
        offs_n = tl.arange(0, BN)
        tile_offs = offs_m[:, None] * BN + offs_n[None, :]
        while it < end:
            t = it // kt
            k0 = t * kt
            seg_end = tl.minimum(end, k0 + kt)
            off_m, off_n = _coords(dp_tiles + t, num_pid_m, num_pid_n, BM, BN, GROUP_SIZE_M)
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for ki in range(it - k0, seg_end - k0):
                a = a_desc.load([off_m, ki * BK])
                b = b_desc.load([off_n, ki * BK])
                acc = tl.dot(a, b.T, acc)
            p0 = ((k0 + 1) * sk_programs - 1) // total
            p1 = ((k0 + kt) * sk_programs - 1) // total
            if p0 == p1 or MODE == 1:
                c_desc.store([off_m, off_n], acc.to(c_desc.dtype))
            else:
                slot = pid * 2 + (pid == p0).to(tl.int32)
                tl.store(part_ptr + slot * (BM * BN) + tile_offs, acc)
                tl.debug_barrier()
                done = tl.atomic_add(lock_ptr + t, 1, sem="acq_rel", scope="gpu")
                if done == p1 - p0:
                    tot = tl.zeros((BM, BN), dtype=tl.float32)
                    for p in range(p0, p1 + 1):
                        s = p * 2 + (p == p0).to(tl.int32)
                        tot += tl.load(part_ptr + s * (BM * BN) + tile_offs, cache_modifier=".cg")
                    c_desc.store([off_m, off_n], tot.to(c_desc.dtype))
                    tl.atomic_xchg(lock_ptr + t, 0, sem="relaxed", scope="gpu")
            it = seg_end


def split_policy(tiles: int, sms: int, policy: str) -> tuple[int, int]:
    """(tiles computed whole, tiles split along K) for a grid of `tiles` on `sms` programs."""
    if tiles % sms == 0:
        return tiles, 0
    if tiles < sms:
        return 0, tiles
    w = tiles // sms
    if policy == "one":  # full waves whole, the partial wave stream-K'd over every SM
        return w * sms, tiles - w * sms
    return (w - 1) * sms, tiles - (w - 1) * sms  # "two": the last full wave and the partial one


class StreamK:
    """One bound launch of the stream-K kernel on A, B and C (the fp32 partials and per-tile locks kept)."""

    def __init__(self, a, b, out, BM, BN, BK, warps, stages, policy="two", group=8, sms=None, mode=0):
        M, K = a.shape
        N = b.shape[0]
        sms = sms or torch.cuda.get_device_properties(a.device).multi_processor_count
        tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
        self.dp, self.sk = split_policy(tiles, sms, policy)
        kt = triton.cdiv(K, BK)
        self.skp = min(sms, self.sk * kt)
        self.part = torch.empty(sms * 2 * BM * BN, device=a.device, dtype=torch.float32)
        self.lock = torch.zeros(max(self.sk, 1), device=a.device, dtype=torch.int32)
        self.args = (TensorDescriptor.from_tensor(a, [BM, BK]), TensorDescriptor.from_tensor(b, [BN, BK]),
                     TensorDescriptor.from_tensor(out, [BM, BN]), self.part, self.lock, M, N, K, self.dp, self.sk,
                     self.skp)
        if policy == "dponly":
            self.dp, self.sk, self.skp = tiles, 0, 0
            self.args = self.args[:8] + (self.dp, self.sk, self.skp)
        self.kw = dict(BM=BM, BN=BN, BK=BK, GROUP_SIZE_M=group, NUM_SMS=sms, num_warps=warps, num_stages=stages,
                       MODE=mode)
        self.grid = (sms if self.sk else min(sms, tiles),)

    def __call__(self):
        _streamk_kernel[self.grid](*self.args, **self.kw)


def main() -> None:
    from bench_gemm_gen2 import SHAPES

    from tritune.kernels.gemm import GemmConfig
    from tritune.ops import gemm
    from tritune.tuning.bench import time_kernel

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    points = [("qwen2.5-7b-qkv", 1024), ("llama3-8b-qkv", 1024), ("deepseek-v3-q-a", 1024), ("deepseek-v3-q-a", 4096),
              ("qwen2.5-7b-qkv", 256), ("llama3-8b-qkv", 256)]
    rows = []
    for name, m in points:
        n, k = SHAPES[name]
        g = torch.Generator(device="cuda").manual_seed(1)
        a = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        b = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).bfloat16()
        ref = a.float() @ b.float().T
        row = {"shape": name, "M": m, "cublas": time_kernel(lambda a=a, b=b: a @ b.T, iters=50).median_us}
        for stages in (4, 6):
            cfg = GemmConfig(128, 128, 64, GROUP_SIZE_M=8, num_warps=4, num_stages=stages, PERSISTENT_TMA=True)
            row[f"persistent s{stages}"] = time_kernel(lambda a=a, b=b, cfg=cfg: gemm(a, b, config=cfg),
                                                       iters=50).median_us
            for policy, mode in (("dponly", 0), ("one", 1), ("one", 0), ("two", 1), ("two", 0)):
                out = torch.zeros(m, n, device="cuda", dtype=torch.bfloat16)
                f = StreamK(a, b, out, 128, 128, 64, 4, stages, policy, mode=mode)
                f()
                torch.cuda.synchronize()
                err = float((out.float() - ref).norm() / ref.norm())
                out.zero_()
                f()
                again = out.clone()
                out.zero_()
                f()
                row[f"sk {policy} mode{mode} s{stages}"] = (
                    round(time_kernel(f, iters=50).median_us, 1), f"{f.dp}/{f.sk}/{f.skp}", round(err, 5),
                    bool(torch.equal(out, again)))
        print(json.dumps(row), flush=True)
        rows.append(row)
    with open(args.out, "w") as fh:
        json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
