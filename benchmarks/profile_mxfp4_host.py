"""Host µs of one `ops.fused_moe_mxfp4` call with the scales as plain codes against prepared scales
(`prepare_mxfp4_scales`: codes and their TMA records), and with the weights prepared too (`prepare_mxfp4_weights`),
the GPU parked so launches only queue (issue 16). The prepared path settles each stage's scale form from the op's
choice; this says what that costs a call.

    PYTHONPATH=src python benchmarks/profile_mxfp4_host.py [--json F]                 # GPU
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))

SHAPES = {"E32 top4 D1024 I512": (1024, 512, 32, 4), "gpt-oss-120b": (2880, 2880, 128, 4)}  # D, I, E, topk


def inputs(tokens: int, d: int, inter: int, experts: int, topk: int) -> tuple:
    from tritune.kernels.fused_moe import quantize_weights
    from tritune.ops.routing import sample_routing

    g = torch.Generator(device="cuda").manual_seed(tokens)
    hidden = torch.randn(tokens, d, device="cuda", generator=g).bfloat16()
    (w1, s1), (w2, s2) = (quantize_weights(torch.randn(experts, rows, k, device="cuda", generator=g) / k**0.5,
                                           "per_1x32") for rows, k in ((2 * inter, d), (d, inter)))
    weights, ids = sample_routing(tokens, experts, topk, skew=0.0, device=torch.device("cuda"), seed=tokens)
    return (hidden, w1, w2, weights, ids), s1, s2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=pathlib.Path, default=None)
    ap.add_argument("--tokens", default="1,16,1024")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_mxfp4_host: needs a GPU (host cost with the GPU parked)")
    from profile_moe_host import host_us

    from tritune import ops

    rows = []
    for shape, dims in SHAPES.items():
        for tokens in (int(t) for t in args.tokens.split(",")):
            call, s1, s2 = inputs(tokens, *dims)
            p1, p2 = ops.prepare_mxfp4_scales(s1), ops.prepare_mxfp4_scales(s2)
            hidden, w1, w2, weights, ids = call
            pw = (hidden, ops.prepare_mxfp4_weights(w1), ops.prepare_mxfp4_weights(w2), weights, ids)
            forms = {"codes": lambda call=call, s1=s1, s2=s2: ops.fused_moe_mxfp4(*call, s1, s2),
                     "prepared": lambda call=call, p1=p1, p2=p2: ops.fused_moe_mxfp4(*call, p1, p2),
                     "weights": lambda pw=pw, p1=p1, p2=p2: ops.fused_moe_mxfp4(*pw, p1, p2)}
            for r in range(args.rounds):
                for form, fn in forms.items():
                    rows.append({"shape": shape, "tokens": tokens, "scales": form, "round": r, "host_us": host_us(fn)})
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    print("| shape | tokens | codes µs | prepared scales µs | prepared weights and scales µs |")
    print("|---|---|---|---|---|")
    for shape in SHAPES:
        for tokens in sorted({r["tokens"] for r in rows}):
            med = {f: statistics.median(r["host_us"] for r in rows if (r["shape"], r["tokens"], r["scales"])
                                        == (shape, tokens, f)) for f in ("codes", "prepared", "weights")}
            print(f"| {shape} | {tokens} | {med['codes']:.1f} | {med['prepared']:.1f} | {med['weights']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
