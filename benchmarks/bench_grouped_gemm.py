"""Grouped GEMM for MoE training on the GPU: each kernel (forward, dX, dW of gate_up and down), the forward and
backward passes, and the whole MoE MLP step, for tritune (tuned configs from the store, else the heuristic) vs
torch._grouped_mm (bare, and with the permutes the MoE needs) vs a torch loop over experts, against the floor.

    PYTHONPATH=src python benchmarks/bench_grouped_gemm.py --out benchmarks/results/bench_grouped_gemm_h100_DATE.json

Every tritune kernel is checked against torch._grouped_mm (relative L2) before timing; times are medians of
CUDA-event runs with the L2 flushed before each (tritune.tuning.bench.time_kernel). Floor = max(FLOPs / measured
bf16 matmul peak, bytes / measured copy bandwidth).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os

import torch
import torch.nn.functional as F

# probe_util: a sibling module (the script's folder is on the path)
from probe_util import add_rounds_args, apply_rounds_args, timed_rounds

from tritune.device import current_device
from tritune.kernels.grouped_dw_scheduled import pad
from tritune.kernels.grouped_gemm import group_by_expert
from tritune.kernels.grouped_gemm_config import KernelConfigBackward_dW
from tritune.knobs import MOE_MLP_LAYOUT
from tritune.ops.grouped_gemm import reload_grouped_gemm_configs, run_dw, run_dx, run_forward, select_configs
from tritune.ops.moe_mlp import dw_on_padded, dx_on_padded, forward_on_padded, moe_mlp
from tritune.ops.routing import sample_routing
from tritune.tuning.bench import time_kernel

MODELS = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336),  # E, topk, hidden, inter
          "deepseek-v2-lite": (64, 6, 2048, 1408)}


def timed(fn, iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    return time_kernel(fn, iters=iters, warmup=3, flush_l2=True, l2_bytes=64 * 2**20).median_us


def peaks() -> dict[str, float]:
    n = 8192
    a, b = torch.randn(n, n, device="cuda").bfloat16(), torch.randn(n, n, device="cuda").bfloat16()
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return {"bf16_tflops": 2 * n**3 / timed(lambda: a @ b) / 1e6,
            "copy_tbps": 2 * x.numel() / timed(lambda: y.copy_(x)) / 1e6}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def torch_loop_mlp(x, w1, w2, tw, ids):
    """The plain torch MoE MLP: per expert gather, two matmuls, SwiGLU, weighted index_add (autograd by torch)."""
    out = torch.zeros(x.shape, device=x.device, dtype=torch.float32)
    inter = w2.shape[2]
    for e in range(w1.shape[0]):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        h = x[tok] @ w1[e].T
        a = F.silu(h[:, :inter]) * h[:, inter:]
        out = out.index_add(0, tok, (a @ w2[e].T).float() * tw[tok, slot, None])
    return out.to(x.dtype)


def grouped_mm_mlp(x, w1, w2, tw, ids, m_sizes, gather):
    """The same MLP on torch._grouped_mm with torch's permutes (index_select / index_copy) and torch autograd."""
    topk, inter = ids.shape[1], w2.shape[2]
    offs = torch.cumsum(m_sizes, 0).to(torch.int32)
    g = gather.long()
    h = torch._grouped_mm(x.index_select(0, g // topk), w1.transpose(1, 2), offs=offs)
    a = F.silu(h[:, :inter]) * h[:, inter:]
    y = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)
    y = torch.empty_like(y).index_copy(0, g, y)
    return (y.view(x.shape[0], topk, -1) * tw.to(y.dtype).unsqueeze(-1)).sum(1)


@contextlib.contextmanager
def layout_env(layout: str):
    """TRITUNE_MOE_MLP_LAYOUT set for the block (the MLP reads it per call), restored after."""
    before = os.environ.get(MOE_MLP_LAYOUT)
    os.environ[MOE_MLP_LAYOUT] = layout
    try:
        yield
    finally:
        if before is None:
            del os.environ[MOE_MLP_LAYOUT]
        else:
            os.environ[MOE_MLP_LAYOUT] = before


def bench_shape(model: str, seqlen: int, pk: dict, loop: bool, dw_override: dict | None = None,
                mlp_only: bool = False, rounds: int = 1) -> dict:
    num_experts, topk, hidden, inter = MODELS[model]
    tokens, pairs = seqlen, seqlen * topk
    dev, bf = "cuda", torch.bfloat16
    tw, ids = sample_routing(tokens, num_experts, topk, seed=0, device=dev)
    m_sizes, gather = group_by_expert(ids, num_experts)
    g = gather.long()
    offs = torch.cumsum(m_sizes, 0).to(torch.int32)
    x = torch.randn(tokens, hidden, device=dev, dtype=bf)
    w1 = torch.randn(num_experts, 2 * inter, hidden, device=dev, dtype=bf) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, device=dev, dtype=bf) * inter**-0.5
    a = torch.randn(pairs, inter, device=dev, dtype=bf)
    dh = torch.randn(pairs, 2 * inter, device=dev, dtype=bf)  # grouped
    dy = torch.randn(pairs, hidden, device=dev, dtype=bf)  # pair order
    up, down = select_configs(tokens, w1, topk, True, False), select_configs(pairs, w2, topk, False, True)
    if dw_override:  # --dw: every dW (and the MLP step's) through the given config
        forced = KernelConfigBackward_dW.from_dict(dw_override)
        up, down = (dataclasses.replace(c, dW=forced, origins=(*c.origins[:2], "--dw")) for c in (up, down))
    ref_x = x.index_select(0, g // topk)
    ref_dy = dy.index_select(0, g)  # bare `_grouped_mm` takes grouped rows: gathered once, outside every timing
    gmm = torch._grouped_mm
    kernels = {  # name: (flops, bytes, tritune, grouped_mm bare, grouped_mm with the MoE's permute, compare)
        "gate_up.forward": (2 * pairs * hidden * 2 * inter, 2 * (tokens * hidden + w1.numel() + pairs * 2 * inter),
                            lambda: run_forward(x, w1, m_sizes, gather, topk, True, False, up.forward),
                            lambda: gmm(ref_x, w1.transpose(1, 2), offs=offs),
                            lambda: gmm(x.index_select(0, g // topk), w1.transpose(1, 2), offs=offs), None),
        "gate_up.dX": (2 * pairs * hidden * 2 * inter, 2 * (pairs * 2 * inter + w1.numel() + pairs * hidden),
                       lambda: run_dx(dh, w1, m_sizes, gather, topk, True, False, up.dX),
                       lambda: gmm(dh, w1, offs=offs),
                       lambda: torch.empty(pairs, hidden, device=dev, dtype=bf).index_copy_(
                           0, g, gmm(dh, w1, offs=offs)),
                       lambda t: t[g]),
        "gate_up.dW": (2 * pairs * hidden * 2 * inter, 2 * (tokens * hidden + pairs * 2 * inter + w1.numel()),
                       lambda: run_dw(x, dh, m_sizes, gather, topk, True, False, up.dW),
                       lambda: gmm(dh.t(), ref_x, offs=offs),
                       lambda: gmm(dh.t(), x.index_select(0, g // topk), offs=offs), None),
        "down.forward": (2 * pairs * hidden * inter, 2 * (pairs * inter + w2.numel() + pairs * hidden),
                         lambda: run_forward(a, w2, m_sizes, gather, topk, False, True, down.forward),
                         lambda: gmm(a, w2.transpose(1, 2), offs=offs),
                         lambda: torch.empty(pairs, hidden, device=dev, dtype=bf).index_copy_(
                             0, g, gmm(a, w2.transpose(1, 2), offs=offs)), lambda t: t[g]),
        "down.dX": (2 * pairs * hidden * inter, 2 * (pairs * hidden + w2.numel() + pairs * inter),
                    lambda: run_dx(dy, w2, m_sizes, gather, topk, False, True, down.dX),
                    lambda: gmm(ref_dy, w2, offs=offs),
                    lambda: gmm(dy.index_select(0, g), w2, offs=offs), None),
        "down.dW": (2 * pairs * hidden * inter, 2 * (pairs * inter + pairs * hidden + w2.numel()),
                    lambda: run_dw(a, dy, m_sizes, gather, topk, False, True, down.dW),
                    lambda: gmm(ref_dy.t(), a, offs=offs),
                    lambda: gmm(dy.index_select(0, g).t(), a, offs=offs), None),
    }
    # dW's kernel alone on the rows `_grouped_mm` is given (pre-gathered): the op gathers with torch first when its
    # config does not fuse the permute, so the op's time above includes that gather and the bare comparison is this
    kernel_only = {"gate_up.dW": lambda: run_dw(ref_x, dh, m_sizes, gather, topk, False, False, up.dW),
                   "down.dW": lambda: run_dw(a, ref_dy, m_sizes, gather, topk, False, False, down.dW)}
    # The GEMMs whose input the MLP produces padded per expert when their dW is scheduled (ops/moe_mlp.py), timed on
    # those rows as the MLP runs them: the padded copies are made once, outside every timing, like `_grouped_mm`'s.
    mlp_layout = {}
    if up.dW.scheduled:
        bm_up = up.dW.BLOCK_SIZE_M
        x_pad = pad(x, m_sizes, gather, topk, pairs, bm_up)
        mlp_layout["gate_up.forward"] = lambda: forward_on_padded(x_pad, w1, m_sizes, gather, topk, up.forward,
                                                                  bm_up)
        mlp_layout["gate_up.dW"] = lambda: dw_on_padded(x_pad, dh, m_sizes, gather, topk, up.dW, "x")
    if down.dW.scheduled:
        bm_down = down.dW.BLOCK_SIZE_M
        dy_pad = pad(dy, m_sizes, gather, 1, pairs, bm_down)
        mlp_layout["down.dX"] = lambda: dx_on_padded(dy_pad, w2, m_sizes, gather, topk, down.dX, bm_down)
        mlp_layout["down.dW"] = lambda: dw_on_padded(a, dy_pad, m_sizes, gather, topk, down.dW, "dy")
    rows = {}
    for name, (flops, nbytes, ours, bare, permuted, view) in ({} if mlp_only else kernels).items():
        out, ref = ours(), bare()
        err = rel(view(out) if view else out, ref)
        floor = max(flops / pk["bf16_tflops"] / 1e6, nbytes / pk["copy_tbps"] / 1e6)
        fns = {"us": ours, "grouped_mm_us": bare, "grouped_mm_permuted_us": permuted}
        if name in kernel_only:
            fns["kernel_only_us"] = kernel_only[name]
        if name in mlp_layout:
            fns["mlp_layout_us"] = mlp_layout[name]
        t = timed_rounds(fns, timed, max(1, rounds))  # probe_util's: interleaved rounds, their median
        rows[name] = {**t, "floor_us": floor, "of_floor": t["us"] / floor, "tflops": flops / t["us"] / 1e6,
                      "rel_l2_vs_grouped_mm": err}
        if name in kernel_only:
            rows[name]["kernel_only_rel_l2"] = rel(kernel_only[name](), ref)
        if name in mlp_layout:
            rows[name]["mlp_layout_rel_l2"] = rel(mlp_layout[name](), ref)
    origins = {"gate_up": up.origins, "down": down.origins}

    # The whole MLP step (forward + backward through autograd) for the three implementations.
    w1p, w2p = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    xp, twp = x.clone().requires_grad_(), tw.clone().requires_grad_()
    grad_out = torch.randn(tokens, hidden, device=dev, dtype=bf)

    def step(fn):
        def run():
            for t in (xp, w1p, w2p, twp):  # a training step starts with no gradients (zero_grad(set_to_none=True));
                t.grad = None              # accumulating into the last step's would time a full-size add per weight
            out = fn(xp, w1p, w2p, twp)
            torch.autograd.backward(out, grad_out)
        return run

    configs = {"gate_up_configs": up, "down_configs": down} if dw_override else {}
    ours_fwd = lambda: moe_mlp(x, w1, w2, tw, ids, **configs)  # noqa: E731
    gmm_fwd = lambda: grouped_mm_mlp(x, w1, w2, tw, ids, m_sizes, gather)  # noqa: E731
    mlp_flops = 18 * pairs * hidden * inter
    mlp = {"floor_us": mlp_flops / pk["bf16_tflops"] / 1e6, "flops": mlp_flops,
           "fwd_us": timed(ours_fwd), "grouped_mm_fwd_us": timed(gmm_fwd),
           "step_us": timed(step(lambda *t: moe_mlp(*t, ids, **configs)), iters=10),
           "rel_l2_fwd_vs_grouped_mm": rel(ours_fwd(), gmm_fwd())}
    try:
        mlp["grouped_mm_step_us"] = timed(step(lambda *t: grouped_mm_mlp(*t, ids, m_sizes, gather)), iters=10)
    except RuntimeError as exc:  # _grouped_mm without autograd support in this torch
        mlp["grouped_mm_step_us"] = None
        mlp["grouped_mm_step_error"] = str(exc)[:200]
    if loop:
        mlp["torch_loop_step_us"] = timed(step(lambda *t: torch_loop_mlp(*t, ids)), iters=5)
    if up.dW.scheduled or down.dW.scheduled:  # A/B in one process: the dW loop copying its operand instead
        with layout_env("plain"):
            mlp["step_plain_layout_us"] = timed(step(lambda *t: moe_mlp(*t, ids, **configs)), iters=10)
        mlp["step_padded_again_us"] = timed(step(lambda *t: moe_mlp(*t, ids, **configs)), iters=10)
    mlp["step_of_floor"] = mlp["step_us"] / mlp["floor_us"]
    return {"model": model, "seqlen": seqlen, "kernels": rows, "mlp": mlp, "config_origins": origins}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--seqlens", default="1024,8192")
    p.add_argument("--no-loop", action="store_true", help="skip the torch loop baseline")
    p.add_argument("--mlp-only", action="store_true", help="time the MLP forward and step only, no GEMM table")
    add_rounds_args(p, "each GEMM's contestants")
    p.add_argument("--dw", help="run every dW with this config instead of the op's choice: JSON of "
                                "KernelConfigBackward_dW fields, e.g. the scheduled loop's")
    args = p.parse_args()
    apply_rounds_args(args)
    dw_override = None
    if args.dw:  # a bad field stops here, before any GPU work
        try:
            dw_override = KernelConfigBackward_dW.from_dict(json.loads(args.dw)).to_dict()
        except ValueError as exc:
            p.error(f"--dw: {exc}")
    reload_grouped_gemm_configs()
    info = current_device()
    pk = peaks()
    results = []
    for model in args.models.split(","):
        for seqlen in (int(s) for s in args.seqlens.split(",")):
            r = bench_shape(model, seqlen, pk, loop=not args.no_loop, dw_override=dw_override,
                            mlp_only=args.mlp_only, rounds=args.rounds)
            results.append(r)
            k = r["kernels"]
            print(f"\n{model} seqlen {seqlen}  (configs: {r['config_origins']})")
            print(f"{'kernel':16s} {'tritune':>9s} {'gmm':>9s} {'gmm+perm':>9s} {'floor':>8s} {'x floor':>7s} "
                  f"{'vs gmm+perm':>11s} {'err':>8s}")
            for name, v in k.items():
                print(f"{name:16s} {v['us']:9.1f} {v['grouped_mm_us']:9.1f} {v['grouped_mm_permuted_us']:9.1f} "
                      f"{v['floor_us']:8.1f} {v['of_floor']:7.2f} {v['grouped_mm_permuted_us'] / v['us']:11.2f} "
                      f"{v['rel_l2_vs_grouped_mm']:8.1e}")
                if "mlp_layout_us" in v:
                    laid = v["mlp_layout_us"]
                    print(f"{'  MLP layout':16s} {laid:9.1f}: {v['grouped_mm_us'] / laid:.2f}x bare grouped_mm "
                          f"(input padded per expert as the MLP makes it; err {v['mlp_layout_rel_l2']:.1e})")
                if "kernel_only_us" in v:
                    alone = v["kernel_only_us"]
                    print(f"{'  kernel alone':16s} {alone:9.1f}: {v['grouped_mm_us'] / alone:.2f}x "
                          f"bare grouped_mm (rows pre-gathered for both; err {v['kernel_only_rel_l2']:.1e})")
            fwd = ("gate_up.forward", "down.forward")
            bwd = ("gate_up.dX", "gate_up.dW", "down.dX", "down.dW")
            for label, names in (() if args.mlp_only else (("forward GEMMs", fwd), ("backward GEMMs", bwd))):
                ours = sum(k[n]["us"] for n in names)
                print(f"{label:16s} {ours:9.1f} vs grouped_mm {sum(k[n]['grouped_mm_us'] for n in names):9.1f} "
                      f"(+perm {sum(k[n]['grouped_mm_permuted_us'] for n in names):9.1f}): "
                      f"{sum(k[n]['grouped_mm_permuted_us'] for n in names) / ours:.2f}x with permutes, "
                      f"{sum(k[n]['grouped_mm_us'] for n in names) / ours:.2f}x bare")
            m = r["mlp"]
            print(f"MLP step {m['step_us']:.1f} us = {m['step_of_floor']:.2f}x floor {m['floor_us']:.1f}; "
                  f"grouped_mm step {m['grouped_mm_step_us']}; loop {m.get('torch_loop_step_us')}; "
                  f"fwd {m['fwd_us']:.1f} vs grouped_mm fwd {m['grouped_mm_fwd_us']:.1f}", flush=True)
            if "step_plain_layout_us" in m:
                print(f"MLP step, layouts A/B: padded {m['step_us']:.1f} / plain {m['step_plain_layout_us']:.1f} / "
                      f"padded again {m['step_padded_again_us']:.1f} us", flush=True)
    doc = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "device": info.provenance(), "peaks": pk, "dw_override": dw_override, "results": results}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
