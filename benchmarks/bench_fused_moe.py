"""Fused MoE on the GPU: tuned tritune vs a torch loop over experts, torch._grouped_mm, tritune's untuned default
and the floor max(FLOPs / measured matmul peak, routed weight bytes / measured copy bandwidth).

    PYTHONPATH=src python benchmarks/bench_fused_moe.py --out benchmarks/results/bench_fused_moe_h100_DATE.json

Every contestant is checked against the fp32 reference (relative L2 error printed) before it is timed; timings are
medians of CUDA-event runs with the L2 flushed between runs (tritune.tuning.bench.time_kernel).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math

import torch
import torch.nn.functional as F

from tritune.device import current_device
from tritune.kernels import fused_moe as fm
from tritune.kernels.moe_reference import fused_moe_reference
from tritune.ops import fused_moe as fused_moe_op
from tritune.ops.fused_moe import fused_moe_choice, heuristic_moe_choice
from tritune.ops.routing import sample_routing
from tritune.tuning.bench import time_kernel

D, INTER, E, TOPK = 4096, 14336, 8, 2  # Mixtral-8x7B's MoE: the first row of examples/untuned_fmoe.csv
TOKENS = (1, 8, 32, 128, 512, 1024, 4096, 8192)


def timed(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return time_kernel(fn, iters=30, warmup=5, flush_l2=True, l2_bytes=64 * 2**20).median_us


def peaks() -> dict[str, float]:
    """Measured ceilings of this GPU: bf16 and fp8 matmul TFLOP/s, copy bandwidth in TB/s."""
    n = 8192
    a, b = torch.randn(n, n, device="cuda").bfloat16(), torch.randn(n, n, device="cuda").bfloat16()
    bf16 = 2 * n**3 / timed(lambda: a @ b) / 1e6
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).T
    one = torch.ones((), device="cuda")
    fp8 = 2 * n**3 / timed(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16)) / 1e6
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    copy = 2 * x.numel() / timed(lambda: y.copy_(x)) / 1e6
    return {"bf16_tflops": bf16, "fp8_tflops": fp8, "copy_tbps": copy}


def torch_loop(h, w1, w2, tw, ti):
    """The plain torch MoE: per expert, gather its tokens, two matmuls, weighted scatter-add (host sync per expert)."""
    out = torch.zeros(h.shape, device=h.device, dtype=torch.float32)
    for e in range(w1.shape[0]):
        tok, slot = (ti == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        y = h[tok] @ w1[e].T
        z = F.silu(y[:, :INTER]) * y[:, INTER:]
        out.index_add_(0, tok, (z @ w2[e].T).float() * tw[tok, slot, None])
    return out.to(h.dtype)


def grouped(h, w1, w2, tw, ti):
    """torch._grouped_mm contestants: the two GEMMs alone (as commonly quoted) and the whole op around them."""
    flat = ti.flatten()
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    xs = h[order // TOPK]
    w1t, w2t = w1.transpose(1, 2), w2.transpose(1, 2)
    zs = torch.randn(xs.shape[0], INTER, device=h.device).to(h.dtype)

    def gemms():
        torch._grouped_mm(xs, w1t, offs=offs)
        torch._grouped_mm(zs, w2t, offs=offs)

    def whole():
        o = torch.argsort(ti.flatten(), stable=True)
        of = torch.cumsum(torch.bincount(ti.flatten(), minlength=E), 0).to(torch.int32)
        y = torch._grouped_mm(h[o // TOPK], w1t, offs=of)
        z = torch._grouped_mm(F.silu(y[:, :INTER]) * y[:, INTER:], w2t, offs=of)
        out = torch.zeros(h.shape, device=h.device, dtype=torch.float32)
        out.index_add_(0, o // TOPK, z.float() * tw.flatten()[o, None])
        return out.to(h.dtype)

    return gemms, whole


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def bench(quant: str, tokens: int, pk: dict, gen: torch.Generator) -> dict:
    w1 = torch.randn(E, 2 * INTER, D, device="cuda", generator=gen) / math.sqrt(D)
    w2 = torch.randn(E, D, INTER, device="cuda", generator=gen) / math.sqrt(INTER)
    h = torch.randn(tokens, D, device="cuda", generator=gen).bfloat16()
    tw, ti = sample_routing(tokens, E, TOPK, seed=tokens, device="cuda")
    s1 = s2 = None
    if quant == "none":
        w1, w2 = w1.bfloat16(), w2.bfloat16()
        w1b, w2b = w1, w2
    else:
        w1b, w2b = w1.bfloat16(), w2.bfloat16()
        (w1, s1), (w2, s2) = fm.quantize_weights(w1, quant), fm.quantize_weights(w2, quant)
    kw = {"quant": quant, "w1_scale": s1, "w2_scale": s2}
    ref = fused_moe_reference(h, w1, w2, tw, ti, **kw)
    routed = torch.unique(ti).numel()
    flops = 2.0 * tokens * TOPK * 3 * D * INTER
    elt = 2 if quant == "none" else 1
    peak = pk["bf16_tflops"] if quant == "none" else pk["fp8_tflops"]
    floor_us = max(flops / peak / 1e6, routed * 3 * D * INTER * elt / pk["copy_tbps"] / 1e6)
    row = {"quant": quant, "tokens": tokens, "routed_experts": routed, "floor_us": floor_us}

    choice = fused_moe_choice(h, w1, w2, ti, quant=quant)
    row["tuned_source"] = choice.source
    tuned = lambda: fused_moe_op(h, w1, w2, tw, ti, **kw)  # noqa: E731
    heur = heuristic_moe_choice(tokens, D, INTER, E, TOPK, quant)
    default = lambda: fm.fused_moe_2stage(h, w1, w2, tw, ti, heur.stage1, heur.stage2, **kw)  # noqa: E731
    gemms, whole = grouped(h, w1b, w2b, tw, ti)
    contestants = {"tritune_tuned": tuned, "tritune_default": default, "grouped_mm_2gemms": gemms,
                   "grouped_mm_whole": whole}
    if tokens <= 1024:
        contestants["torch_loop"] = lambda: torch_loop(h, w1b, w2b, tw, ti)
    for name, fn in contestants.items():
        out = fn()
        if out is not None:
            # bf16 references for the torch contestants of fp8 rows differ by the fp8 rounding of the weights.
            row[f"{name}_rel_err"] = rel_err(out, ref)
        row[f"{name}_us"] = timed(fn)
    row["tuned_over_floor"] = row["tritune_tuned_us"] / floor_us
    row["grouped_mm_2gemms_over_tuned"] = row["grouped_mm_2gemms_us"] / row["tritune_tuned_us"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--quant", default="none", help="comma list of none, per_token, per_1x128")
    ap.add_argument("--fp8-tokens", default="1024", help="token counts for the fp8 rows")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = current_device()
    pk = peaks()
    print(f"{dev.name}  triton {dev.triton_version}  torch {dev.torch_version}  peaks {pk}", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for quant in args.quant.split(","):
        toks = args.tokens if quant == "none" else args.fp8_tokens
        for t in (int(x) for x in toks.split(",")):
            row = bench(quant, t, pk, gen)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'quant':<10}{'tokens':>7}{'floor':>8}{'tuned':>8}{'xfloor':>7}{'default':>8}{'gmm2':>8}{'gmm/t':>6}"
          f"{'gmmAll':>8}{'loop':>8}")
    for r in rows:
        loop = f"{r['torch_loop_us']:8.0f}" if "torch_loop_us" in r else f"{'-':>8}"
        print(f"{r['quant']:<10}{r['tokens']:>7}{r['floor_us']:8.0f}{r['tritune_tuned_us']:8.0f}"
              f"{r['tuned_over_floor']:7.2f}{r['tritune_default_us']:8.0f}{r['grouped_mm_2gemms_us']:8.0f}"
              f"{r['grouped_mm_2gemms_over_tuned']:6.2f}{r['grouped_mm_whole_us']:8.0f}{loop}")
    if args.out:
        doc = {"date": datetime.date.today().isoformat(), "device": dev.provenance(), "peaks": pk, "rows": rows,
               "command": "PYTHONPATH=src python benchmarks/bench_fused_moe.py " + " ".join(
                   f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None)}
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
