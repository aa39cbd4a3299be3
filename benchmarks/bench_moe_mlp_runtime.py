"""The training MoE MLP (`ops.moe_mlp`) as a user calls it (GPU): host cost per call, GPU time, eager time and
CUDA-graph time, for the forward alone (inference, no autograd) and for a whole training step (forward + backward),
and whether a graph's replay gives the eager result bit for bit.

    PYTHONPATH=src python benchmarks/bench_moe_mlp_runtime.py --out $OUT/moe_mlp_runtime.json

The host cost is the median wall time of one call while the GPU is parked (bench_runtime.host_cost); eager and graph
times come from bench_runtime.eager_and_graph (back-to-back calls, rounds alternated). The step clears the gradients
before each call, as a training loop's zero_grad(set_to_none=True) does.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
import traceback

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))

from bench_runtime import capture, eager_and_graph, gpu_time, host_cost  # noqa: E402

from tritune.tuners.grouped_gemm import MODEL_PRESETS  # noqa: E402

# (E, topk, hidden, intermediate) of the grouped-GEMM tuner's presets, as `tritune grouped-gemm --model` knows them
MODELS = {name: MODEL_PRESETS[name] for name in ("mixtral-8x7b", "qwen3-30b-a3b")}
TOKENS = (16, 256, 4096)


def inputs(model: str, tokens: int, seed: int = 0) -> dict:
    from tritune.ops.routing import sample_routing

    e, topk, h, inter = MODELS[model]
    g = torch.Generator(device="cuda").manual_seed(seed)
    tw, ti = sample_routing(tokens, e, topk, seed=seed, device="cuda")
    return {"hidden": torch.randn(tokens, h, device="cuda", generator=g).bfloat16().requires_grad_(),
            "gate_up": (torch.randn(e, 2 * inter, h, device="cuda", generator=g) / h**0.5).bfloat16().requires_grad_(),
            "down": (torch.randn(e, h, inter, device="cuda", generator=g) / inter**0.5).bfloat16().requires_grad_(),
            "weights": tw.requires_grad_(), "ids": ti,
            "dout": torch.randn(tokens, h, device="cuda", generator=g).bfloat16()}


def forward_call(x: dict):
    from tritune.ops.moe_mlp import moe_mlp

    def fwd():
        with torch.no_grad():
            return moe_mlp(x["hidden"], x["gate_up"], x["down"], x["weights"], x["ids"])
    return fwd


def step_call(x: dict):
    from tritune.ops.moe_mlp import moe_mlp

    leaves = (x["hidden"], x["gate_up"], x["down"], x["weights"])

    def step():
        for t in leaves:
            t.grad = None
        moe_mlp(x["hidden"], x["gate_up"], x["down"], x["weights"], x["ids"]).backward(x["dout"])
        return tuple(t.grad for t in leaves)
    return step


def replay_equals_eager(fn) -> bool:
    """Capture fn once, replay it, and compare every output tensor with a fresh eager call, bit for bit."""
    eager = fn()
    torch.cuda.synchronize()
    eager = [t.clone() for t in (eager if isinstance(eager, tuple) else (eager,))]
    graph, out = capture(fn)
    graph.replay()
    torch.cuda.synchronize()
    out = out if isinstance(out, tuple) else (out,)
    return all(torch.equal(a, b) for a, b in zip(eager, out, strict=True))


def point(model: str, tokens: int) -> list[dict]:
    rows = []
    e, topk, h, inter = MODELS[model]
    weight_bytes = 2 * 3 * e * h * inter
    sets = [inputs(model, tokens, s) for s in range(max(1, min(4, (400 * 2**20) // weight_bytes)))]
    for what, make in (("forward", forward_call), ("step", step_call)):
        rec = {"model": model, "tokens": tokens, "what": what, "input_sets": len(sets)}
        try:
            calls = [make(x) for x in sets]
            rec |= {k: round(v, 1) for k, v in host_cost(calls[0], calls=50).items()}
            rec["gpu_us"] = round(gpu_time(calls[0]), 1)
            rec |= {k: round(v, 1) for k, v in eager_and_graph(calls, reps=5, rounds=5).items()}
            rec["replay_equals_eager"] = replay_equals_eager(calls[0])
        except Exception as err:  # noqa: BLE001 - a path that cannot be captured is a result
            rec["error"] = f"{type(err).__name__}: {err}".splitlines()[0][:300]
            traceback.print_exc()
        print(json.dumps(rec), flush=True)
        rows.append(rec)
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--models", default=",".join(MODELS))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_moe_mlp_runtime: needs a CUDA GPU (it times host cost, eager and graph replays)", file=sys.stderr)
        return 2
    import triton

    rows = []
    for model in args.models.split(","):
        for tokens in map(int, args.tokens.split(",")):
            rows += point(model, tokens)
    pathlib.Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "triton": triton.__version__,
                                                  "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                                                  "rows": rows}, indent=1))
    print("\nmodel | tokens | what | host µs | GPU µs | eager µs | graph µs | replay == eager")
    for r in rows:
        if "error" in r:
            print(f"{r['model']} | {r['tokens']} | {r['what']} | {r['error']}")
        else:
            print(f"{r['model']} | {r['tokens']} | {r['what']} | {r['host_us']} | {r['gpu_us']} | {r['eager_us']} | "
                  f"{r['graph_us']} | {r['replay_equals_eager']}")
    return 1 if any("error" in r or not r["replay_equals_eager"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
