r"""Where one training step of the MoE MLP (forward + backward through autograd) spends its GPU time, kernel by
kernel, against the step's floor (issue 15: the step within 1.3x of its floor for Mixtral).

Why: the six grouped GEMMs of Mixtral's step sum to about 1.16x the floor, the whole step to 1.4x; the difference
is kernels that are not GEMMs (SwiGLU, permutes, the top-k sum and its gradient, routing) and gaps between
launches. This says which, before anything is fused.

    PYTHONPATH=src python benchmarks/profile_moe_mlp_step.py --out $OUT/mlp_step.json --model mixtral-8x7b

Prints the kernels of one step grouped by name (calls, total µs, share of the step's GPU time), the GPU-busy time,
the step's wall time and the floor.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
from bench_grouped_gemm import MODELS, peaks

from tritune.ops.moe_mlp import moe_mlp
from tritune.ops.routing import sample_routing


def kernel_table(events) -> dict[str, dict]:
    """{kernel name: {"calls", "us"}} for the CUDA kernels of a profile."""
    table: dict[str, dict] = defaultdict(lambda: {"calls": 0, "us": 0.0})
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA:
            row = table[e.name[:90]]
            row["calls"] += 1
            row["us"] += e.device_time
    return dict(table)


def gaps(events, top: int = 5) -> tuple[float, list[dict]]:
    """(GPU span in µs from the first kernel's start to the last one's end, the `top` longest idle gaps between
    consecutive kernels with the kernels on either side): busy time below the span is time the GPU waited."""
    kernels = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    if not kernels:
        return 0.0, []
    span = max(e.time_range.end for e in kernels) - kernels[0].time_range.start
    idle = [{"us": b.time_range.start - a.time_range.end, "after": a.name[:60], "before": b.name[:60]}
            for a, b in zip(kernels[:-1], kernels[1:], strict=True) if b.time_range.start > a.time_range.end]
    return span, sorted(idle, key=lambda g: -g["us"])[:top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="mixtral-8x7b", choices=sorted(MODELS))
    ap.add_argument("--seqlen", type=int, default=8192)
    args = ap.parse_args()
    experts, topk, hidden, inter = MODELS[args.model]
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16
    tw, ids = sample_routing(args.seqlen, experts, topk, seed=0, device="cuda")
    x = torch.randn(args.seqlen, hidden, device="cuda", dtype=bf, generator=g).requires_grad_()
    w1 = (torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=bf, generator=g) * hidden**-0.5).requires_grad_()
    w2 = (torch.randn(experts, hidden, inter, device="cuda", dtype=bf, generator=g) * inter**-0.5).requires_grad_()
    tw = tw.clone().requires_grad_()
    grad_out = torch.randn(args.seqlen, hidden, device="cuda", dtype=bf, generator=g)

    def step() -> None:
        for t in (x, w1, w2, tw):  # as a training step: no gradient left from the last one to accumulate into
            t.grad = None
        torch.autograd.backward(moe_mlp(x, w1, w2, tw, ids), grad_out)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(6)]
    marks[0].record()
    for i in range(5):
        step()
        marks[i + 1].record()
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    per_step = [a.elapsed_time(b) * 1e3 for a, b in zip(marks[:-1], marks[1:], strict=True)]
    wall_us = sum(per_step) / 5
    # cudaMalloc / cudaFree inside the timed steps (the caching allocator going to the driver) stall the host
    allocator = {k: after.get(k, 0) - before.get(k, 0) for k in ("num_device_alloc", "num_device_free",
                                                                 "num_alloc_retries", "num_sync_all_streams")}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    table = kernel_table(prof.events())
    busy = sum(r["us"] for r in table.values())
    span, idle = gaps(prof.events())
    peak = peaks()["bf16_tflops"]  # measured here, as bench_grouped_gemm's floors
    floor = 18 * args.seqlen * topk * hidden * inter / peak / 1e6
    doc = {"model": args.model, "seqlen": args.seqlen, "step_us": wall_us, "gpu_busy_us": busy, "floor_us": floor,
           "bf16_tflops": peak, "kernels": table, "gpu_span_us": span, "longest_gaps": idle,
           "per_step_us": per_step, "allocator_during_timed_steps": allocator,
           "peak_allocated_gb": torch.cuda.max_memory_allocated() / 2**30}
    with open(args.out, "w") as fh:
        json.dump(doc, fh, indent=1)
    print("| kernel | calls | µs | share of GPU-busy |\n|---|---|---|---|")
    for name, r in sorted(table.items(), key=lambda kv: -kv[1]["us"]):
        print(f"| {name} | {r['calls']} | {r['us']:.1f} | {r['us'] / busy:.3f} |")
    print(f"timed steps (µs): {', '.join(f'{t:.0f}' for t in per_step)}; allocator during them: {allocator}; "
          f"peak allocated {doc['peak_allocated_gb']:.1f} GiB")
    print(f"profiled step's GPU span {span:.1f} µs, busy {busy:.1f}; longest gaps: "
          + "; ".join(f"{g['us']:.1f} µs after {g['after']} before {g['before']}" for g in idle))
    print(f"step {wall_us:.1f} µs (GPU busy {busy:.1f}); floor {floor:.1f} µs at {peak:.0f} TFLOP/s: "
          f"step {wall_us / floor:.2f}x, busy {busy / floor:.2f}x")


if __name__ == "__main__":
    main()
