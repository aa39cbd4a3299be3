"""Whether the swapped MXFP4 stage 1 loses time to a part-full last wave (issue 16): `moe_stage1` alone (the rule
table's tile, weights and scales prepared, its K32 copy of hidden included) at one token count with exactly X experts
routed, X stepping across wave boundaries. A tail would show as a step in µs per expert where the programs pass a
multiple of the GPU's slots; a line means a fixed cost per call plus a cost per expert.

    PYTHONPATH=src python benchmarks/probe_mxfp4_grid_tail.py [--experts 14,15,29,30,...] [--json F]   # GPU
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))

MODEL_DIM = INTER = 2880  # gpt-oss-120b
EXPERTS, TOKENS, TOPK = 128, 16, 4
COPY_BYTES_PER_S = 3.0e12
EXPERT_COUNTS = (14, 15, 29, 30, 43, 44, 45, 47, 58, 59, 60)  # either side of 1, 2, 3 and 4 waves of 660 slots


def round_robin_ids(pool: torch.Tensor, tokens: int, topk: int) -> torch.Tensor:
    """ids [tokens, topk] covering every expert of `pool` (len >= topk), slot s of token t on pool[(t·topk + s) %
    len]: a token's experts distinct, each expert 1 or 2 more pairs than any other at most."""
    flat = torch.arange(tokens * topk, device=pool.device) % pool.numel()
    return pool[flat].reshape(tokens, topk).int()


def floor_us(experts: int) -> float:
    return experts * 2 * INTER * MODEL_DIM * 4.25 / 8 / COPY_BYTES_PER_S * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", default=",".join(map(str, EXPERT_COUNTS)))
    ap.add_argument("--json", type=pathlib.Path, default=None)
    args = ap.parse_args(argv)
    counts = [int(x) for x in args.experts.split(",")]
    if any(not TOPK <= x <= TOKENS * TOPK for x in counts):
        raise SystemExit(f"probe_mxfp4_grid_tail: --experts each in [{TOPK}, {TOKENS * TOPK}], got {args.experts}")
    if not torch.cuda.is_available():
        raise SystemExit("probe_mxfp4_grid_tail: needs a GPU (it times the stage kernel)")
    from tritune import ops
    from tritune.kernels import fused_moe as fm
    from tritune.kernels.moe_align import moe_align_block_size
    from tritune.ops.heuristics import moe_heuristic
    from tritune.tuning.bench import time_kernel

    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(EXPERTS, 2 * INTER, MODEL_DIM, device="cuda", generator=g) / MODEL_DIM**0.5
    q1, s1 = fm.quantize_weights(w, fm.MXFP4)
    del w
    w1, p1 = ops.prepare_mxfp4_weights(q1), ops.prepare_mxfp4_scales(s1)
    _, cfg, _ = moe_heuristic(TOKENS, MODEL_DIM, INTER, EXPERTS, TOPK, fm.MXFP4)
    rows = []
    print(f"{cfg.name('stage1', fm.MXFP4)}\n| experts | programs | µs | x floor |\n|---|---|---|---|")
    for x in counts:
        ids = round_robin_ids(torch.randperm(EXPERTS, device="cuda", generator=g)[:x], TOKENS, TOPK)
        weights = torch.rand(TOKENS, TOPK, device="cuda", generator=g)
        hidden = torch.randn(TOKENS, MODEL_DIM, device="cuda", generator=g).bfloat16()
        sorting = moe_align_block_size(ids, cfg.BLOCK_SIZE_M, EXPERTS)

        def call(hidden=hidden, weights=weights, sorting=sorting):
            return fm.moe_stage1(hidden, w1, weights, sorting, cfg, inter_dim=INTER, w1_scale=p1, quant=fm.MXFP4)

        us = min(time_kernel(call, iters=30, warmup=3).median_us for _ in range(3))
        programs = x * -(-INTER // cfg.BLOCK_SIZE_N)
        rows.append({"experts": x, "programs": programs, "us": us, "floor_us": floor_us(x)})
        print(f"| {x} | {programs} | {us:.1f} | {us / floor_us(x):.2f} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "config": cfg.name("stage1", fm.MXFP4),
                                         "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
