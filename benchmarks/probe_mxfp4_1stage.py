"""MXFP4 at decode sizes in one GEMM launch: the swapped 1-stage kernel (`_moe_1stage_swap_kernel`: both GEMMs of a
block's BLOCK_N slice of the intermediate in one program) against the op's stage pair, on one GPU.

Each token count: the op as users call it (prepared weights and scales; its tuned row from --mxfp4-csv, else the rule
table), the rule table's stage pair (what the op ran before the 1-stage kernel joined the rule), then the op forced
onto each swapped 1-stage config of a small sweep, each checked against the op's output (relative L2) and timed with
the engine's timer (L2 flushed, median); the best one's kernels under torch.profiler and its CUDA-graph replay beside
the op's.

    PYTHONPATH=src python benchmarks/probe_mxfp4_1stage.py [--mxfp4-csv M] [--dims 2880,2880,128,4] \\
        [--tokens 1,2,4,8] [--tiles BM:BN:BD:W:S:ST,...] [--maxnreg auto,0,80] [--trace] \\
        [--no-profile] [--park] [--json F]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from bench_mxfp4_tuned_ab import floor_us, mxfp4_moe, parse_dims  # noqa: E402

# BLOCK_M:BLOCK_N:BLOCK_D:num_warps:num_stages:SCALE_TMA[:KSPLIT], comma-separated: w1's slice rows, w2's tile rows
# (each at most 16 rows a warp), stage 1's K splits (default 1).
TILES = "16:128:128:8:3:1,16:128:128:8:4:1,16:128:64:8:3:1,16:64:64:4:3:1,16:64:128:8:3:1"


def sweep(tiles: str) -> list:
    from tritune.kernels.fused_moe import MoeConfig

    out = []
    for spec in tiles.split(","):
        bm, bn, bd, warps, stages, st, *split = (int(v) for v in spec.split(":"))
        out.append(MoeConfig(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=128, BLOCK_SIZE_D=bd, GROUP_SIZE_M=1,
                             num_warps=warps, num_stages=stages, KSPLIT=split[0] if split else 1, SWAP_AB=1,
                             USE_TMA=1, SCALE_TMA=st))
    return out


def traced(call, op_module, f1) -> dict:
    """One call of `call` with the swapped 1-stage kernel's phase stamps (kernels/fused_moe_1stage.py TRACE), L2
    flushed before it: per phase the median / 90th percentile / max over programs (µs), when the programs start and
    end against the first one's entry, and the programs per SM. Printed, and returned with the raw stamps."""
    f1.TRACE = True
    op_module._PLANS.clear()
    call()
    plan = next(p for p in op_module._PLANS.values() if p.trace_piece is not None)
    stamps = plan.trace_stamps()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    stamps.zero_()
    flush.zero_()
    call()
    torch.cuda.synchronize()
    st = stamps.cpu()
    st = st[st[:, 4] > 0]  # programs that ran to the end (blocks past the sort's count return early)
    t0 = st[:, 0].min()
    us = lambda x: (x.double() / 1000.0)  # noqa: E731 (globaltimer ns -> µs)
    phases = {"wait for sort": st[:, 7] - st[:, 0], "work item": st[:, 1] - st[:, 7], "stage 1": st[:, 2] - st[:, 1],
              "fixup": st[:, 3] - st[:, 2], "w2": st[:, 4] - st[:, 3], "entry (from first)": st[:, 0] - t0,
              "stage 1 end (from first)": st[:, 2] - t0, "end (from first)": st[:, 4] - t0}
    out = {"programs": int(st.shape[0]), "span_us": float(us(st[:, 4].max() - t0))}
    print(f"    trace: {out['programs']} programs, span {out['span_us']:.1f} µs; "
          f"programs per SM max {int(torch.bincount(st[:, 5]).max())}, SMs used {int(torch.unique(st[:, 5]).numel())}")
    for name, v in phases.items():
        q = torch.quantile(us(v), torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64))
        out[name] = [float(x) for x in q] + [float(us(v).max())]
        print(f"      {name:<26} p10 {q[0]:7.2f}  med {q[1]:7.2f}  p90 {q[2]:7.2f}  max {float(us(v).max()):7.2f}")
    out["raw"] = st.tolist()
    return out


def registers(op_module) -> str:
    """' (R registers, S spilled)' of the bound swapped 1-stage kernel of the op's last plan, '' where unknown."""
    for plan in reversed(list(op_module._PLANS.values())):
        for bound, _ in getattr(plan, "calls", ()):
            compiled = getattr(bound, "compiled", None)
            if "swap" in bound.name and compiled is not None and getattr(compiled, "n_regs", None) is not None:
                return f" ({compiled.n_regs} registers, {compiled.n_spills} spilled)"
    return ""


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mxfp4-csv", type=pathlib.Path, default=None, help="tuned MXFP4 rows for the op's choice")
    ap.add_argument("--dims", type=parse_dims, default=(2880, 2880, 128, 4), help="D,I,E,TOPK (gpt-oss-120b)")
    ap.add_argument("--tokens", default="1,2,4,8")
    ap.add_argument("--tiles", default=TILES, help="BM:BN:BD:W:S:SCALE_TMA[:KSPLIT],... (the 1-stage configs swept)")
    ap.add_argument("--no-profile", action="store_true", help="skip the best config's graph and kernel profile")
    ap.add_argument("--no-coop", action="store_true", help="split configs' last split runs all of w2 (not COOP_SPLIT)")
    ap.add_argument("--tickets", default="1", help="COOP_TICKET values to sweep, alternating: 1, 0 or 1,0,1,0")
    ap.add_argument("--park", action="store_true",
                    help="the profile queues its calls behind a sleep, so its gaps are the GPU's, not the host's")
    ap.add_argument("--maxnreg", default="auto",
                    help="register caps to sweep: auto (the kernel's rule, register_cap), 0 (ptxas' choice), 80, ...")
    ap.add_argument("--prefetch-w2", default="auto",
                    help="fused_moe_1stage.PREFETCH_W2 values to sweep: auto (the kernel's rule, prefetch_w2), 0 off, "
                         "1 first arrival, 2 each waiting split")
    ap.add_argument("--trace", action="store_true",
                    help="each config: one call with the kernel's phase stamps (L2 flushed first), summarized")
    ap.add_argument("--json", type=pathlib.Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_mxfp4_1stage: needs a GPU (it times kernels)")
    if args.mxfp4_csv is not None:
        if not args.mxfp4_csv.is_file():
            raise SystemExit(f"probe_mxfp4_1stage: no such file: {args.mxfp4_csv}")
        os.environ["TRITUNE_CONFIG_FMOE"] = str(args.mxfp4_csv)
    from probe_decode_floor import kernel_profile

    from tritune import ops
    from tritune.kernels import fused_moe as fm
    from tritune.kernels import fused_moe_1stage

    fused_moe_1stage.COOP_SPLIT = not args.no_coop
    op_module = importlib.import_module("tritune.ops.fused_moe")  # the module (tritune.ops.fused_moe is the op)
    from tritune.ops.fused_moe import MoeChoice
    from tritune.ops.heuristics import moe_heuristic
    from tritune.tuning.bench import capture_graph, time_kernel

    d, inter, experts, topk = args.dims
    g = torch.Generator(device="cuda").manual_seed(0)
    moe = mxfp4_moe(d, inter, experts, g)
    q1, q2, pw1, pw2, ps1, ps2 = moe.q1, moe.q2, moe.w1, moe.w2, moe.s1, moe.s2
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        hidden = torch.randn(tokens, d, device="cuda", generator=g).bfloat16()
        weights, ids = ops.sample_routing(tokens, experts, topk, seed=1234, device=torch.device("cuda"))
        floor = floor_us(int(torch.unique(ids).numel()), tokens, d, inter)

        def op(choice=None, h=hidden, w=weights, i=ids):
            return ops.fused_moe(h, pw1, pw2, w, i, quant=fm.MXFP4, w1_scale=ps1, w2_scale=ps2, choice=choice)

        fused_moe_1stage.MAXNREG = fused_moe_1stage.PREFETCH_W2 = None  # the op as shipped
        op_module._PLANS.clear()
        ref = op().clone()
        source = ops.fused_moe_choice(hidden, q1, q2, ids, quant=fm.MXFP4).source
        base = time_kernel(op, iters=30, warmup=3).median_us
        _, p1, p2 = moe_heuristic(tokens, d, inter, experts, topk, fm.MXFP4, one_stage=False)
        pair_choice = MoeChoice(False, p1, p2, "the rule table's stage pair")
        pair = time_kernel(lambda c=pair_choice: op(c), iters=30, warmup=3).median_us
        print(f"\n## {tokens} tokens (floor {floor:.1f} µs): the op ({source}) {base:.1f} µs; the rule table's stage "
              f"pair {pair:.1f} µs", flush=True)
        print("| config | µs | x op | x floor | rel L2 vs op |\n|---|---|---|---|---|")
        results = []
        prefetch = [None if v == "auto" else int(v) for v in args.prefetch_w2.split(",")]
        for pf, ticket, regs, cfg in ((f, t, r, c) for f in prefetch
                                      for t in (int(v) for v in args.tickets.split(","))
                                      for r in (None if v == "auto" else int(v) for v in args.maxnreg.split(","))
                                      for c in sweep(args.tiles)):
            fused_moe_1stage.PREFETCH_W2 = pf
            fused_moe_1stage.COOP_TICKET = bool(ticket)
            fused_moe_1stage.MAXNREG = regs
            op_module._PLANS.clear()  # plans bind the switches
            choice = MoeChoice(True, cfg, None, "forced")
            name = (cfg.name("1stage", fm.MXFP4) + ("" if ticket else " (no tickets)")
                    + f" maxnreg {'auto' if regs is None else regs}" + ("" if pf is None else f" prefetch-w2 {pf}"))
            try:
                err = rel_l2(op(choice), ref)
                us = time_kernel(lambda c=choice: op(c), iters=30, warmup=3).median_us
            except Exception as exc:  # noqa: BLE001 (a config that fails to build is a row, not the end)
                print(f"| {name} | failed: {type(exc).__name__}: {str(exc)[:200]} | | | |", flush=True)
                results.append({"config": name, "error": f"{type(exc).__name__}: {exc}"[:500]})
                continue
            print(f"| {name}{registers(op_module)} | {us:.1f} | {us / base:.3f} | {us / floor:.2f} | {err:.2e} |",
                  flush=True)
            results.append({"config": name, "us": us, "rel_l2": err, "choice": choice, "maxnreg": regs,
                            "ticket": bool(ticket), "prefetch_w2": pf})
            if args.trace:
                results[-1]["trace"] = traced(lambda c=choice: op(c), op_module, fused_moe_1stage)
                fused_moe_1stage.TRACE = False
                op_module._PLANS.clear()
        ok = [r for r in results if "us" in r and r["rel_l2"] < 1e-2]
        row = {"tokens": tokens, "floor_us": floor, "op_us": base, "op_source": source, "pair_us": pair,
               "sweep": [{k: v for k, v in r.items() if k != "choice"} for r in results]}
        if ok:
            best = min(ok, key=lambda r: r["us"])
            row.update(best=best["config"], best_us=best["us"])
            print(f"best {best['config']}: {best['us']:.1f} µs ({best['us'] / floor:.2f}x floor, "
                  f"{best['us'] / base:.3f}x the op, {best['us'] / pair:.3f}x the stage pair)", flush=True)
        if ok and not args.no_profile:
            fused_moe_1stage.MAXNREG = best["maxnreg"]
            fused_moe_1stage.COOP_TICKET = best["ticket"]
            fused_moe_1stage.PREFETCH_W2 = best["prefetch_w2"]
            op_module._PLANS.clear()
            fn = lambda c=best["choice"]: op(c)  # noqa: E731
            graphs = {}
            for what, call in (("op", op), ("1stage", fn)):
                call()
                graph, _ = capture_graph(call)
                graphs[what] = time_kernel(graph.replay, iters=30, warmup=3).median_us
            again = {"op": time_kernel(op, iters=30, warmup=3).median_us,
                     "1stage": time_kernel(fn, iters=30, warmup=3).median_us}
            prof = kernel_profile(fn, "zero", park=args.park)
            row.update(graph_us=graphs, again_us=again, kernels=prof)
            print(f"again op {again['op']:.1f} / 1-stage {again['1stage']:.1f}; graph op {graphs['op']:.1f} / "
                  f"1-stage {graphs['1stage']:.1f}")
            for k in prof:
                print(f"    {k['kernel']:<72} {k['us']:8.2f} gap {k['gap_us']:6.2f}")
        rows.append(row)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "dims": args.dims, "rows": rows},
                                        indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
