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

from tritune.tuning.bench import capture_graph

ROTATE_BYTES = 200 * 2**20  # inputs rotated over at least this many bytes, so L2 (50 MB) never holds them all


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _gpu_cases():
    """The op-path cases and their checks live in tests/test_runtime_gpu.py (loaded by path: one definition)."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "tests" / "test_runtime_gpu.py"
    spec = importlib.util.spec_from_file_location("test_runtime_gpu", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_CASES = _gpu_cases()
gemm_inputs, gemm_call, moe_inputs, moe_call = (_CASES.gemm_inputs, _CASES.gemm_call, _CASES.moe_inputs,
                                                _CASES.moe_call)
safety_cases, check_safety = _CASES.safety_cases, _CASES.check_safety


def gemm_baseline(kernel: str, x: dict) -> Callable[[], torch.Tensor]:
    if kernel == "bf16":
        return lambda: x["a"] @ x["b"].T
    if kernel == "a8w8":
        sa, sb = x["a_scale"].reshape(-1, 1), x["b_scale"].reshape(1, -1)
        return lambda: torch._scaled_mm(x["a"], x["b"].T, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    # cuBLAS has no 1x128 x 128x128 block scales through torch here: per-tensor scaled fp8 is the nearest bound.
    one = torch.ones((), device="cuda")
    return lambda: torch._scaled_mm(x["a"], x["b"].T, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


# ---------------------------------------------------------------------------------------------------- host cost
def host_cost(fn: Callable[[], object], calls: int = 300) -> dict:
    """Host µs per call (median of calls timed one by one while the GPU is parked on a sleep, so no launch waits
    for a full queue) and wall µs per call of `calls` back-to-back calls (whichever of host and GPU is slower)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e8))  # ~0.1 s of GPU cycles: the launches below only queue (150 calls, < 1000 launches)
    per_call = []
    for _ in range(150):
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
    def grouped_step():
        from tritune.kernels.grouped_gemm import group_by_expert
        from tritune.ops.grouped_gemm import grouped_gemm

        T, E, topk, D, N = 64, 8, 2, 256, 256
        g = torch.Generator(device="cuda").manual_seed(0)
        ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:topk] for _ in range(T)]).int()
        x = torch.randn(T, D, device="cuda", generator=g).bfloat16().requires_grad_()
        w = (torch.randn(E, N, D, device="cuda", generator=g) / 16).bfloat16().requires_grad_()
        dy = torch.randn(T * topk, N, device="cuda", generator=g).bfloat16()

        def step():
            m, gi = group_by_expert(ids, E)
            grouped_gemm(x, w, m, gi, topk=topk, permute_x=True).backward(dy)
        return step
    cases.append(("grouped_gemm autograd step (fwd + dX + dW) T=64 E=8 top2 D=N=256", grouped_step))
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


def capture(fn: Callable[[], object]) -> tuple[torch.cuda.CUDAGraph, object]:
    """(a CUDA graph of one call of fn, what the captured call returned): `tuning.bench.capture_graph`, fn run once
    on a side stream first; the graph is not replayed here."""
    return capture_graph(fn)


def eager_and_graph(calls: list[Callable[[], object]], reps: int = 20, rounds: int = 7) -> dict:
    """Eager: back-to-back calls over the rotating sets, timed with events (host included when it is the bottleneck).
    Graph: the same calls captured once, replayed back to back. Eager and graph rounds alternate, so a slow spell
    of the lent host (its own torch calls move by up to +-40% minutes apart) hits both alike; medians."""
    def eager_round() -> None:
        for fn in calls:
            fn()

    eager_round()
    torch.cuda.synchronize()
    graph, _ = capture(eager_round)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed(run_round: Callable[[], None]) -> float:
        start.record()
        for _ in range(reps):
            run_round()
        end.record()
        torch.cuda.synchronize()
        return 1000 * start.elapsed_time(end) / (reps * len(calls))

    eager, graphed = [], []
    for _ in range(rounds):
        eager.append(timed(eager_round))
        graphed.append(timed(graph.replay))
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


# ---------------------------------------------------------------------------------------------------- off-grid
# Points no shipped file tunes: shapes from models outside examples/ (DeepSeek-V3 block-fp8 projections, Llama-3-8B
# qkv, Qwen3-30B-A3B and DeepSeek-V2-Lite MoE) and M / token counts between the shipped tuned ones.
# The FRESH points were added after the first evaluation (which moved one rule-table threshold): nothing was tuned
# to them, so they say how the rules generalize.
OFFGRID_GEMM = (  # (kernel, N, K, Ms, what)
    ("a8w8_blockscale", 2112, 7168, (1, 16, 128), "DeepSeek-V3 q_a+kv_a (untuned shape)"),
    ("a8w8_blockscale", 24576, 1536, (1, 64), "DeepSeek-V3 q_b (untuned shape)"),
    ("bf16", 6144, 4096, (1, 32, 200), "Llama-3-8B qkv (untuned shape)"),
    ("bf16", 4096, 4096, (8, 48, 512), "tuned shape, M off the grid"),
    ("bf16", 7168, 5120, (8, 96, 384), "FRESH Qwen2.5-14B qkv (untuned shape)"),
    ("a8w8_blockscale", 7168, 16384, (4, 256), "FRESH DeepSeek-V3 o_proj (untuned shape)"),
)
OFFGRID_MOE = (  # (D, I, E, topk, quant, tokens, what)
    (2048, 768, 128, 8, "none", (1, 16, 256), "Qwen3-30B-A3B (untuned shape)"),
    (2048, 1408, 64, 6, "none", (4, 64), "DeepSeek-V2-Lite (untuned shape)"),
    (4096, 14336, 8, 2, "none", (16, 256), "Mixtral, tokens off the grid"),
    (2880, 2880, 32, 4, "none", (8, 128), "FRESH gpt-oss-20b-like (untuned shape)"),
    (4096, 14336, 8, 2, "per_1x128", (64,), "FRESH Mixtral fp8 1x128, tokens off the grid"),
)
_QUANT_CELLS = {"none": "dtypes.bf16,dtypes.bf16,QuantType.No",
                "per_token": "dtypes.fp8,dtypes.fp8,QuantType.per_Token",
                "per_1x128": "dtypes.fp8,dtypes.fp8,QuantType.per_1x128"}


def offgrid_points() -> list[tuple[str, str, tuple, str]]:
    pts = [("gemm", k, (M, N, K), what) for k, N, K, ms, what in OFFGRID_GEMM for M in ms]
    pts += [("moe", q, (T, D, inter, E, topk), what) for D, inter, E, topk, q, ts, what in OFFGRID_MOE for T in ts]
    return pts


def tune_offgrid(folder: Path, log) -> dict:
    """Tune every off-grid point into `folder` with the tritune CLI (the user's path): the tuned optimum."""
    import subprocess
    import sys

    walls = {}
    for kernel, N, K, ms, _what in OFFGRID_GEMM:
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "tritune.cli", "gemm", "--kernel", kernel, "--n", str(N), "--k", str(K), "--m",
               ",".join(map(str, ms)), "-o", str(folder), "--no-progress"]
        run = subprocess.run(cmd, capture_output=True, text=True)
        print(" ".join(cmd), run.returncode, run.stdout[-3000:], run.stderr[-3000:], sep="\n", file=log, flush=True)
        walls[f"gemm {kernel} N={N} K={K} M={ms}"] = time.perf_counter() - t0
    rows = ["token,model_dim,inter_dim,expert,topk,act_type,dtype,q_dtype_a,q_dtype_w,q_type,use_g1u1,doweight_stage1"]
    for D, inter, E, topk, quant, ts, _what in OFFGRID_MOE:
        rows += [f"{T},{D},{inter},{E},{topk},ActivationType.Silu,dtypes.bf16,{_QUANT_CELLS[quant]},True,False"
                 for T in ts]
    (folder / "untuned_fmoe.csv").write_text("\n".join(rows) + "\n")
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "tritune.cli", "moe", "-i", str(folder / "untuned_fmoe.csv"), "-o",
           str(folder / "tuned_fmoe.csv")]
    run = subprocess.run(cmd, capture_output=True, text=True)
    print(" ".join(cmd), run.returncode, run.stdout[-6000:], run.stderr[-3000:], sep="\n", file=log, flush=True)
    walls["moe rows"] = time.perf_counter() - t0
    return walls


def time_offgrid_points(log) -> list[dict]:
    """`time_point` at every off-grid point with the configs the ops see now (a failure is recorded, not raised)."""
    recs = []
    for kind, kernel, dims, what in offgrid_points():
        try:
            rec = {**time_point(kind, kernel, dims), "what": what}
        except Exception as err:  # noqa: BLE001
            rec = {"kind": kind, "kernel": kernel, "dims": list(dims), "what": what, "error": str(err)[:300]}
        recs.append(rec)
        print(json.dumps(rec), file=log, flush=True)
        torch.cuda.empty_cache()
    return recs


def offgrid(out: Path, log, tuned_dir: Path | None) -> dict:
    """The op at each off-grid point as shipped (off-grid choice or rule table), then tuned for exactly that point."""
    import os

    from tritune.ops import reload_configs, reload_moe_configs

    shipped = time_offgrid_points(log)
    folder = tuned_dir or out / "tuned"
    walls = {}
    if tuned_dir is None:
        folder.mkdir(parents=True, exist_ok=True)
        walls = tune_offgrid(folder, log)
    os.environ["TRITUNE_CONFIG_DIR"] = str(folder)
    os.environ["TRITUNE_CONFIG_FMOE"] = str(folder / "tuned_fmoe.csv")
    reload_configs()
    reload_moe_configs()
    tuned = time_offgrid_points(log)
    return {"shipped": shipped, "tuned": tuned, "tune_wall_s": walls}


# ---------------------------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--parts", default="safety,host,timing,offgrid")
    ap.add_argument("--tuned-dir", type=Path, default=None, help="off-grid: reuse these tuned configs, no tuning")
    ap.add_argument("--cast-in-kernel", action="store_true",
                    help="1-stage fused MoE with the output cast inside its GEMM kernel (FINAL_CAST_IN_KERNEL, off by "
                         "default until measured): one launch fewer per call")
    ap.add_argument("--padded-grid", action="store_true",
                    help="MoE GEMM grids over every block of the padded sort (moe_align.GEMM_GRID_TIGHT off): the "
                         "baseline of the tight grids")
    args = ap.parse_args()
    if args.padded_grid:
        from tritune.kernels import moe_align

        moe_align.GEMM_GRID_TIGHT = False
    if args.cast_in_kernel:
        from tritune.kernels import fused_moe_1stage

        fused_moe_1stage.FINAL_CAST_IN_KERNEL = True
    args.out.mkdir(parents=True, exist_ok=True)
    import triton

    result = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "cast_in_kernel": args.cast_in_kernel,
              "padded_grid": args.padded_grid}
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
    if "offgrid" in parts:
        result["offgrid"] = offgrid(args.out, log, args.tuned_dir)
    (args.out / "bench_runtime.json").write_text(json.dumps(result, indent=1))
    print_tables(result)


def print_offgrid(result: dict) -> None:
    rows = result["offgrid"]
    print("\n| point | dims | as shipped: source | eager µs | tuned for it: eager µs | ratio (eager) | ratio (GPU) |"
          "\n|---|---|---|---|---|---|---|")
    ratios, gpu_ratios = [], []
    for a, b in zip(rows["shipped"], rows["tuned"], strict=True):
        if "error" in a or "error" in b:
            print(f"| {a['kind']} {a['kernel']} {a.get('what', '')} | {a['dims']} | error: {a.get('error', '')} "
                  f"{b.get('error', '')} ||||")
            continue
        r, rg = a["eager_us"] / b["eager_us"], a["gpu_us"] / b["gpu_us"]
        ratios.append(r)
        gpu_ratios.append(rg)
        print(f"| {a['kind']} {a['kernel']} {a['what']} | {a['dims']} | {a['source'][:70]} | {a['eager_us']:.1f} | "
              f"{b['eager_us']:.1f} | {r:.2f} | {rg:.2f} |")
    if ratios:
        geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
        geo_g = math.exp(sum(map(math.log, gpu_ratios)) / len(gpu_ratios))
        print(f"\n{len(ratios)} points: eager geomean {geo:.3f}, max {max(ratios):.2f}; GPU-time geomean {geo_g:.3f}, "
              f"max {max(gpu_ratios):.2f}; tuning wall {rows['tune_wall_s']}")


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
    if "offgrid" in result:
        print_offgrid(result)
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
