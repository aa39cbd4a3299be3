r"""Which loads the MoE MLP's GEMMs should use on rows it padded per expert (ops/moe_mlp.py, issue 15).

When a GEMM's dW runs the scheduled loop, the MLP makes that dW's operand padded per expert where it is produced: the
gate_up forward then reads the tokens from padded rows instead of gathering them from the hidden states, and the
down dX reads dY from padded rows instead of gathering it from pair order. Contiguous rows per expert can go
through TMA, which the gathered ones could not; the tuned configs were chosen for the gather (pointer loads). This
times, in rounds interleaved on one GPU, each GEMM four ways: as the op runs it with its tuned config (the gather
fused or in torch), on the padded rows through TMA, on the padded rows through pointer loads, and on rows gathered
beforehand (grouped, unpadded) through TMA (the kernel alone, as `_grouped_mm` is timed); and the copies that
make the padded rows (`pad`: the tokens, and dY from dout scaled by the routing weights) beside torch's gather of
the same rows (index_select, no padding), the copy's bandwidth reference.

    PYTHONPATH=src python benchmarks/probe_padded_inputs.py --out $OUT/padded_inputs.json

Prints a JSON row per (model, tokens, GEMM) with the median of each way over the rounds, then a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import sys

import torch

from tritune.kernels import grouped_dw_scheduled as scheduled
from tritune.kernels.grouped_dw_scheduled import pad
from tritune.kernels.grouped_gemm import group_by_expert, grouped_gemm_dx, grouped_gemm_forward
from tritune.ops.grouped_gemm import reload_grouped_gemm_configs, run_dx, run_forward, select_configs
from tritune.ops.moe_mlp import config_reading_padded
from tritune.ops.routing import sample_routing

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from bench_grouped_gemm import MODELS, rel, timed  # noqa: E402


def ways(model: str, tokens: int) -> dict[str, dict[str, object]]:
    """{GEMM: {way: a call}} on one shape's random inputs (the gathered ways' outputs agree with the op's)."""
    experts, topk, hidden, inter = MODELS[model]
    pairs, dev, bf = tokens * topk, "cuda", torch.bfloat16
    tw, ids = sample_routing(tokens, experts, topk, seed=0, device=dev)
    m_sizes, gather = group_by_expert(ids, experts)
    x = torch.randn(tokens, hidden, device=dev, dtype=bf)
    w1 = torch.randn(experts, 2 * inter, hidden, device=dev, dtype=bf) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, device=dev, dtype=bf) * inter**-0.5
    dout = torch.randn(tokens, hidden, device=dev, dtype=bf)
    dy = (tw.reshape(-1, 1) * dout.float().repeat_interleave(topk, 0)).to(bf)  # the top-k sum's dY, pair order
    up, down = select_configs(tokens, w1, topk, True, False), select_configs(pairs, w2, topk, False, True)
    bm_up = up.dW.BLOCK_SIZE_M if up.dW.scheduled else 64
    bm_down = down.dW.BLOCK_SIZE_M if down.dW.scheduled else 64
    x_pad = pad(x, m_sizes, gather, topk, pairs, bm_up)
    dy_pad = pad(dout, m_sizes, gather, topk, pairs, bm_down, scale=tw)

    x_grouped, dy_grouped = x.index_select(0, gather.long() // topk), dy.index_select(0, gather.long())

    def fwd(tma: bool, padded: bool = True):
        cfg = dataclasses.replace(config_reading_padded(up.forward, "x"), use_tma_load_x=tma)
        rows, to = (x_pad, bm_up) if padded else (x_grouped, 0)
        return lambda: grouped_gemm_forward(rows, w1, m_sizes, cfg, topk=topk, gather_indices=gather,
                                            x_padded_to=to, pairs=pairs)

    def dx(tma: bool, padded: bool = True):
        cfg = dataclasses.replace(config_reading_padded(down.dX, "dy"), use_tma_load_dy=tma)
        rows, to = (dy_pad, bm_down) if padded else (dy_grouped, 0)
        return lambda: grouped_gemm_dx(rows, w2, m_sizes, cfg, topk=topk, gather_indices=gather,
                                       dy_padded_to=to, pairs=pairs)

    return {
        "gate_up.forward": {"op": lambda: run_forward(x, w1, m_sizes, gather, topk, True, False, up.forward),
                            "padded_tma": fwd(True), "padded_pointers": fwd(False), "grouped_tma": fwd(True, False),
                            "pad_copy": lambda: pad(x, m_sizes, gather, topk, pairs, bm_up),
                            "torch_gather": lambda: x.index_select(0, gather.long() // topk)},
        "down.dX": {"op": lambda: run_dx(dy, w2, m_sizes, gather, topk, False, True, down.dX),
                    "padded_tma": dx(True), "padded_pointers": dx(False), "grouped_tma": dx(True, False),
                    "pad_copy": lambda: pad(dout, m_sizes, gather, topk, pairs, bm_down, scale=tw),
                    "torch_gather": lambda: dy.index_select(0, gather.long())},
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--models", default="qwen3-30b-a3b,deepseek-v2-lite,mixtral-8x7b")
    p.add_argument("--seqlens", default="1024,8192")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pad-variants", default="", help="also time the padding copy with these ROWS:COLS, e.g. "
                                                      "8:256,32:256,16:512")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("probe_padded_inputs: needs a CUDA GPU (it times TMA loads)", file=sys.stderr)
        sys.exit(2)
    reload_grouped_gemm_configs()
    shipped = scheduled.PAD_ROWS, scheduled.PAD_COLS
    rows = []
    for model in args.models.split(","):
        for tokens in (int(s) for s in args.seqlens.split(",")):
            for gemm, calls in ways(model, tokens).items():
                want = calls["op"]()
                errors = {w: rel(f(), want) for w, f in calls.items() if w.startswith(("padded", "grouped"))}
                times: dict[str, list[float]] = {w: [] for w in calls}
                for _ in range(args.rounds):
                    for w, f in calls.items():
                        times[w].append(timed(f))
                    for rows_cols in args.pad_variants.split(",") if args.pad_variants else ():
                        scheduled.PAD_ROWS, scheduled.PAD_COLS = (int(v) for v in rows_cols.split(":"))
                        times.setdefault(f"pad_copy_{rows_cols}", []).append(timed(calls["pad_copy"]))
                    scheduled.PAD_ROWS, scheduled.PAD_COLS = shipped
                row = {"model": model, "tokens": tokens, "gemm": gemm, "rel_l2_vs_op": errors,
                       **{f"{w}_us": statistics.median(t) for w, t in times.items()}, "rounds": times}
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "rounds"}), flush=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    print("\nmodel | tokens | GEMM | op µs | padded TMA µs | padded pointers µs | grouped TMA µs | pad copy µs | "
          "torch gather µs")
    for r in rows:
        print(f"{r['model']} | {r['tokens']} | {r['gemm']} | {r['op_us']:.1f} | {r['padded_tma_us']:.1f} | "
              f"{r['padded_pointers_us']:.1f} | {r['grouped_tma_us']:.1f} | {r['pad_copy_us']:.1f} | "
              f"{r['torch_gather_us']:.1f}")


if __name__ == "__main__":
    main()
