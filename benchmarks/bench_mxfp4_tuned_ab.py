"""The tuned MXFP4 op (weights and scales prepared once: `prepare_mxfp4_weights`, `prepare_mxfp4_scales`) against the
tuned bf16 op on the same weights, in alternating rounds on one GPU (issue 16's "x faster than bf16" and "x the
floor"): each op looks its row up in the given tuned CSVs, as users' calls do. GPU time per call, L2 flushed
(`time_kernel`), median of each op's round medians; with --graph also each op captured once in a CUDA graph and
its replay timed the same way (what serving engines that capture decode steps get). The floor is the routed experts'
MXFP4 bytes (values and scales) and the activations at the measured copy bandwidth.

--rotate N also times each op over N copies of its weights, a call's copy the next in turn and no flush: the weights
come from DRAM as a model's layers do (each layer its own weights), with no dirty lines in L2. The flush zeroes a
buffer of 4× the L2, so every call first writes back up to an L2 of dirty lines, about 50 MB on the H100: as much
as MXFP4's bytes at 1 token, and a quarter of bf16's (RESULTS.md, twenty-second session).

    PYTHONPATH=src python benchmarks/bench_mxfp4_tuned_ab.py --mxfp4-csv M.csv --bf16-csv B.csv \\
        [--dims 2880,2880,128,4] [--tokens 1,16,64] [--rounds 3] [--graph] [--rotate 4] [--json F]   # GPU
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
from dataclasses import dataclass

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))

COPY_BYTES_PER_S = 3.0e12  # the H100's measured copy bandwidth, as the other benchmarks
BITS_PER_WEIGHT = 4.25  # e2m1 codes and one e8m0 scale per 32


def floor_us(routed: int, tokens: int, d: int, inter: int) -> float:
    weights = routed * 3 * d * inter * BITS_PER_WEIGHT / 8
    return (weights + 2 * tokens * d * 2) / COPY_BYTES_PER_S * 1e6


@dataclass(frozen=True)
class Mxfp4Moe:
    """A seeded random MoE's MXFP4 weights as the op's users hold them: the packed codes (q1, q2: what choices are
    looked up on), the prepared weights (w1, w2) and scales (s1, s2), and the bf16 weights they came from when
    asked (bf16, else None)."""

    q1: torch.Tensor
    q2: torch.Tensor
    w1: object  # Mxfp4Weights
    w2: object
    s1: object  # Mxfp4Scales
    s2: object
    bf16: tuple[torch.Tensor, torch.Tensor] | None


def mxfp4_moe(d: int, inter: int, experts: int, g: torch.Generator, bf16: bool = False) -> Mxfp4Moe:
    """gated w1 [E, 2I, D] and w2 [E, D, I] ~ N(0, 1/K) on the GPU from `g`, quantized to MXFP4 and prepared."""
    from tritune import ops
    from tritune.kernels import fused_moe as fm

    w1 = torch.randn(experts, 2 * inter, d, device="cuda", generator=g) / d**0.5
    w2 = torch.randn(experts, d, inter, device="cuda", generator=g) / inter**0.5
    (q1, s1), (q2, s2) = fm.quantize_weights(w1, fm.MXFP4), fm.quantize_weights(w2, fm.MXFP4)
    kept = (w1.bfloat16(), w2.bfloat16()) if bf16 else None
    del w1, w2
    return Mxfp4Moe(q1, q2, ops.prepare_mxfp4_weights(q1), ops.prepare_mxfp4_weights(q2),
                    ops.prepare_mxfp4_scales(s1), ops.prepare_mxfp4_scales(s2), kept)


def rotated_copies(moe: Mxfp4Moe, n: int) -> list[dict]:
    """`n` copies (0: none) of the MoE's prepared MXFP4 weights and scales and its bf16 weights, the first the MoE's
    own: the same values at other addresses, so a call that takes the next copy reads its weights from DRAM."""
    from tritune.kernels.mxfp4_records import Mxfp4Scales
    from tritune.kernels.mxfp4_swizzle import Mxfp4Weights

    if n == 0:
        return []
    own = {"w1": moe.w1, "w2": moe.w2, "s1": moe.s1, "s2": moe.s2, "b1": moe.bf16[0], "b2": moe.bf16[1]}
    out = [own]
    for _ in range(n - 1):
        out.append({"w1": Mxfp4Weights(moe.w1.tiles.clone(), moe.w1.rows, moe.w1.half_k),
                    "w2": Mxfp4Weights(moe.w2.tiles.clone(), moe.w2.rows, moe.w2.half_k),
                    "s1": Mxfp4Scales(moe.s1.codes.clone(), moe.s1.records.clone()),
                    "s2": Mxfp4Scales(moe.s2.codes.clone(), moe.s2.records.clone()),
                    "b1": moe.bf16[0].clone(), "b2": moe.bf16[1].clone()})
    return out


def parse_dims(text: str) -> tuple[int, int, int, int]:
    parts = text.split(",")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: want D,I,E,TOPK (positive integers)")
    d, i, e, k = map(int, parts)
    return d, i, e, k


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mxfp4-csv", type=pathlib.Path, required=True)
    ap.add_argument("--bf16-csv", type=pathlib.Path, required=True)
    ap.add_argument("--dims", type=parse_dims, default=(2880, 2880, 128, 4), help="D,I,E,TOPK (gpt-oss-120b)")
    ap.add_argument("--tokens", default="1,16,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--graph", action="store_true", help="also time each op's CUDA-graph replay")
    ap.add_argument("--rotate", type=int, default=0, help="also time each op over N weight copies, no flush")
    ap.add_argument("--json", type=pathlib.Path, default=None)
    args = ap.parse_args(argv)
    if args.rotate == 1 or args.rotate < 0:
        raise SystemExit(f"bench_mxfp4_tuned_ab: --rotate {args.rotate}: want 0 (off) or at least 2 copies")
    if not torch.cuda.is_available():
        raise SystemExit("bench_mxfp4_tuned_ab: needs a GPU (it times the tuned ops)")
    for path in (args.mxfp4_csv, args.bf16_csv):
        if not path.is_file():
            raise SystemExit(f"bench_mxfp4_tuned_ab: no such file: {path}")
    os.environ["TRITUNE_CONFIG_FMOE"] = f"{args.mxfp4_csv}:{args.bf16_csv}"
    from tritune import ops
    from tritune.kernels import fused_moe as fm
    from tritune.tuning.bench import capture_graph, time_kernel

    d, inter, experts, topk = args.dims
    g = torch.Generator(device="cuda").manual_seed(0)
    moe = mxfp4_moe(d, inter, experts, g, bf16=True)
    q1, q2, pw1, pw2, ps1, ps2 = moe.q1, moe.q2, moe.w1, moe.w2, moe.s1, moe.s2
    b1, b2 = moe.bf16
    copies = rotated_copies(moe, args.rotate)
    rows = []
    print("| tokens | MXFP4 µs | bf16 µs | bf16 / MXFP4 | MXFP4 x floor | MXFP4 row | bf16 row |")
    print("|---|---|---|---|---|---|---|")
    for tokens in (int(t) for t in args.tokens.split(",")):
        hidden = torch.randn(tokens, d, device="cuda", generator=g).bfloat16()
        weights, ids = ops.sample_routing(tokens, experts, topk, seed=1234, device=torch.device("cuda"))
        calls = {"mxfp4": lambda h=hidden, w=weights, i=ids: ops.fused_moe_mxfp4(h, pw1, pw2, w, i, ps1, ps2),
                 "bf16": lambda h=hidden, w=weights, i=ids: ops.fused_moe(h, b1, b2, w, i)}
        sources = {"mxfp4": ops.fused_moe_choice(hidden, q1, q2, ids, quant=fm.MXFP4).source,
                   "bf16": ops.fused_moe_choice(hidden, b1, b2, ids).source}
        if copies:  # each call the next copy's weights (same values, other addresses)
            turn = {"mxfp4": 0, "bf16": 0}

            def rotating(name, h=hidden, w=weights, i=ids, turn=turn):
                c = copies[turn[name] % len(copies)]
                turn[name] += 1
                if name == "mxfp4":
                    return ops.fused_moe_mxfp4(h, c["w1"], c["w2"], w, i, c["s1"], c["s2"])
                return ops.fused_moe(h, c["b1"], c["b2"], w, i)

            for name in ("mxfp4", "bf16"):
                for _ in copies:  # each copy's plan bound before timing
                    rotating(name)
        if args.graph:  # each op's call captured once (after its eager calls bound the launches)
            for name in list(calls):
                calls[name]()
                graph, _ = capture_graph(calls[name])
                calls[f"{name} graph"] = graph.replay
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, fn in calls.items():
                times[name].append(time_kernel(fn, iters=30, warmup=3).median_us)
            for name in ("mxfp4", "bf16") if copies else ():
                times.setdefault(f"{name} rotated", []).append(
                    time_kernel(lambda n=name: rotating(n), iters=30, warmup=3, flush_l2=False).median_us)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        floor = floor_us(int(torch.unique(ids).numel()), tokens, d, inter)
        rows.append({"tokens": tokens, "us": med, "rounds": times, "floor_us": floor, "sources": sources})
        graphs = f" (graph {med['mxfp4 graph']:.1f} / {med['bf16 graph']:.1f})" if args.graph else ""
        if copies:
            graphs += (f" (rotated {med['mxfp4 rotated']:.1f} / {med['bf16 rotated']:.1f} µs: "
                       f"{med['bf16 rotated'] / med['mxfp4 rotated']:.3f}, {med['mxfp4 rotated'] / floor:.2f}x floor)")
        print(f"| {tokens} | {med['mxfp4']:.1f} | {med['bf16']:.1f} | {med['bf16'] / med['mxfp4']:.3f}{graphs} | "
              f"{med['mxfp4'] / floor:.2f} | {sources['mxfp4']} | {sources['bf16']} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "dims": args.dims, "rows": rows},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
