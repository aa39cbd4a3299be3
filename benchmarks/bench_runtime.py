"""Runtime benchmark (GPU): what a user feels per op call, and the safety of every op path.

    PYTHONPATH=src python3 benchmarks/bench_runtime.py --out DIR [--parts safety,host,timing] [--config-dir D]

- safety: every op path (GEMM pointer / split-K / TMA for bf16, a8w8, block-scaled; fused MoE 2-stage with each
  sort path, split-K, TMA, fp8 per-token and per-1x128, 1-stage; grouped GEMM forward, dX, dW and an autograd
  step) runs under torch.cuda.set_sync_debug_mode("error"), then is captured in a CUDA graph whose replay must
  equal the eager result (bit for bit; within 1e-2 relative L2 for the 1-stage kernel, which sums with atomics).
- host: host cost per call on tiny problems (GPU time far below it): the median wall time of one call in Python
  and the time per call of 300 back-to-back calls, beside torch.matmul / torch._scaled_mm on the same host.
- timing: per op and shape, GPU time (the tuner's timer: L2 flushed, GPU parked while calls queue), eager time
  (back-to-back calls from Python over rotating input sets, host included) and CUDA-graph time (the same calls
  captured once, replayed), beside cuBLAS.
Writes DIR/bench_runtime.json and prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

ROTATE_BYTES = 200 * 2**20  # inputs rotated over at least this many bytes, so L2 (50 MB) never holds them all


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ---------------------------------------------------------------------------------------------------- problems
def gemm_inputs(kernel: str, M: int, N: int, K: int, seed: int = 0) -> dict:
    from tritune.kernels.quant import quantize_blocks, quantize_rows

    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(M, K, device="cuda", generator=g)
    b = torch.randn(N, K, device="cuda", generator=g) / math.sqrt(K)
    if kernel == "bf16":
        return {"a": a.bfloat16(), "b": b.bfloat16(), "a_scale": None, "b_scale": None}
    if kernel == "a8w8":
        (qa, sa), (qb, sb) = quantize_rows(a), quantize_rows(b)
    else:
        (qa, sa), (qb, sb) = quantize_blocks(a, 1), quantize_blocks(b, 128)
    return {"a": qa, "b": qb, "a_scale": sa, "b_scale": sb}


def gemm_call(kernel: str, x: dict, config=None) -> Callable[[], torch.Tensor]:
    from tritune import ops

    if kernel == "bf16":
        return lambda: ops.gemm(x["a"], x["b"], config=config)
    op = ops.gemm_a8w8 if kernel == "a8w8" else ops.gemm_a8w8_blockscale
    return lambda: op(x["a"], x["b"], x["a_scale"], x["b_scale"], config=config)


def gemm_baseline(kernel: str, x: dict) -> Callable[[], torch.Tensor]:
    if kernel == "bf16":
        return lambda: x["a"] @ x["b"].T
    if kernel == "a8w8":
        sa, sb = x["a_scale"].reshape(-1, 1), x["b_scale"].reshape(1, -1)
        return lambda: torch._scaled_mm(x["a"], x["b"].T, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    # cuBLAS has no 1x128 x 128x128 block scales through torch here: per-tensor scaled fp8 is the nearest bound.
    one = torch.ones((), device="cuda")
    return lambda: torch._scaled_mm(x["a"], x["b"].T, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


def moe_inputs(T: int, D: int, inter: int, E: int, topk: int, quant: str = "none", seed: int = 0) -> dict:
    from tritune.kernels.fused_moe import quantize_weights
    from tritune.ops.routing import sample_routing

    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    w1 = torch.randn(E, 2 * inter, D, device="cuda", generator=g) / math.sqrt(D)
    w2 = torch.randn(E, D, inter, device="cuda", generator=g) / math.sqrt(inter)
    if quant == "none":
        (w1, s1), (w2, s2) = (w1.bfloat16(), None), (w2.bfloat16(), None)
    else:
        (w1, s1), (w2, s2) = quantize_weights(w1, quant), quantize_weights(w2, quant)
    weights, ids = sample_routing(T, E, topk, skew=0.0, device=torch.device("cuda"), seed=seed)
    return {"hidden": hidden, "w1": w1, "w2": w2, "topk_weights": weights, "topk_ids": ids, "w1_scale": s1,
            "w2_scale": s2, "quant": quant}


def moe_call(x: dict, choice=None) -> Callable[[], torch.Tensor]:
    from tritune import ops

    return lambda: ops.fused_moe(x["hidden"], x["w1"], x["w2"], x["topk_weights"], x["topk_ids"], quant=x["quant"],
                                 w1_scale=x["w1_scale"], w2_scale=x["w2_scale"], choice=choice)


# ---------------------------------------------------------------------------------------------------- safety
def safety_cases() -> list[tuple[str, Callable[[], Callable[[], torch.Tensor]], bool]]:
    """(name, factory of a call returning its output, exact replay expected)."""
    from tritune.kernels.fused_moe import MoeConfig
    from tritune.kernels.gemm import GemmConfig
    from tritune.ops.fused_moe import MoeChoice

    cases = []
    for kernel in ("bf16", "a8w8", "a8w8_blockscale"):
        bk = 128
        for name, cfg in (("pointer", GemmConfig(64, 128, bk, 8, 4, 3)),
                          ("split-K 4", GemmConfig(16, 64, bk, 1, 4, 3, NUM_KSPLIT=4)),
                          ("TMA", GemmConfig(128, 128, bk, 8, 8, 3, PERSISTENT_TMA=True))):
            M = 8 if "split" in name else 300

            def make(kernel=kernel, cfg=cfg, M=M):
                return gemm_call(kernel, gemm_inputs(kernel, M, 1024, 2048), cfg)
            cases.append((f"gemm {kernel} {name}", make, True))

        def make_op(kernel=kernel):
            return gemm_call(kernel, gemm_inputs(kernel, 33, 2048, 1024))
        cases.append((f"gemm {kernel} op (selected config)", make_op, True))

    s1 = MoeConfig(16, 64, 128, 1, 4, 3)
    s2 = MoeConfig(16, 64, 128, 1, 4, 3)
    s1_64 = MoeConfig(64, 128, 64, 8, 8, 3)
    s2_64 = MoeConfig(64, 128, 64, 8, 8, 3)
    moe = [
        ("2-stage bf16, 1-launch sort (7 tok E128 top8)", (7, 1024, 256, 128, 8, "none"), MoeChoice(False, s1, s2, "")),
        ("2-stage bf16, 2-launch sort (256 tok E64 top8)", (256, 1024, 512, 64, 8, "none"),
         MoeChoice(False, s1_64, s2_64, "")),
        ("2-stage bf16, 3-launch sort (1024 tok E64 top8)", (1024, 1024, 512, 64, 8, "none"),
         MoeChoice(False, s1_64, s2_64, "")),
        ("2-stage bf16 split-K both stages", (4, 2048, 1024, 8, 2, "none"),
         MoeChoice(False, MoeConfig(16, 64, 128, 1, 4, 3, KSPLIT=4), MoeConfig(16, 64, 128, 1, 4, 3, KSPLIT=2), "")),
        ("2-stage bf16 TMA weights", (64, 1024, 512, 8, 2, "none"),
         MoeChoice(False, MoeConfig(16, 64, 128, 1, 4, 3, USE_TMA=1), MoeConfig(16, 64, 128, 1, 4, 3, USE_TMA=1), "")),
        ("2-stage bf16 top-1 (direct store)", (64, 1024, 512, 8, 1, "none"), MoeChoice(False, s1, s2, "")),
        ("2-stage fp8 per_token", (64, 1024, 512, 8, 2, "per_token"), MoeChoice(False, s1, s2, "")),
        ("2-stage fp8 per_1x128", (64, 1024, 512, 8, 2, "per_1x128"), MoeChoice(False, s1, s2, "")),
        ("1-stage bf16", (8, 1024, 512, 8, 2, "none"),
         MoeChoice(True, MoeConfig(16, 64, 128, 1, 4, 3, BLOCK_SIZE_D=128), None, "")),
        ("1-stage fp8 per_1x128", (8, 1024, 512, 8, 2, "per_1x128"),
         MoeChoice(True, MoeConfig(16, 64, 128, 1, 4, 3, BLOCK_SIZE_D=128), None, "")),
        ("op (selected kernels) bf16 Mixtral-like 16 tok", (16, 4096, 1792, 8, 2, "none"), None),
    ]
    for name, dims, choice in moe:
        def make(dims=dims, choice=choice):
            return moe_call(moe_inputs(*dims), choice)
        cases.append((f"fused_moe {name}", make, choice is None or not choice.run_1stage))

    def grouped(kind: str):
        from tritune.kernels.grouped_gemm import group_by_expert
        from tritune.ops.grouped_gemm import grouped_gemm, run_dw, run_dx, run_forward, select_configs

        T, E, topk, D, N = 512, 16, 4, 1024, 768
        g = torch.Generator(device="cuda").manual_seed(1)
        ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:topk] for _ in range(T)]).int()
        x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
        w = (torch.randn(E, N, D, device="cuda", generator=g) / 32).bfloat16()
        m_sizes, gather = group_by_expert(ids, E)
        cfg = select_configs(T, w, topk, True, False)
        dy = torch.randn(T * topk, N, device="cuda", generator=g).bfloat16()
        if kind == "forward":
            return lambda: run_forward(x, w, m_sizes, gather, topk, True, False, cfg.forward)
        if kind == "dX":
            return lambda: run_dx(dy, w, m_sizes, gather, topk, True, False, cfg.dX)
        if kind == "dW":
            return lambda: run_dw(x, dy, m_sizes, gather, topk, True, False, cfg.dW)
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()

        def step():
            xg.grad, wg.grad = None, None
            m, gi = group_by_expert(ids, E)
            y = grouped_gemm(xg, wg, m, gi, topk=topk, permute_x=True)
            y.backward(dy)
            return torch.cat([y.detach().reshape(-1), xg.grad.reshape(-1), wg.grad.reshape(-1)])
        return step

    for kind in ("forward", "dX", "dW", "autograd step"):
        cases.append((f"grouped_gemm {kind}", lambda kind=kind: grouped(kind), True))
    return cases


def check_safety(name: str, factory, exact: bool) -> dict:
    rec = {"case": name}
    try:
        fn = factory()
        fn()  # binds (compiles on first sight)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            eager = fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        eager = eager.clone()
        torch.cuda.synchronize()
        rec["sync_free"] = True
    except Exception as err:  # noqa: BLE001 (a benchmark reports every failure and goes on)
        rec.update(sync_free=False, error=f"{type(err).__name__}: {err}".splitlines()[0][:300])
        return rec
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fn()
        graph.replay()
        torch.cuda.synchronize()
        same = torch.equal(captured, eager)
        err = rel_l2(captured, eager)
        rec.update(graph_replay_equal=bool(same if exact else err < 1e-2), graph_rel_l2=err, exact=exact)
    except Exception as err:  # noqa: BLE001
        rec.update(graph_replay_equal=False, error=f"graph: {type(err).__name__}: {err}".splitlines()[0][:300])
    return rec


# ---------------------------------------------------------------------------------------------------- host cost
def host_cost(fn: Callable[[], object], calls: int = 300) -> dict:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        per_call.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / calls
    return {"host_us": 1e6 * statistics.median(per_call), "wall_us": 1e6 * wall}


def host_cases() -> list[tuple[str, Callable[[], Callable]]]:
    cases = []
    for kernel in ("bf16", "a8w8", "a8w8_blockscale"):
        def ours(kernel=kernel):
            return gemm_call(kernel, gemm_inputs(kernel, 16, 256, 256))

        def base(kernel=kernel):
            return gemm_baseline(kernel, gemm_inputs(kernel, 16, 256, 256))
        cases.append((f"ops.gemm {kernel} 16x256x256", ours))
        cases.append((f"torch {'matmul' if kernel == 'bf16' else '_scaled_mm'} {kernel} 16x256x256", base))
    from tritune.kernels.gemm import GemmConfig

    def split(kernel="a8w8_blockscale"):
        return gemm_call(kernel, gemm_inputs(kernel, 1, 256, 2048), GemmConfig(16, 64, 128, 1, 4, 3, NUM_KSPLIT=8))
    cases.append(("ops.gemm a8w8_blockscale split-K 8 1x256x2048", split))
    for T, E, topk in ((1, 8, 2), (16, 8, 2), (128, 8, 2), (1024, 8, 2), (1, 128, 8), (7, 128, 8), (64, 128, 8),
                       (512, 128, 8), (4096, 128, 8)):
        for quant in ("none", "per_1x128"):
            def moe(T=T, E=E, topk=topk, quant=quant):
                return moe_call(moe_inputs(T, 128, 128, E, topk, quant))
            cases.append((f"ops.fused_moe {quant} T={T} E={E} top{topk} (D=I=128)", moe))
    return cases


# ---------------------------------------------------------------------------------------------------- timing
def rotated(make: Callable[[int], dict], bytes_per_set: int) -> list[dict]:
    sets = max(1, min(16, math.ceil(ROTATE_BYTES / max(bytes_per_set, 1))))
    return [make(seed) for seed in range(sets)]


def eager_and_graph(calls: list[Callable[[], object]], reps: int = 20) -> dict:
    """Eager: back-to-back calls over the rotating sets, timed with events (host included when it is the bottleneck).
    Graph: the same calls captured once, replayed back to back."""
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    eager = []
    for _ in range(5):
        start.record()
        for _ in range(reps):
            for fn in calls:
                fn()
        end.record()
        torch.cuda.synchronize()
        eager.append(1000 * start.elapsed_time(end) / (reps * len(calls)))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    graphed = []
    for _ in range(5):
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        graphed.append(1000 * start.elapsed_time(end) / (reps * len(calls)))
    return {"eager_us": statistics.median(eager), "graph_us": statistics.median(graphed)}


def gpu_time(fn: Callable[[], object]) -> float:
    from tritune.tuning.bench import time_kernel

    return time_kernel(fn, iters=30, warmup=3).median_us


def timing_points() -> list[tuple[str, str, tuple]]:
    pts = []
    for kernel in ("bf16", "a8w8_blockscale"):
        for M in (1, 16, 64, 256, 1024):
            for N, K in ((4096, 4096), (14336, 4096), (4096, 14336)):
                pts.append(("gemm", kernel, (M, N, K)))
    for T in (1, 7, 64, 512, 1024, 4096):
        pts.append(("moe", "none", (T, 4096, 14336, 8, 2)))  # Mixtral 8x7B (tuned rows ship)
        pts.append(("moe", "none", (T, 2048, 768, 128, 8)))  # Qwen3-30B-A3B
    return pts


def time_point(kind: str, kernel: str, dims: tuple) -> dict:
    rec = {"kind": kind, "kernel": kernel, "dims": list(dims)}
    if kind == "gemm":
        M, N, K = dims
        elt = 2 if kernel == "bf16" else 1
        sets = rotated(lambda s: gemm_inputs(kernel, M, N, K, s), elt * (M + N) * K)
        calls = [gemm_call(kernel, x) for x in sets]
        base = [gemm_baseline(kernel, x) for x in sets]
        from tritune.ops.gemm import select_config

        rec["source"] = select_config(kernel, M, N, K, torch.device("cuda"))[1]
        rec["cublas_gpu_us"] = gpu_time(base[0])
        rec.update({f"cublas_{k}": v for k, v in eager_and_graph(base).items()})
    else:
        T, D, inter, E, topk = dims
        from tritune.ops.fused_moe import fused_moe_choice

        sets = rotated(lambda s: moe_inputs(T, D, inter, E, topk, kernel, s), 2 * 3 * E * D * inter)
        calls = [moe_call(x) for x in sets]
        x = sets[0]
        rec["source"] = fused_moe_choice(x["hidden"], x["w1"], x["w2"], x["topk_ids"], quant=kernel).source
    rec["gpu_us"] = gpu_time(calls[0])
    rec.update(eager_and_graph(calls))
    return rec


# ---------------------------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--parts", default="safety,host,timing")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import triton

    result = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    parts = args.parts.split(",")
    log = open(args.out / "bench_runtime.log", "w")  # noqa: SIM115
    if "safety" in parts:
        result["safety"] = []
        for name, factory, exact in safety_cases():
            rec = check_safety(name, factory, exact)
            result["safety"].append(rec)
            print(json.dumps(rec), file=log, flush=True)
    if "host" in parts:
        result["host"] = []
        for name, factory in host_cases():
            try:
                rec = {"case": name, **host_cost(factory())}
            except Exception as err:  # noqa: BLE001
                rec = {"case": name, "error": f"{type(err).__name__}: {err}".splitlines()[0][:300]}
                traceback.print_exc(file=log)
            result["host"].append(rec)
            print(json.dumps(rec), file=log, flush=True)
    if "timing" in parts:
        result["timing"] = []
        for kind, kernel, dims in timing_points():
            try:
                rec = time_point(kind, kernel, dims)
            except Exception as err:  # noqa: BLE001
                rec = {"kind": kind, "kernel": kernel, "dims": list(dims),
                       "error": f"{type(err).__name__}: {err}".splitlines()[0][:300]}
                traceback.print_exc(file=log)
            result["timing"].append(rec)
            print(json.dumps(rec), file=log, flush=True)
            torch.cuda.empty_cache()
    (args.out / "bench_runtime.json").write_text(json.dumps(result, indent=1))
    print_tables(result)


def print_tables(result: dict) -> None:
    print(f"\n{result['device']}, Triton {result['triton']}, torch {result['torch']}, {result['date']}")
    if "safety" in result:
        print("\n| path | no host sync | graph replay = eager | note |\n|---|---|---|---|")
        for r in result["safety"]:
            print(f"| {r['case']} | {r.get('sync_free')} | {r.get('graph_replay_equal')} | {r.get('error', '')} |")
    if "host" in result:
        print("\n| call | host µs/call (median) | wall µs/call (300 back-to-back) |\n|---|---|---|")
        for r in result["host"]:
            if "error" in r:
                print(f"| {r['case']} | error | {r['error']} |")
            else:
                print(f"| {r['case']} | {r['host_us']:.1f} | {r['wall_us']:.1f} |")
    if "timing" in result:
        print("\n| op | dims | GPU µs | eager µs | graph µs | eager/graph | cuBLAS GPU/eager/graph | source |")
        print("|---|---|---|---|---|---|---|---|")
        for r in result["timing"]:
            if "error" in r:
                print(f"| {r['kind']} {r['kernel']} | {r['dims']} | error: {r['error']} |||||")
                continue
            cub = (f"{r['cublas_gpu_us']:.1f}/{r['cublas_eager_us']:.1f}/{r['cublas_graph_us']:.1f}"
                   if "cublas_gpu_us" in r else "")
            print(f"| {r['kind']} {r['kernel']} | {r['dims']} | {r['gpu_us']:.1f} | {r['eager_us']:.1f} | "
                  f"{r['graph_us']:.1f} | {r['eager_us'] / r['graph_us']:.2f} | {cub} | {r['source'][:60]} |")


if __name__ == "__main__":
    main()
