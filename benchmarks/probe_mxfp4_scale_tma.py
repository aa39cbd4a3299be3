"""Would the swapped MXFP4 GEMM's scales pay through TMA (issue 16)? The op loads each K step's e8m0 codes with byte
loads that Triton 3.6 leaves outside its software pipeline (each step waits on them); through TMA they would be
prefetched with the packed weights. TMA needs 16-byte rows, and a [BLOCK_N, 4]-byte tile has 4-byte ones, so here
the scales are re-laid once, as a weight would be at load time: one 256-byte record per (128-wide K step, 64-row
block), K-step major (`tile_scales`); one TMA box [1, 256] a step, reshaped to [64, 4] in registers. Compiled for
sm90 (Triton 3.6) the record's shared-memory load lands straight in the decode's layout: no layout conversion, 405
instructions a K step against 389 by pointers, the codes prefetched three stages deep.

A toy of the op's K loop, not the op: one weight [ROWS, K] (experts stacked), the packed bytes through TMA as in the
op, one shared activation tile [K, 16] in the K32 order, the op's folded bf16 decode, and each mode on the same
inputs: `bytes` (the op's pointer loads), `tma` (the re-laid scales) and `none` (every code 127: the bound, not a
contestant). Shapes: gpt-oss-120b's stage GEMMs as routed at 1, 16 and 64 tokens.

    PYTHONPATH=src python benchmarks/probe_mxfp4_scale_tma.py --out $OUT/scale_tma.json            # GPU
    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/probe_mxfp4_scale_tma.py --tiny --out F      # interpreter
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tritune.kernels.mxfp4 import k32_unscale, mxfp4_decode_k32, mxfp4_scale_codes  # noqa: E402
from tritune.kernels.mxfp4_records import RECORD_BYTES, scale_records  # noqa: E402

MODES = {"bytes": 0, "tma": 1, "none": 2}
BN, BK, BM = 64, 128, 16  # the rule table's swapped tile at <= 16 rows a block
# name -> (rows: the routed experts' weight rows stacked, K): stage 1 [2I, D] and stage 2 [D, I] of gpt-oss-120b
SHAPES = {"stage1, 1 token": (4 * 5760, 2880), "stage2, 1 token": (4 * 2880, 2880),
          "stage1, 16 tokens": (60 * 5760, 2880), "stage2, 16 tokens": (60 * 2880, 2880),
          "stage1, 64 tokens": (111 * 5760, 2880), "stage2, 64 tokens": (111 * 2880, 2880)}
TINY = {"tiny": (128, 160)}
COPY_BYTES_PER_S = 3.0e12


def tile_scales(scales: torch.Tensor) -> torch.Tensor:
    """scales uint8 [N, K/32] -> the op's scale records of that one weight (kernels/mxfp4_records.py), viewed
    [⌈N/64⌉ · ⌈K/128⌉, 256]: record (nb, kb) holds rows nb·64.. of K step kb, 127 past N or K."""
    return scale_records(scales[None]).view(-1, RECORD_BYTES)


@triton.jit
def _toy_kernel(w_desc, s_desc, s_ptr, a_desc, out_ptr, K, stride_sn, NB, MODE: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for i in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=3):
        k = i * BLOCK_K
        packed = w_desc.load([pid * BLOCK_N, k // 2])
        if MODE == 0:
            codes = mxfp4_scale_codes(s_ptr, rows, k, stride_sn, K, BLOCK_K)
        elif MODE == 1:
            codes = tl.reshape(s_desc.load([pid * tl.cdiv(K, BLOCK_K) + i, 0]), (BLOCK_N, BLOCK_K // 32))
        else:
            codes = tl.full((BLOCK_N, BLOCK_K // 32), 127, tl.uint8)
        w = mxfp4_decode_k32(packed, codes, BLOCK_N, BLOCK_K, a_desc.dtype)
        acc = tl.dot(w, a_desc.load([k, 0]), acc)
    acc = acc * k32_unscale(a_desc.dtype)
    tl.store(out_ptr + rows[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :], acc.to(out_ptr.dtype.element_ty))


def run_mode(mode: str, packed, scales, tiled, a_k32, out) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows, half = packed.shape
    w_desc = TensorDescriptor(packed, [rows, half], [half, 1], [BN, BK // 2])
    s_desc = TensorDescriptor(tiled, list(tiled.shape), [tiled.shape[1], 1], [1, tiled.shape[1]])
    a_desc = TensorDescriptor(a_k32, list(a_k32.shape), [BM, 1], [BK, BM])
    _toy_kernel[(rows // BN,)](w_desc, s_desc, scales, a_desc, out, 2 * half, scales.stride(0), rows // BN,
                               MODE=MODES[mode], BLOCK_N=BN, BLOCK_M=BM, BLOCK_K=BK, num_warps=4)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--tiny", action="store_true", help="a tiny shape (the interpreter's, fp16, without a GPU)")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    from tritune.kernels.mxfp4 import k32_permute
    from tritune.kernels.mxfp4_format import dequantize_mxfp4, quantize_mxfp4
    from tritune.tuning.bench import time_kernel

    cuda = torch.cuda.is_available()  # a GPU compiles the kernels: CPU tensors would not do even for --tiny
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float16)
    if cuda:
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    rows_out = []
    for name, (rows, k) in (TINY if args.tiny else SHAPES).items():
        gen = torch.Generator(device=device).manual_seed(rows + k)
        packed, scales = quantize_mxfp4(torch.randn(rows, k, generator=gen, device=device) / k**0.5)
        x = (torch.randn(BM, k, generator=gen, device=device) / 2).to(dtype)
        a_k32 = k32_permute(x).t().contiguous()  # [K, BM] in the K32 order, as the op's swapped stages read A
        tiled = tile_scales(scales)
        ref = dequantize_mxfp4(packed, scales).float() @ x.float().t()
        outs = {}
        for mode in MODES:
            out = torch.empty(rows, BM, dtype=dtype, device=device)
            outs[mode] = out
            run_mode(mode, packed, scales, tiled, a_k32, out)
            rel = float((out.float() - ref).norm() / ref.norm())
            args_now = (mode, packed, scales, tiled, a_k32, out)
            us = (time_kernel(lambda a=args_now: run_mode(*a), iters=args.iters, warmup=3).median_us
                  if cuda else float("nan"))
            floor = rows * k * 4.25 / 8 / COPY_BYTES_PER_S * 1e6
            rows_out.append({"shape": name, "rows": rows, "k": k, "mode": mode, "us": us, "floor_us": floor,
                             "rel_l2": rel, "equal_to_bytes": bool(torch.equal(out, outs["bytes"]))})
            print(json.dumps(rows_out[-1]), flush=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name() if cuda else "interpreter",
                                    "rows": rows_out}, indent=1))
    print("| GEMM | floor µs | " + " | ".join(f"{m} µs" for m in MODES) + " | tma / bytes |")
    print("|---|---|" + "---|" * len(MODES) + "---|")
    for name in (TINY if args.tiny else SHAPES):
        by = {r["mode"]: r for r in rows_out if r["shape"] == name}
        print(f"| {name} | {by['bytes']['floor_us']:.1f} | " + " | ".join(f"{by[m]['us']:.1f}" for m in MODES)
              + f" | {by['tma']['us'] / by['bytes']['us']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
