"""The routing sort's two paths against each other (kernels/expert_grouping.py): every chunk reading all chunks'
counts (two launches, reads growing with the square of the chunk count) against a per-expert scan launch first
(three launches, linear). Where they cross is where SCAN_FROM_COUNTS belongs. torch's stable argsort, which the
sort replaced, runs beside them. Each result is checked against `group_by_expert_reference` before it is timed.

    PYTHONPATH=src python benchmarks/probe_expert_grouping.py [--chunks 64,128,...] [--experts 8,64,128]

GPU time: median of the engine's timer (CUDA events; L2 not flushed, as in the MoE op where the ids were just
written). Prints one markdown table, last.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import torch

from tritune.kernels.expert_grouping import CHUNK, SCAN_FROM_COUNTS, group_by_expert_triton
from tritune.kernels.grouped_gemm import group_by_expert_reference
from tritune.ops.routing import sample_routing
from tritune.tuning.bench import time_kernel

TOPK = {8: 2, 64: 6, 128: 8, 256: 8}  # experts -> a model's top-k at that count


def measure(experts: int, chunks: int, iters: int) -> dict:
    topk = TOPK.get(experts, 8)
    tokens = chunks * CHUNK // topk
    _, ids = sample_routing(tokens, experts, topk, seed=chunks, device="cuda")
    ref = group_by_expert_reference(ids, experts)
    row = {"experts": experts, "topk": topk, "tokens": tokens, "chunks": -(-tokens * topk // CHUNK)}
    paths = {"two_launch": lambda: group_by_expert_triton(ids, experts, scan_from_chunks=1 << 30),
             "scan": lambda: group_by_expert_triton(ids, experts, scan_from_chunks=1),
             "argsort": lambda: torch.sort(ids.reshape(-1), stable=True)}
    for name, fn in paths.items():
        if name != "argsort":
            got = fn()
            row[f"{name}_exact"] = all(torch.equal(g.long(), r.long()) for g, r in zip(got, ref, strict=True))
        row[f"{name}_us"] = round(time_kernel(fn, iters=iters, warmup=3, flush_l2=False).median_us, 2)
    return row


def main() -> None:
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=ints, default=[64, 128, 256, 512, 1024, 2048])
    ap.add_argument("--experts", type=ints, default=[8, 64, 128])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", type=pathlib.Path, help="JSON of the rows")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probe_expert_grouping: needs a CUDA GPU (this times kernels)")
    rows = [measure(e, c, args.iters) for e in args.experts for c in args.chunks]
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    print(f"SCAN_FROM_COUNTS now {SCAN_FROM_COUNTS} (chunks × experts); µs, GPU time")
    print("| experts | topk | tokens | chunks | two launches | scan | argsort | exact |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['experts']} | {r['topk']} | {r['tokens']} | {r['chunks']} | {r['two_launch_us']} | "
              f"{r['scan_us']} | {r['argsort_us']} | {r['two_launch_exact'] and r['scan_exact']} |")


if __name__ == "__main__":
    main()
