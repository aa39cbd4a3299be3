"""Why one fused-MoE op call can take longer replayed from a CUDA graph than called eagerly: the tuner measured the
MXFP4 op on gpt-oss-120b 13-16% slower as a graph at 64-256 tokens (919.8 against 792.8 us at 64, seventeenth
session) while bf16's matched. This times both ways with the engine's timers, then lists every kernel of one eager
call and of one graph replay with its GPU duration (torch.profiler, CUPTI), each after an L2 flush, so the kernel
that differs is named.

    PYTHONPATH=src python benchmarks/probe_moe_graph_gap.py --quant per_1x32 --tokens 64 --out $OUT/gap.json   # GPU
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))

SHAPE = (2880, 2880, 128, 4)  # gpt-oss-120b: model_dim, inter_dim, experts, topk


def kernel_times(run, flush, rounds: int) -> dict[str, float]:
    """Mean µs per round of each kernel name over `rounds` runs of `run`, each after `flush` (not counted)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(rounds):
            flush()
            run()
        torch.cuda.synchronize()
    totals: dict[str, float] = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and "zero" not in event.name.lower() \
                and "fill" not in event.name.lower():
            totals[event.name[:60]] += getattr(event, "device_time", 0.0) / rounds
    return dict(totals)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quant", default="per_1x32", help="none or per_1x32")
    ap.add_argument("--tokens", default="64")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out", type=pathlib.Path, required=True)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_moe_graph_gap: needs a GPU")
    from tritune import ops
    from tritune.kernels.fused_moe import quantize_weights
    from tritune.ops.routing import sample_routing
    from tritune.tuning.bench import capture_graph, time_graph, time_kernel

    d, inter, experts, topk = SHAPE
    gen = torch.Generator(device="cuda").manual_seed(0)
    w1 = torch.randn(experts, 2 * inter, d, generator=gen, device="cuda") / d**0.5
    w2 = torch.randn(experts, d, inter, generator=gen, device="cuda") / inter**0.5
    if args.quant == "none":
        (w1, s1), (w2, s2) = (w1.bfloat16(), None), (w2.bfloat16(), None)
    else:
        (w1, s1), (w2, s2) = quantize_weights(w1, args.quant), quantize_weights(w2, args.quant)
    flush_buf = torch.empty(200 * 2**20, dtype=torch.uint8, device="cuda")
    rows = []
    for t in (int(x) for x in args.tokens.split(",")):
        hidden = torch.randn(t, d, generator=gen, device="cuda").bfloat16()
        tw, ti = sample_routing(t, experts, topk, seed=t, device=torch.device("cuda"))

        def call(hidden=hidden, tw=tw, ti=ti):
            return ops.fused_moe(hidden, w1, w2, tw, ti, quant=args.quant, w1_scale=s1, w2_scale=s2)

        eager = time_kernel(call, iters=30, warmup=3).median_us
        graph_t = time_graph(call, iters=30, warmup=3).median_us
        graph, _ = capture_graph(call, 2)
        per_eager = kernel_times(call, flush_buf.zero_, args.rounds)
        per_graph = kernel_times(graph.replay, flush_buf.zero_, args.rounds)
        graph.reset()
        row = {"quant": args.quant, "tokens": t, "eager_us": eager, "graph_us": graph_t,
               "kernels_eager_us": per_eager, "kernels_graph_us": per_graph}
        rows.append(row)
        print(f"\n{args.quant} {t} tokens: eager {eager:.1f} us, graph {graph_t:.1f} us")
        for name in sorted(set(per_eager) | set(per_graph)):
            print(f"  {name:60s} eager {per_eager.get(name, 0.0):8.1f}  graph {per_graph.get(name, 0.0):8.1f}")
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
