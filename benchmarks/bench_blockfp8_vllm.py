r"""Block-scaled fp8 GEMM (1×128 activation scales, 128×128 weight scales) against its two yardsticks (issue 15):
`torch._scaled_mm` with row-wise scales (cuBLAS; the 0.9× target from M 1024) and vLLM's Triton kernel
(`_w8a8_triton_block_scaled_mm`) with the config vLLM ships for the H100 (the 1.3× target at every M).

vLLM's kernel and configs come from a git-ignored folder made by ../shared/peers/extract_vllm.py (carry it to the
GPU); its config is the shipped entry whose M key is nearest the call's M, as vLLM looks it up. tritune is the op as
a user calls it (`ops.gemm_a8w8_blockscale`: a tuned file where TRITUNE_CONFIG_DIR has one, else the rule table).
Each contestant is checked against the fp32 product of the fp8 values and scales it was given, then timed with the
engine's timer (CUDA events, L2 flushed, median).

    PYTHONPATH=src python benchmarks/bench_blockfp8_vllm.py --vendor-dir peers_vllm --out $OUT/blockfp8.json \
        [--shapes 1536,7168:24576,7168:1536,1536] [--ms 256,1024,2048,4096,8192]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_gemm_gen2 import bf16_operands, fp8_operands, geomean  # noqa: E402

SHAPES = ((1536, 7168), (24576, 7168), (1536, 1536))  # (N, K) vLLM ships H100 configs for (DeepSeek-V3's)
MS = (256, 1024, 2048, 4096, 8192)
WRONG = 2e-2


def nearest_config(configs: dict[str, dict], m: int) -> dict:
    """vLLM's lookup: the shipped entry whose integer key is nearest `m` (the smaller key on a tie)."""
    return configs[str(min((int(k) for k in configs), key=lambda x: (abs(x - m), x)))]


def vendor_file(vendor_dir: pathlib.Path, n: int, k: int) -> pathlib.Path:
    return vendor_dir / "fp8_configs" / (f"N={n},K={k},device_name=NVIDIA_H100_80GB_HBM3,dtype=fp8_w8a8,"
                                         "block_shape=[128,128].json")


def run_point(kernel, n: int, k: int, m: int, vllm_cfg: dict, iters: int, rounds: int = 1) -> dict:
    import triton

    from tritune.ops import gemm_a8w8_blockscale
    from tritune.ops.gemm import select_config
    from tritune.tuning.bench import time_kernel

    f8 = fp8_operands(*bf16_operands(m, n, k))
    a8, sa8, b8, sb8 = f8.a8, f8.sa8, f8.b8, f8.sb8
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    grid = (triton.cdiv(m, vllm_cfg["BLOCK_SIZE_M"]) * triton.cdiv(n, vllm_cfg["BLOCK_SIZE_N"]),)

    def vllm():
        kernel[grid](a8, b8, c, sa8, sb8, m, n, k, 128, 128, a8.stride(0), a8.stride(1), b8.stride(1), b8.stride(0),
                     c.stride(0), c.stride(1), sa8.stride(0), sa8.stride(1), sb8.stride(1), sb8.stride(0),
                     **vllm_cfg)
        return c

    contestants = {
        "scaled_mm": (f8.scaled_mm, f8.ref_rows),
        "vllm": (vllm, f8.ref_blocks),
        "tritune": (lambda: gemm_a8w8_blockscale(a8, b8, sa8, sb8), f8.ref_blocks),
    }
    cfg, source = select_config("a8w8_blockscale", m, n, k, a8.device)
    row = {"N": n, "K": k, "M": m, "flops": 2.0 * m * n * k, "vllm_config": vllm_cfg, "tritune_config": str(cfg),
           "tritune_source": source}
    for name, (fn, ref) in contestants.items():
        out = fn().float()
        row[f"{name}_rel_err"] = float((out - ref).norm() / ref.norm())
    from bench_runtime import eager_and_graph  # the op as a user calls it: back to back (host included), as a graph
    from probe_util import timed_rounds

    us = timed_rounds({name: fn for name, (fn, _) in contestants.items()},
                      lambda fn: time_kernel(fn, iters=iters, warmup=3).median_us, rounds)
    row.update({f"{name}_us": t for name, t in us.items()})

    row.update({f"tritune_{k}": v for k, v in eager_and_graph([contestants["tritune"][0]]).items()})
    return row


def table(rows: list[dict]) -> list[str]:
    lines = ["| N, K | M | _scaled_mm µs | vLLM µs | tritune µs | tritune TFLOP/s | scaled_mm / tritune | "
             "vLLM / tritune | tritune eager / graph µs | errors over 2e-2 |", "|" + "---|" * 10]
    for r in rows:
        wrong = [n for n in ("scaled_mm", "vllm", "tritune") if r[f"{n}_rel_err"] > WRONG]
        lines.append(f"| {r['N']}, {r['K']} | {r['M']} | {r['scaled_mm_us']:.1f} | {r['vllm_us']:.1f} | "
                     f"{r['tritune_us']:.1f} | {r['flops'] / r['tritune_us'] / 1e6:.0f} | "
                     f"{r['scaled_mm_us'] / r['tritune_us']:.2f} | {r['vllm_us'] / r['tritune_us']:.2f} | "
                     f"{r.get('tritune_eager_us', float('nan')):.1f} / {r.get('tritune_graph_us', float('nan')):.1f} | "
                     f"{', '.join(wrong) or '-'} |")
    big = [r["scaled_mm_us"] / r["tritune_us"] for r in rows if r["M"] >= 1024]
    lines.append(f"\nscaled_mm / tritune geomean from M 1024: {geomean(big):.3f}; vLLM / tritune geomean "
                 f"{geomean([r['vllm_us'] / r['tritune_us'] for r in rows]):.3f}, lowest "
                 f"{min(r['vllm_us'] / r['tritune_us'] for r in rows):.2f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vendor-dir", type=pathlib.Path, required=True)
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--shapes", default=":".join(f"{n},{k}" for n, k in SHAPES))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--iters", type=int, default=30, help="timed calls a contestant and round (median)")
    from probe_util import add_rounds_args, apply_rounds_args

    add_rounds_args(ap)
    args = ap.parse_args(argv)
    apply_rounds_args(args)
    shapes = [tuple(map(int, s.split(","))) for s in args.shapes.split(":")]
    for n, k in shapes:
        if not vendor_file(args.vendor_dir, n, k).is_file():
            print(f"bench_blockfp8_vllm: no vLLM H100 config {vendor_file(args.vendor_dir, n, k)}", file=sys.stderr)
            return 2
    if not torch.cuda.is_available():
        print("bench_blockfp8_vllm: needs a GPU", file=sys.stderr)
        return 2
    spec = importlib.util.spec_from_file_location("vllm_block_fp8_kernel",
                                                  args.vendor_dir / "vllm_block_fp8_kernel.py")
    vendor = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vendor)
    rows = []
    for n, k in shapes:
        configs = json.loads(vendor_file(args.vendor_dir, n, k).read_text())
        for m in map(int, args.ms.split(",")):
            row = run_point(vendor._w8a8_triton_block_scaled_mm, n, k, m, nearest_config(configs, m), args.iters,
                            args.rounds)
            print(json.dumps({key: row[key] for key in ("N", "K", "M", "scaled_mm_us", "vllm_us", "tritune_us")}),
                  flush=True)
            rows.append(row)
    doc = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": __import__("triton").__version__, "command": " ".join(sys.argv), "rows": rows}
    args.out.write_text(json.dumps(doc, indent=1))
    print("\n".join(table(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
