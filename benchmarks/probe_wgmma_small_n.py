"""How fast Hopper's wgmma runs with a narrow N, the shape the swapped MXFP4 GEMM feeds it (issue 16): the weight tile
[BLOCK_N, BLOCK_K] is the MMA's M side, the block of token rows its N side, 16-64 wide at decode sizes.

Each CTA multiplies one register-resident tile (the left operand, as the swapped GEMM's decoded weights; "regs") or
one tile the compiler leaves in shared memory ("smem") by one [BLOCK_K, BLOCK_M] tile, ITERS times into one
accumulator, with no loads in the loop, on 8 CTAs per SM. The rate is the multiply-adds done per SM per clock cycle
at an assumed 1.755 GHz (the H100 SXM's clock under load), against the dense bf16 peak of 2048 (989.4 TFLOP/s at
1.83 GHz on 132 SMs); also the time one m64nNk16 wgmma takes per SM.

    PYTHONPATH=src python benchmarks/probe_wgmma_small_n.py --out $OUT/wgmma.json          # GPU only
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch
import triton
import triton.language as tl

PEAK_MAC_PER_SM_CYCLE = 2048  # H100 SXM dense bf16: 989.4e12 / 2 / 132 / 1.83e9
CLOCK_HZ = 1.755e9
TILES = [(bn, bm, bk) for bn in (64, 128) for bm in (16, 32, 64, 128) for bk in (64,)]


@triton.jit
def _mma_loop(w_ptr, a_ptr, out_ptr, ITERS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_K: tl.constexpr, IN_REGS: tl.constexpr):
    n = tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    k = tl.arange(0, BLOCK_K)
    w = tl.load(w_ptr + n[:, None] * BLOCK_K + k[None, :])
    if IN_REGS:  # computed, as a decoded tile is: the MMA takes it from registers
        w = (w.to(tl.float32) * 1.0078125).to(tl.bfloat16)
    a = tl.load(a_ptr + k[:, None] * BLOCK_M + m[None, :])
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for _ in range(ITERS):
        acc = tl.dot(w, a, acc)
    pid = tl.program_id(0)
    tl.store(out_ptr + pid * BLOCK_N * BLOCK_M + n[:, None] * BLOCK_M + m[None, :], acc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--iters", type=int, default=4096, help="tl.dot calls per CTA")
    ap.add_argument("--ctas-per-sm", type=int, default=8)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_wgmma_small_n: needs a GPU")
    from tritune.tuning.bench import time_kernel

    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    clock_hz = CLOCK_HZ
    grid = (sms * args.ctas_per_sm,)
    rows = []
    for bn, bm, bk in TILES:
        for in_regs in (True, False):
            w = torch.randn(bn, bk, device="cuda").bfloat16()
            a = torch.randn(bk, bm, device="cuda").bfloat16()
            out = torch.empty(grid[0], bn, bm, device="cuda")

            def call(w=w, a=a, out=out, bn=bn, bm=bm, bk=bk, in_regs=in_regs):
                _mma_loop[grid](w, a, out, ITERS=args.iters, BLOCK_N=bn, BLOCK_M=bm, BLOCK_K=bk, IN_REGS=in_regs,
                                num_warps=4)
                return out

            call()
            us = time_kernel(call, iters=10, warmup=2).median_us
            macs = grid[0] * args.iters * bn * bm * bk
            per_sm_cycle = macs / (us * 1e-6) / sms / clock_hz
            instr_ns = us * 1e3 / (grid[0] * args.iters * (bn // 64) * (bk // 16) / sms)
            rows.append({"BLOCK_N": bn, "BLOCK_M (MMA N)": bm, "BLOCK_K": bk, "A": "regs" if in_regs else "smem",
                         "us": us, "mac_per_sm_cycle": per_sm_cycle, "of_peak": per_sm_cycle / PEAK_MAC_PER_SM_CYCLE,
                         "ns_per_wgmma_per_sm": instr_ns})
            print(json.dumps(rows[-1]), flush=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "clock_hz": clock_hz, "sms": sms,
                                    "triton": triton.__version__, "rows": rows}, indent=1))
    print("| MMA M (BLOCK_N) | MMA N (BLOCK_M) | A from | µs | MAC / SM / cycle | of peak | ns per m64nNk16 per SM |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['BLOCK_N']} | {r['BLOCK_M (MMA N)']} | {r['A']} | {r['us']:.1f} | {r['mac_per_sm_cycle']:.0f} | "
              f"{r['of_peak']:.2f} | {r['ns_per_wgmma_per_sm']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
