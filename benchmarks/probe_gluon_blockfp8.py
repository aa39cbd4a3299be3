r"""The Gluon block-scaled fp8 GEMM (`kernels/gluon_blockscale.py`: block k-1's rescale while block k's MMA runs)
against row-wise `torch._scaled_mm` (cuBLAS), tritune's Triton block-scaled op and, where extracted, vLLM's Triton
block-fp8 kernel with its shipped H100 config (issue 15). Same fp8 values for all; each contestant checked against
the fp32 product of the values and scales it was given (relative L2 error), then timed with the engine's timer
(CUDA events, L2 flushed, median).

    PYTHONPATH=src python benchmarks/probe_gluon_blockfp8.py --out $OUT/gluon_blockfp8.json \
        [--shapes 1536,7168:24576,7168:1536,1536] [--ms 256,1024,2048,4096,8192] \
        [--variants 128:128:4:8:8,128:128:5:8:8] [--vendor-dir peers_vllm]

A variant is BM:BN:STAGES:WARPS:GROUP_M[:P], P 1 for the persistent grid (as many programs as fit at once), or
ws:BM:BN:STAGES:GROUP_M[:WARPS[:LOADER_REGS]] for the warp-specialised kernel (`kernels/gluon_gemm_ws.py`).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_blockfp8_vllm import nearest_config, vendor_file  # noqa: E402
from bench_gemm_gen2 import bf16_operands, fp8_operands  # noqa: E402
from probe_util import checked_rounds, parse_ws_variant  # noqa: E402

SHAPES = ((1536, 7168), (24576, 7168), (1536, 1536))
MS = (256, 1024, 2048, 4096, 8192)
VARIANTS = ("128:128:4:8:8", "128:128:5:8:8", "128:128:3:8:8")


def vllm_kernel(vendor_dir: pathlib.Path):
    """vLLM's `_w8a8_triton_block_scaled_mm` from the extracted peer folder, or None when it is not there."""
    path = vendor_dir / "vllm_block_fp8_kernel.py"
    if not path.exists():
        return None
    sys.path.insert(0, str(vendor_dir.resolve()))
    import vllm_block_fp8_kernel as mod

    return next(getattr(mod, n) for n in dir(mod) if n.endswith("block_scaled_mm") and not n.startswith("__"))


def run_point(n: int, k: int, m: int, variants: list[str], args, peer) -> dict:
    import triton

    from tritune.kernels.gluon_blockscale import gluon_blockscale_gemm
    from tritune.kernels.gluon_gemm_ws import ws_gemm
    from tritune.ops import gemm_a8w8_blockscale
    from tritune.tuning.bench import time_kernel

    f8 = fp8_operands(*bf16_operands(m, n, k))
    a8, sa8, b8, sb8 = f8.a8, f8.sa8, f8.b8, f8.sb8
    timer = lambda fn: time_kernel(fn, iters=args.iters, warmup=3).median_us  # noqa: E731
    row = {"N": n, "K": k, "M": m, "flops": 2.0 * m * n * k}
    calls = {"scaled_mm": (f8.scaled_mm, f8.ref_rows),
             "tritune": (lambda: gemm_a8w8_blockscale(a8, b8, sa8, sb8), f8.ref_blocks)}
    if peer is not None:
        path = vendor_file(args.vendor_dir, n, k)
        cfg = nearest_config(json.loads(path.read_text()), m) if path.exists() else None
        if cfg is not None:
            c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            grid = (triton.cdiv(m, cfg["BLOCK_SIZE_M"]) * triton.cdiv(n, cfg["BLOCK_SIZE_N"]),)

            def vllm():
                peer[grid](a8, b8, c, sa8, sb8, m, n, k, 128, 128, a8.stride(0), a8.stride(1), b8.stride(1),
                           b8.stride(0), c.stride(0), c.stride(1), sa8.stride(0), sa8.stride(1), sb8.stride(1),
                           sb8.stride(0), **cfg)
                return c

            calls["vllm"] = (vllm, f8.ref_blocks)
    for v in variants:
        ws = parse_ws_variant(v)
        if ws is not None:
            calls[f"gluon {v}"] = (lambda ws=ws: ws_gemm(a8, b8, a_scale=sa8, b_scale=sb8, block_scaled=True, **ws),
                                   f8.ref_blocks)
        else:
            bm, bn, stages, warps, group, persistent = (int(x) for x in (v + ":0").split(":")[:6])
            calls[f"gluon {v}"] = (lambda bm=bm, bn=bn, s=stages, w=warps, g=group, p=persistent: gluon_blockscale_gemm(
                a8, b8, sa8, sb8, block_m=bm, block_n=bn, stages=s, num_warps=w, group_m=g, persistent=bool(p)),
                f8.ref_blocks)
    row.update(checked_rounds(calls, timer, args.rounds))
    return row


def us(cell) -> float | None:
    return cell[0] if isinstance(cell, (tuple, list)) else None


def table(rows: list[dict], variants: list[str]) -> list[str]:
    names = ["scaled_mm", "tritune", "vllm"] + [f"gluon {v}" for v in variants]
    lines = ["| N, K | M | " + " | ".join(f"{n} µs" for n in names) + " | best gluon TFLOP/s | scaled_mm / best gluon "
             "| tritune / best gluon | vllm / best gluon |", "|" + "---|" * (len(names) + 6)]
    for r in rows:
        cells = []
        for name in names:
            c = r.get(name)
            if c is None:
                cells.append("-")
            elif isinstance(c, str):
                cells.append("error")
            else:
                cells.append(f"{c[0]:.1f}" + (" WRONG" if c[1] > 2e-2 else ""))
        g = [us(r.get(f"gluon {v}")) for v in variants]
        g = [x for x in g if x]
        best = min(g) if g else None
        lines.append(f"| {r['N']}, {r['K']} | {r['M']} | " + " | ".join(cells)
                     + (f" | {r['flops'] / best / 1e6:.0f} | " if best else " | - | "))
        lines[-1] += " | ".join(_ratio(r, k, best) for k in ("scaled_mm", "tritune", "vllm")) + " |"
    return lines


def _ratio(row: dict, name: str, best: float | None) -> str:
    return f"{us(row[name]) / best:.2f}" if best and us(row.get(name)) else "-"


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=":".join(f"{n},{k}" for n, k in SHAPES))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--vendor-dir", type=pathlib.Path, default=pathlib.Path("peers_vllm"))
    ap.add_argument("--iters", type=int, default=20)
    from probe_util import add_rounds_args, apply_rounds_args

    add_rounds_args(ap)
    ap.add_argument("--out", type=pathlib.Path)
    args = ap.parse_args(argv)
    apply_rounds_args(args)
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(":")]
    ms = [int(x) for x in args.ms.split(",")]
    variants = args.variants.split(",")
    for v in variants:
        try:
            ws = parse_ws_variant(v)
        except ValueError as err:
            ap.error(f"--variants: {err}")
        if ws is None and (len(v.split(":")) not in (5, 6) or not all(x.isdigit() for x in v.split(":"))):
            ap.error(f"--variants: {v!r} is not BM:BN:STAGES:WARPS:GROUP_M[:P] or ws:BM:BN:STAGES:GROUP_M")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    peer = vllm_kernel(args.vendor_dir)
    rows = []
    for n, k in shapes:
        for m in ms:
            row = run_point(n, k, m, variants, args, peer)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                args.out.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))
    print("\n" + "\n".join(table(rows, variants)))
    best = [min(us(r.get(f"gluon {v}")) or 1e30 for v in variants) for r in rows]
    for name in ("scaled_mm", "tritune", "vllm"):
        pairs = [(r, us(r.get(name)) / b) for r, b in zip(rows, best, strict=True) if us(r.get(name)) and b < 1e30]
        ratios, big = [x for _, x in pairs], [x for r, x in pairs if r["M"] >= 1024]
        print(f"{name} / best gluon: geomean {geomean(ratios):.3f}, from M 1024 {geomean(big):.3f}")


if __name__ == "__main__":
    main()
