"""Where the host time of one fused-MoE op call goes (GPU box): the whole call, the bound plan alone, the call's key,
and each bound launch alone, per case. Host times are taken with the GPU parked, so no launch waits on the queue.

    PYTHONPATH=src python3 benchmarks/profile_moe_host.py [--json FILE]
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time

import torch


def host_us(fn, n: int = 200) -> float:
    """Median µs of one call, the GPU parked on a sleep so launches only queue."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(3e8))
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(ts)


def cases():
    """(name, T, E, topk, D, I, quant, forced choice or None)."""
    from tritune.kernels.fused_moe import MoeConfig
    from tritune.ops.fused_moe import MoeChoice

    tma = MoeChoice(False, MoeConfig(64, 64, 64, 8, 4, 3, USE_TMA=True), MoeConfig(64, 64, 64, 8, 4, 3, USE_TMA=True),
                    "forced TMA")
    out = []
    for T, E, topk in ((1, 8, 2), (7, 128, 8), (64, 128, 8), (1024, 8, 2), (4096, 128, 8)):
        for quant in ("none", "per_token", "per_1x128", "per_1x32"):
            out.append((f"{quant} T={T} E={E} top{topk}", T, E, topk, 128, 128, quant, None))
    out.append(("none T=1024 E=8 top2 TMA both", 1024, 8, 2, 128, 128, "none", tma))
    return out


def profile_case(tmod, name: str, T: int, E: int, topk: int, D: int, inter: int, quant: str, choice) -> dict:
    from tritune import ops
    from tritune.kernels import launch as kl
    opm = importlib.import_module("tritune.ops.fused_moe")

    x = tmod.moe_inputs(T, D, inter, E, topk, quant)
    call = tmod.moe_call(x, choice)
    call()
    torch.cuda.synchronize()
    plan = list(opm._PLANS.values())[-1]
    out = torch.empty(T, D, device="cuda", dtype=torch.bfloat16)
    addresses = (x["hidden"].data_ptr(), x["w1"].data_ptr(), x["w2"].data_ptr(), x["topk_weights"].data_ptr(),
                 0 if x["w1_scale"] is None else x["w1_scale"].data_ptr(),
                 0 if x["w2_scale"] is None else x["w2_scale"].data_ptr(), out.data_ptr(),
                 x["topk_ids"].data_ptr())
    pargs = (x["hidden"], x["w1"], x["w2"], x["topk_weights"], x["topk_ids"], x["w1_scale"], x["w2_scale"], out,
             addresses)
    kl.reset_launch_counts(True)
    call()
    counts = kl.launch_counts()
    kl.reset_launch_counts(False)
    rec = {"case": name, "launches": sum(counts.values()), "kernels": counts,
           "op_us": host_us(call), "op_out_us": host_us(lambda: ops.fused_moe(
               x["hidden"], x["w1"], x["w2"], x["topk_weights"], x["topk_ids"], quant=quant,
               w1_scale=x["w1_scale"], w2_scale=x["w2_scale"], choice=choice, out=out)),
           "plan_us": host_us(lambda: plan(*pargs)),
           "alloc_out_us": host_us(lambda: torch.empty(T, D, device="cuda", dtype=torch.bfloat16)),
           "workspace_us": host_us(lambda: plan.workspace.allocate(out.device))}
    per = []
    keep, p = plan.workspace.allocate(out.device)
    for bound, getter in plan.getters:
        head = getter(plan.flat_arguments(addresses, p))
        per.append((bound.name, host_us(lambda b=bound, h=head: b.launch(*h))))
    rec["launch_us"] = per
    rec["call"] = call
    print(f"{name:34s} launches {rec['launches']}  op {rec['op_us']:6.1f}  op(out=) {rec['op_out_us']:6.1f}  "
          f"plan {rec['plan_us']:6.1f}  empty {rec['alloc_out_us']:4.1f}  ws {rec['workspace_us']:4.1f}  "
          "launches: " + " ".join(f"{n.strip('_')[:14]}={u:.1f}" for n, u in per), flush=True)
    return rec


def main() -> None:
    import triton

    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--cast-in-kernel", action="store_true",
                    help="1-stage calls with the output cast inside the GEMM kernel (FINAL_CAST_IN_KERNEL)")
    args = ap.parse_args()
    if args.cast_in_kernel:
        from tritune.kernels import fused_moe_1stage

        fused_moe_1stage.FINAL_CAST_IN_KERNEL = True
    spec = __import__("importlib.util").util.spec_from_file_location("t", "tests/test_runtime_gpu.py")
    tmod = __import__("importlib.util").util.module_from_spec(spec)
    spec.loader.exec_module(tmod)
    print("Triton", triton.__version__, "torch", torch.__version__, torch.cuda.get_device_name())
    rows = []
    calls = {}
    x0 = torch.zeros(16, device="cuda")
    a, b = torch.randn(16, 256, device="cuda").bfloat16(), torch.randn(256, 256, device="cuda").bfloat16()
    calls["torch x.add_(1)"] = lambda: x0.add_(1)
    calls["torch.matmul 16x256x256"] = lambda: a @ b.T
    from tritune import ops
    from tritune.kernels.gemm import GemmConfig

    tma = GemmConfig(64, 64, 64, 1, 4, 3, PERSISTENT_TMA=True)
    calls["ops.gemm 16x256x256 (selected)"] = lambda: ops.gemm(a, b)
    calls["ops.gemm 16x256x256 TMA config"] = lambda: ops.gemm(a, b, config=tma)
    for case in cases():
        rec = profile_case(tmod, *case)
        rows.append(rec)
        calls[rec["case"]] = rec.pop("call")
    # The host is noisy for minutes at a time: every case is timed in each of several interleaved rounds, so a slow
    # spell hits all of them alike; the median over rounds is the figure.
    rounds = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, fn in calls.items():
            rounds[name].append(host_us(fn, n=100))
    print(f"\nop host µs over {args.rounds} interleaved rounds: median [min, max]")
    summary = []
    for name, ts in rounds.items():
        med = statistics.median(ts)
        summary.append({"case": name, "median_us": med, "min_us": min(ts), "max_us": max(ts), "rounds": ts})
        print(f"{name:40s} {med:6.1f}  [{min(ts):5.1f}, {max(ts):5.1f}]")
    rows.append({"interleaved": summary})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
