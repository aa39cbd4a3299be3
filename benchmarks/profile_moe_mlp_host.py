"""Where the host time of the training MoE MLP goes (GPU box): the whole forward and training step, then each piece
of them alone (routing sort, config selection, each grouped GEMM launch path, SwiGLU, the top-k sum), and a cProfile
of the step's Python, at a small token count where `bench_moe_mlp_runtime.py` found the step host-bound. Host times
are taken with the GPU parked (`profile_moe_host.host_us`), so no launch waits on the queue.

    PYTHONPATH=src python benchmarks/profile_moe_mlp_host.py --out $OUT/moe_mlp_host.json [--model M] [--tokens T]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pathlib
import pstats
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from bench_moe_mlp_runtime import MODELS, forward_call, inputs, step_call  # noqa: E402
from profile_moe_host import host_us  # noqa: E402


def pieces(x: dict, model: str) -> dict:
    """name -> zero-argument callable, each one part of the MLP's forward or backward as the op runs it: where a
    GEMM's dW is scheduled (and TRITUNE_MOE_MLP_LAYOUT is padded), on the padded rows the MLP makes."""
    from tritune.kernels.grouped_dw_scheduled import pad
    from tritune.kernels.grouped_gemm import group_by_expert
    from tritune.kernels.swiglu import swiglu_backward, swiglu_forward
    from tritune.kernels.topk_weighted_sum import topk_sum, topk_weighted_sum_backward, topk_weighted_sum_forward
    from tritune.ops.grouped_gemm import run_dw, run_dx, run_forward, select_configs
    from tritune.ops.moe_mlp import dw_on_padded, dx_on_padded, forward_on_padded, padded_rows

    e, topk, h, inter = MODELS[model]
    tokens = x["hidden"].shape[0]
    pairs = tokens * topk
    hid, w1, w2 = x["hidden"].detach(), x["gate_up"].detach(), x["down"].detach()
    m_sizes, gather = group_by_expert(x["ids"], e)
    up, down = select_configs(tokens, w1, topk, True, False), select_configs(pairs, w2, topk, False, True)
    hmid = torch.randn(pairs, 2 * inter, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(pairs, inter, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(pairs, h, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(pairs, h, device="cuda", dtype=torch.bfloat16)
    w, dout = x["weights"].detach(), x["dout"]
    pad_up, pad_down = padded_rows(up.dW), padded_rows(down.dW)
    parts = {
        "group_by_expert": lambda: group_by_expert(x["ids"], e),
        "select_configs x2": lambda: (select_configs(tokens, w1, topk, True, False),
                                      select_configs(pairs, w2, topk, False, True)),
        "swiglu forward": lambda: swiglu_forward(hmid),
        "down forward": lambda: run_forward(a, w2, m_sizes, gather, topk, False, True, down.forward),
        "topk sum forward": lambda: topk_weighted_sum_forward(y, w),
        "swiglu backward": lambda: swiglu_backward(hmid, a),
        "gate_up dX + topk_sum": lambda: topk_sum(run_dx(hmid, w1, m_sizes, gather, topk, True, False, up.dX),
                                                  topk),
    }
    if pad_up:
        x_pad = pad(hid, m_sizes, gather, topk, pairs, pad_up)
        parts |= {
            "gate_up pad tokens": lambda: pad(hid, m_sizes, gather, topk, pairs, pad_up),
            "gate_up forward (padded)": lambda: forward_on_padded(x_pad, w1, m_sizes, gather, topk, up.forward,
                                                                  pad_up),
            "gate_up dW (padded)": lambda: dw_on_padded(x_pad, hmid, m_sizes, gather, topk, up.dW, "x")}
    else:
        parts |= {"gate_up forward": lambda: run_forward(hid, w1, m_sizes, gather, topk, True, False, up.forward),
                  "gate_up dW": lambda: run_dw(hid, hmid, m_sizes, gather, topk, True, False, up.dW)}
    if pad_down:
        dy_pad = pad(dout, m_sizes, gather, topk, pairs, pad_down, scale=w)
        parts |= {
            "topk sum backward (weights only)": lambda: topk_weighted_sum_backward(dout, y, w, with_dy=False),
            "down pad dY": lambda: pad(dout, m_sizes, gather, topk, pairs, pad_down, scale=w),
            "down dX (padded)": lambda: dx_on_padded(dy_pad, w2, m_sizes, gather, topk, down.dX, pad_down),
            "down dW (padded)": lambda: dw_on_padded(a, dy_pad, m_sizes, gather, topk, down.dW, "dy")}
    else:
        parts |= {"topk sum backward": lambda: topk_weighted_sum_backward(dout, y, w),
                  "down dX": lambda: run_dx(dy, w2, m_sizes, gather, topk, False, True, down.dX),
                  "down dW": lambda: run_dw(a, dy, m_sizes, gather, topk, False, True, down.dW)}
    return parts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(MODELS))
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_moe_mlp_host: needs a CUDA GPU", file=sys.stderr)
        return 2
    x = inputs(args.model, args.tokens)
    # few enough calls that the launches queued behind the parked GPU stay under the queue's depth
    rows = {"forward (no grad)": host_us(forward_call(x), 50), "step": host_us(step_call(x), 20)}
    for name, fn in pieces(x, args.model).items():
        rows[name] = host_us(fn, 100)
    step = step_call(x)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(30):
        step()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    pathlib.Path(args.out).write_text(json.dumps({"model": args.model, "tokens": args.tokens, "host_us": rows,
                                                  "cprofile_step_x30": text.getvalue()}, indent=1))
    for name, us in rows.items():
        print(f"{name:22s} {us:8.1f} µs")
    print(text.getvalue()[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
