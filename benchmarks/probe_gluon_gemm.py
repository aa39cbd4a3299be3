r"""The persistent Gluon GEMM (`kernels/gluon_gemm.py`: tiles 96 / 192 wide as two power-of-two MMAs on one A tile)
against cuBLAS and tritune's Triton op, untuned, on issue 15's six held-out (N, K) (issue 15). bf16: `torch.matmul`;
a8w8 (fp8 per-token / per-channel): row-wise `torch._scaled_mm` on the same fp8 values. Each contestant is checked
against the fp32 product of what it was given (relative L2 error), then timed with the engine's timer (CUDA events,
L2 flushed, median).

    PYTHONPATH=src python benchmarks/probe_gluon_gemm.py --out $OUT/gluon_gemm.json [--kernel bf16|a8w8] \
        [--shapes qwen2.5-7b-qkv,deepseek-v3-q-a] [--ms 256,1024,4096,8192] [--variants 128:192:4:8:8,64:192:5:4:8]

A variant is BM:BN:STAGES:WARPS:GROUP_M[:P[:E]]: P 1 runs one tile a program (else persistent, a program a SM); E 0
loads the next tile's first blocks only after this tile's last MMA (E 1, the default: while its last MMAs run). The
variant ws:BM:BN:STAGES:GROUP_M[:WARPS[:LOADER_REGS]] runs the warp-specialised kernel
(`kernels/gluon_gemm_ws.py`: a loader warp group feeding the consumer's warps). The last line of each point names
the best variant; the tail of the output is a table and geomeans.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_gemm_gen2 import MS, SHAPES, bf16_operands, geomean  # noqa: E402
from probe_util import checked_rounds, parse_ws_variant  # noqa: E402

VARIANTS = ("128:128:4:8:8", "128:128:5:4:8", "128:192:4:8:8", "64:192:5:4:8", "128:256:3:8:8", "64:256:4:4:8",
            "64:128:6:4:8", "64:96:6:4:8", "256:128:3:8:8")
WRONG = 2e-2


def parse_variant(v: str) -> tuple[int, ...] | dict:
    ws = parse_ws_variant(v)
    if ws is not None:
        return ws
    parts = v.split(":")
    if len(parts) not in (5, 6, 7) or not all(x.isdigit() for x in parts):
        raise ValueError(f"variant {v!r} is not BM:BN:STAGES:WARPS:GROUP_M[:P[:E]]")
    return tuple(int(x) for x in parts + ["0", "1"][len(parts) - 5:])


def run_point(kernel: str, n: int, k: int, m: int, variants: list[str], iters: int, rounds: int = 1) -> dict:
    import triton

    from tritune.kernels.gluon_gemm import gluon_gemm
    from tritune.kernels.gluon_gemm_ws import ws_gemm
    from tritune.kernels.quant import quantize_rows
    from tritune.ops import gemm, gemm_a8w8
    from tritune.ops.gemm import select_config
    from tritune.ops.heuristics import gemm_heuristic
    from tritune.tuning.bench import time_kernel

    a, b = bf16_operands(m, n, k)
    timer = lambda fn: time_kernel(fn, iters=iters, warmup=3).median_us  # noqa: E731
    row = {"kernel": kernel, "N": n, "K": k, "M": m, "flops": 2.0 * m * n * k}
    if kernel == "bf16":
        ref = a.float() @ b.float().T
        calls = {"cublas": lambda: a @ b.T, "op": lambda: gemm(a, b)}
        scales = {}
    else:
        qa, sa = quantize_rows(a)
        qb, sb = quantize_rows(b)
        ref = (qa.float() * sa[:, None]) @ (qb.float() * sb[:, None]).T
        triton_rule = gemm_heuristic("a8w8", m, n, k, gluon=False)  # the rule table before the Gluon tiles
        calls = {"cublas": lambda: torch._scaled_mm(qa, qb.T, scale_a=sa[:, None], scale_b=sb[None, :],
                                                    out_dtype=torch.bfloat16),
                 "op": lambda: gemm_a8w8(qa, qb, sa, sb),
                 "op_triton": lambda: gemm_a8w8(qa, qb, sa, sb, config=triton_rule)}
        row["op_config"] = str(select_config("a8w8", m, n, k, a.device)[0])
        a, b, scales = qa, qb, {"a_scale": sa, "b_scale": sb}
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    for v in variants:
        ws = parse_ws_variant(v)
        if ws is not None:
            calls[f"gluon {v}"] = lambda ws=ws: ws_gemm(a, b, **ws, **scales)
            continue
        bm, bn, stages, warps, group, one_a_tile, early = parse_variant(v)
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        programs = tiles if one_a_tile else min(tiles, sms)
        calls[f"gluon {v}"] = (lambda bm=bm, bn=bn, s=stages, w=warps, g=group, p=programs, e=early:
                               gluon_gemm(a, b, block_m=bm, block_n=bn, stages=s, num_warps=w, group_m=g,
                                          programs=p, early=bool(e), **scales))
    row.update(checked_rounds({name: (fn, ref) for name, fn in calls.items()}, timer, rounds))
    return row


def us(cell) -> float | None:
    return cell[0] if isinstance(cell, (tuple, list)) and cell[1] <= WRONG else None


def best_variant(row: dict, variants: list[str]) -> tuple[str | None, float | None]:
    timed = {v: us(row.get(f"gluon {v}")) for v in variants}
    timed = {v: t for v, t in timed.items() if t}
    if not timed:
        return None, None
    v = min(timed, key=timed.get)
    return v, timed[v]


def table(rows: list[dict], variants: list[str]) -> list[str]:
    lines = ["| kernel | N, K | M | cuBLAS µs | op µs | op, Triton rule µs | best Gluon µs | best variant | "
             "cuBLAS / op | cuBLAS / op, Triton rule | cuBLAS / Gluon | TFLOP/s |", "|---" * 12 + "|"]
    for r in rows:
        v, t = best_variant(r, variants)
        c, o, ot = us(r.get("cublas")), us(r.get("op")), us(r.get("op_triton"))
        fmt = lambda x: f"{x:.1f}" if x else "-"  # noqa: E731
        ratio = lambda p, x: f"{p / x:.2f}" if p and x else "-"  # noqa: E731
        lines.append(f"| {r['kernel']} | {r['N']}, {r['K']} | {r['M']} | {fmt(c)} | {fmt(o)} | {fmt(ot)} | {fmt(t)} | "
                     f"{v} | {ratio(c, o)} | {ratio(c, ot)} | {ratio(c, t)} | "
                     f"{r['flops'] / t / 1e6 if t else math.nan:.0f} |")
    for name in ("op", "op_triton", "best"):
        xs = []
        for r in rows:
            c = us(r.get("cublas"))
            x = us(r.get(name)) if name != "best" else best_variant(r, variants)[1]
            if c and x:
                xs.append(c / x)
        lines.append(f"cuBLAS / {name}: geomean {geomean(xs):.3f}, min {min(xs) if xs else math.nan:.2f}")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", choices=("bf16", "a8w8"), default="bf16")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated; '' for none")
    ap.add_argument("--iters", type=int, default=20)
    from probe_util import add_rounds_args, apply_rounds_args

    add_rounds_args(ap)
    ap.add_argument("--out", type=pathlib.Path)
    args = ap.parse_args(argv)
    apply_rounds_args(args)
    variants = [v for v in args.variants.split(",") if v]
    try:
        for v in variants:
            parse_variant(v)
    except ValueError as err:
        ap.error(str(err))
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        ap.error(f"unknown shape(s) {unknown}; expected some of {list(SHAPES)}")
    from tritune.kernels.gluon_gemm import HAS_GLUON_HOPPER

    if not HAS_GLUON_HOPPER or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        sys.exit("probe_gluon_gemm: needs a Hopper GPU and Triton's Gluon API")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    rows = []
    for shape in args.shapes.split(","):
        n, k = SHAPES[shape]
        for m in map(int, args.ms.split(",")):
            row = run_point(args.kernel, n, k, m, variants, args.iters, args.rounds)
            row["shape"] = shape
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                args.out.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))
    print("\n" + "\n".join(table(rows, variants)))


if __name__ == "__main__":
    main()
