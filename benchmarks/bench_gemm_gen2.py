r"""GEMM generation 2 (issue 15): kernel variants against cuBLAS on (N, K) pairs nobody tuned for us, before any of
them enters the tuner's search space.

Six (N, K) from real models outside examples/ (three with N not a power of two), M in 256, 1024, 4096, 8192. Per
point, on the same seeded inputs: cuBLAS (`torch.matmul` for bf16; `torch._scaled_mm` row-wise for fp8, the issue's
yardstick for the block-scaled kernel), the op's own untuned choice, and fixed variants of the persistent TMA kernel
(tile, warp specialisation, epilogue sub-tiling, the scale pipeline) and of the pointer kernel. Each is checked
against a float32 product first (for fp8, of the fp8 values and scales that contestant was given; relative L2 error
above 2e-2 flagged WRONG), then timed: median of --iters calls, L2 flushed (tritune.tuning.bench.time_kernel).
The best variant per point bounds what tuning over these variants can reach.

    PYTHONPATH=src python benchmarks/bench_gemm_gen2.py --out $OUT/gemm_gen2.json [--kernels bf16,a8w8_blockscale]

Prints a markdown table last: per point cuBLAS µs, the op's choice, the best variant and its name, cuBLAS / best.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import pathlib
import sys
import time

import torch

SHAPES = {  # name -> (N, K): none is in examples/gemm_shapes.csv
    "llama3-8b-qkv": (6144, 4096),
    "qwen2.5-7b-qkv": (4608, 3584),
    "qwen2.5-7b-gate-up": (37888, 3584),
    "qwen2.5-7b-down": (3584, 18944),
    "deepseek-v3-q-a": (1536, 7168),
    "llama3-70b-tp4-gate-up": (14336, 8192),
}
MS = (256, 1024, 4096, 8192)
WRONG = 2e-2


def variants(kernel: str) -> dict[str, object]:
    """name -> GemmConfig of the fixed variants measured for `kernel` ("bf16" or "a8w8_blockscale")."""
    from tritune.kernels.gemm import GemmConfig

    tma = dict(PERSISTENT_TMA=True, GROUP_SIZE_M=8)
    if kernel == "bf16":
        base = {"tma 128x256x64 w8 s3": GemmConfig(128, 256, 64, num_warps=8, num_stages=3, **tma),
                "tma 128x128x64 w8 s4": GemmConfig(128, 128, 64, num_warps=8, num_stages=4, **tma),
                "tma 128x128x64 w4 s4": GemmConfig(128, 128, 64, num_warps=4, num_stages=4, **tma),
                "ptr 128x256x64 w8 s3": GemmConfig(128, 256, 64, GROUP_SIZE_M=8, num_warps=8, num_stages=3),
                "ptr 128x128x64 w8 s4": GemmConfig(128, 128, 64, GROUP_SIZE_M=8, num_warps=8, num_stages=4),
                # Smaller tiles and split-K: at M 256-1024 a 128x128 grid leaves its last wave mostly empty (N 4608,
                # M 1024: 288 tiles on 132 SMs, 2.18 waves); 2026-11-26 ran 0.58-0.87x cuBLAS there.
                "tma 128x64x64 w4 s4": GemmConfig(128, 64, 64, num_warps=4, num_stages=4, **tma),
                "ptr 64x128x64 w4 s4": GemmConfig(64, 128, 64, GROUP_SIZE_M=8, num_warps=4, num_stages=4),
                "ptr 128x128x64 w8 s4 split2": GemmConfig(128, 128, 64, GROUP_SIZE_M=8, num_warps=8, num_stages=4,
                                                          NUM_KSPLIT=2),
                # only the tiles past the full waves split in 4 (TAIL_SPLIT): the last wave filled, the rest whole
                "ptr 128x128x64 w8 s4 tail4": GemmConfig(128, 128, 64, GROUP_SIZE_M=8, num_warps=8, num_stages=4,
                                                         NUM_KSPLIT=4, TAIL_SPLIT=True),
                "ptr 128x256x64 w8 s3 tail4": GemmConfig(128, 256, 64, GROUP_SIZE_M=8, num_warps=8, num_stages=3,
                                                         NUM_KSPLIT=4, TAIL_SPLIT=True)}
    else:
        base = {"tma 128x128x128 w8 s3 pipe": GemmConfig(128, 128, 128, num_warps=8, num_stages=3,
                                                          SCALE_PIPELINE=True, **tma),
                "tma 128x128x128 w8 s4": GemmConfig(128, 128, 128, num_warps=8, num_stages=4, **tma),
                "tma 128x256x128 w8 s3": GemmConfig(128, 256, 128, num_warps=8, num_stages=3, **tma),
                "tma 64x128x128 w4 s4": GemmConfig(64, 128, 128, num_warps=4, num_stages=4, **tma),
                "ptr 128x128x128 w8 s3": GemmConfig(128, 128, 128, GROUP_SIZE_M=8, num_warps=8, num_stages=3)}
    out = dict(base)
    for name, cfg in base.items():
        if not cfg.PERSISTENT_TMA:
            continue
        # Warp specialisation only where it measured a gain (block-scaled; bf16 gave 1.00-1.11x the time)
        ws = kernel != "bf16" and not cfg.SCALE_PIPELINE
        if ws:
            out[f"{name} ws"] = dataclasses.replace(cfg, WARP_SPECIALIZE=True)
        out[f"{name} sub"] = dataclasses.replace(cfg, EPILOGUE_SUBTILE=True)
        if ws:
            out[f"{name} ws sub"] = dataclasses.replace(cfg, WARP_SPECIALIZE=True, EPILOGUE_SUBTILE=True)
    return out


def geomean(values: list[float]) -> float:
    values = [v for v in values if v > 0 and math.isfinite(v)]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else math.nan


def bf16_operands(m: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded A [M, K] and B [N, K] on the GPU, bf16, B scaled so C stays near unit size."""
    gen = torch.Generator(device="cuda").manual_seed(m * 7 + n + k)
    a = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    b = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).bfloat16()
    return a, b


@dataclasses.dataclass(frozen=True)
class Fp8Operands:
    """The fp8 values of A and B two ways: with row-wise scales (`_scaled_mm`'s) and with 1×128 / 128×128 block scales
    (the block-scaled kernels'), each with the fp32 product of the values it holds: fp8 rounding alone is ~3.7% off
    the bf16 product, so each contestant is checked against its own."""

    qa: torch.Tensor
    sa: torch.Tensor
    qb: torch.Tensor
    sb: torch.Tensor
    a8: torch.Tensor
    sa8: torch.Tensor
    b8: torch.Tensor
    sb8: torch.Tensor
    ref_rows: torch.Tensor
    ref_blocks: torch.Tensor

    def scaled_mm(self) -> torch.Tensor:
        """cuBLAS on the row-wise operands."""
        return torch._scaled_mm(self.qa, self.qb.T, scale_a=self.sa[:, None], scale_b=self.sb[None, :],
                                out_dtype=torch.bfloat16)


def fp8_operands(a: torch.Tensor, b: torch.Tensor) -> Fp8Operands:
    from tritune.kernels.quant import quantize_blocks, quantize_rows

    k, n = a.shape[1], b.shape[0]
    qa, sa = quantize_rows(a)
    qb, sb = quantize_rows(b)
    a8, sa8 = quantize_blocks(a.float(), 1)
    b8, sb8 = quantize_blocks(b.float(), 128)
    ref_rows = (qa.float() * sa[:, None]) @ (qb.float() * sb[:, None]).T
    ref_blocks = (a8.float() * sa8.repeat_interleave(128, 1)[:, :k]) @ \
        (b8.float() * sb8.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]).T
    return Fp8Operands(qa, sa, qb, sb, a8, sa8, b8, sb8, ref_rows, ref_blocks)


def run_point(kernel: str, n: int, k: int, m: int, iters: int, rounds: int = 1) -> dict:
    """Every contestant at one (M, N, K): rel error against cuBLAS, then median µs over `rounds` interleaved rounds
    (`probe_util.checked_rounds`; errors recorded, not raised)."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    from probe_util import checked_rounds

    from tritune.ops import gemm, gemm_a8w8_blockscale
    from tritune.tuning.bench import time_kernel

    a, b = bf16_operands(m, n, k)
    if kernel == "bf16":
        def peer():
            return a @ b.T

        def ours(cfg=None):
            return gemm(a, b, config=cfg)

        ref = peer_ref = a.float() @ b.float().T
    else:  # the same fp8 values for both: row-wise scales for cuBLAS, 1x128 / 128x128 for ours
        f8 = fp8_operands(a, b)
        peer = f8.scaled_mm

        def ours(cfg=None):
            return gemm_a8w8_blockscale(f8.a8, f8.b8, f8.sa8, f8.sb8, config=cfg)

        ref, peer_ref = f8.ref_blocks, f8.ref_rows
    row = {"kernel": kernel, "M": m, "N": n, "K": k, "flops": 2.0 * m * n * k}
    from tritune.ops.gemm import select_config

    # where the op's config came from: "heuristic", or a tuned file (TRITUNE_CONFIG_DIR) and its M bucket
    row["op_config"], row["op_source"] = (str(x) for x in select_config(kernel, m, n, k, a.device))

    calls = {"cublas": (peer, peer_ref), "op": (ours, ref)}
    calls |= {name: (lambda c=cfg: ours(c), ref) for name, cfg in variants(kernel).items()}
    timer = lambda fn: time_kernel(fn, iters=iters, warmup=3).median_us  # noqa: E731
    for name, got in checked_rounds(calls, timer, rounds).items():
        if isinstance(got, str):  # a variant the compiler refuses is a result
            row[f"{name}_error"] = got[:300]
        else:
            row[f"{name}_us"], row[f"{name}_rel_err"] = got
    timed = {name: row[f"{name}_us"] for name in variants(kernel)
             if f"{name}_us" in row and row.get(f"{name}_rel_err", 1.0) <= WRONG}
    if timed:
        row["best"] = min(timed, key=timed.get)
        row["best_us"] = timed[row["best"]]
    return row


def _ratio(peer: float | None, x: float | None) -> str:
    return f"{peer / x:.2f}" if peer and x else "-"


def table(rows: list[dict]) -> list[str]:
    lines = ["| kernel | shape | M | cuBLAS µs | op µs (cuBLAS/op) | best variant µs (cuBLAS/best) | best | TFLOP/s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        peer, op, best = r.get("cublas_us"), r.get("op_us"), r.get("best_us")
        nan = float("nan")
        lines.append(f"| {r['kernel']} | {r['shape']} | {r['M']} | {peer or nan:.1f} | "
                     f"{op or nan:.1f} ({_ratio(peer, op)}) | {best or nan:.1f} ({_ratio(peer, best)}) | "
                     f"{r.get('best', '-')} | {r['flops'] / (best or math.inf) / 1e6:.0f} |")
    for kernel in sorted({r["kernel"] for r in rows}):
        mine = [r for r in rows if r["kernel"] == kernel and r.get("cublas_us")]
        best = geomean([r["cublas_us"] / r["best_us"] for r in mine if r.get("best_us")])
        op = geomean([r["cublas_us"] / r["op_us"] for r in mine if r.get("op_us")])
        lines.append(f"\n{kernel}: cuBLAS / best variant geomean {best:.3f}, cuBLAS / op geomean {op:.3f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--kernels", default="bf16,a8w8_blockscale")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--iters", type=int, default=20, help="timed calls a contestant and round (median)")
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # probe_util, a sibling
    from probe_util import add_rounds_args, apply_rounds_args

    add_rounds_args(ap)
    ap.add_argument("--time-limit", type=float, default=540.0, help="start no point after this many seconds")
    args = ap.parse_args(argv)
    apply_rounds_args(args)
    if not torch.cuda.is_available():
        print("bench_gemm_gen2: needs a GPU (the interpreter tests cover the kernels' correctness)", file=sys.stderr)
        return 2
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        ap.error(f"unknown shape(s) {unknown}; expected some of {list(SHAPES)}")
    import triton

    start = time.perf_counter()
    doc = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "device": torch.cuda.get_device_name(),
           "triton": triton.__version__, "torch": torch.__version__, "command": " ".join(sys.argv), "rows": [],
           "skipped": []}
    for kernel in args.kernels.split(","):
        for shape in args.shapes.split(","):
            n, k = SHAPES[shape]
            for m in map(int, args.ms.split(",")):
                if time.perf_counter() - start > args.time_limit:
                    doc["skipped"].append([kernel, shape, m])
                    continue
                row = {"shape": shape, **run_point(kernel, n, k, m, args.iters, args.rounds)}
                doc["rows"].append(row)
                print(json.dumps({key: row[key] for key in ("kernel", "shape", "M", "cublas_us", "op_us", "best",
                                                             "best_us") if key in row}), flush=True)
                args.out.write_text(json.dumps(doc, indent=1))
    print("\n".join(table(doc["rows"])))
    if doc["skipped"]:
        print(f"skipped past --time-limit: {doc['skipped']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
