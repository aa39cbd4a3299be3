"""MXFP4 (per_1x32) fused-MoE stages against the same stages on bf16 weights, and the MXFP4 roofline floor (issue 16).

Measures the MXFP4 GEMM paths issue 16 asks about: stage 1 + stage 2 (`moe_stage1`, `moe_stage2` on one ready sort;
the sort itself is not timed) with MXFP4 weights against the same stages with bf16 weights, on gpt-oss-120b's MoE
shape (E 128, top-4, D 2880, I 2880) at 1-4096 tokens. Configs: the rule table's bf16 choice for all (MXFP4 without
TMA, BLOCK_K >= 32). MXFP4 three ways: the weight tile decoded in registers, the same through tl.dot_scaled, and fp8
per-token activations through tl.dot_scaled (per_1x32_a8); also "mxfp4 rule", the rule table's own MXFP4 tiles
(what the op runs untuned: the swapped GEMM, `heuristics._mxfp4_swapped`); with --sweep also 12 tile configs per
16-bit path at <= 256 tokens (what a tuner would find first). Floor: the routed experts' MXFP4 weights (values 1/2
byte, scales 1/32 byte per weight) and the bf16 activations at the copy bandwidth, or the FLOPs at the bf16 peak.

    PYTHONPATH=src python benchmarks/bench_mxfp4_stages.py --out $OUT/bench_mxfp4_stages.json      # on the GPU
    PYTHONPATH=src python benchmarks/bench_mxfp4_stages.py --tiny --out F                          # interpreter

Each contestant is checked first against the fp32 reference on its own weights (MXFP4: the dequantized ones; rel_l2
in the JSON).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import sys

import torch

SHAPE = (2880, 2880, 128, 4)  # gpt-oss-120b: model_dim, inter_dim, experts, topk
TINY = (64, 32, 4, 2)
TOKENS = (1, 16, 64, 256, 1024, 4096)
PEAKS = {"bf16_flops": 730e12, "bytes_per_s": 3.0e12}  # H100 SXM, as the other benchmarks
SWEEP_TOKENS = 256  # sweep MXFP4 tiles up to this many tokens
SWEEP = [dict(BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, num_stages=st) for bn in (32, 64, 128) for bk in (128, 256)
         for st in (3, 4)]
# --fma: the stage kernels' multiply-add path (BLOCK_SIZE_M under 16: fp32 FMAs, no tl.dot), BLOCK_SIZE_M the power of
# two holding the pairs per expert, in these tiles, for bf16 and MXFP4 weights, where an expert gets at most 8 pairs.
FMA_TILES = [dict(BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, KSPLIT=ks, num_warps=w, num_stages=st)
             for bn, bk, ks, w, st in ((64, 128, 1, 4, 3), (128, 64, 1, 4, 3), (32, 256, 1, 4, 3), (64, 128, 2, 4, 3),
                                       (64, 128, 4, 4, 3), (128, 128, 1, 8, 3), (256, 64, 1, 8, 4))]


# --swap: the swapped MXFP4 GEMM (fused_moe._mxfp4_swap_dot) on these tiles besides the rule table's, up to
# SWEEP_TOKENS tokens (the probe's best at 1 and 64 tokens was BN 64, BK 128, 4 warps, 3 stages; split-K 4 at 1 token).
SWAP_TILES = [dict(BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, KSPLIT=ks, num_warps=w, num_stages=st)
              for bn, bk, ks, w, st in ((64, 128, 1, 4, 3), (64, 128, 4, 4, 3), (64, 128, 2, 4, 3), (128, 128, 1, 8, 3),
                                        (64, 256, 1, 4, 3), (32, 256, 1, 4, 3), (64, 128, 1, 4, 4), (128, 64, 1, 4, 4))]

# Above SWEEP_TOKENS: taller blocks, so one decoded weight tile serves more rows (the swapped dot's N is the block).
SWAP_TILES_LARGE = [dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, KSPLIT=1, num_warps=w, num_stages=st)
                    for bm, bn, bk, w, st in ((32, 64, 64, 4, 4), (64, 64, 64, 4, 3), (64, 64, 128, 4, 3),
                                              (128, 64, 64, 4, 3), (64, 128, 64, 8, 3), (128, 128, 64, 8, 3),
                                              (128, 64, 128, 4, 2))]


def floor_us(tokens: int, d: int, inter: int, topk: int, routed: int, bytes_per_weight: float) -> float:
    flops = 2.0 * tokens * topk * 3 * d * inter
    weights = routed * 3 * d * inter * bytes_per_weight
    return max(flops / PEAKS["bf16_flops"], (weights + 2 * tokens * d * 2) / PEAKS["bytes_per_s"]) * 1e6


def point(tokens: int, dims: tuple[int, int, int, int], device: str, iters: int, sweep: bool = False,
          fma: bool = False, sweep_warps: tuple[int, ...] = (), swap: bool = False) -> dict:
    from tritune.kernels import fused_moe as fm
    from tritune.kernels.moe_align import moe_align_block_size
    from tritune.kernels.moe_reference import fused_moe_reference
    from tritune.kernels.mxfp4_format import BITS_PER_WEIGHT
    from tritune.ops.heuristics import moe_heuristic
    from tritune.ops.routing import sample_routing
    from tritune.tuning.bench import time_kernel

    d, inter, e, topk = dims
    dtype = torch.bfloat16 if device == "cuda" else torch.float16  # the interpreter's dot is wrong on bf16
    gen = torch.Generator().manual_seed(tokens)
    hidden = (torch.randn(tokens, d, generator=gen) / 2).to(dtype).to(device)
    w1 = (torch.randn(e, 2 * inter, d, generator=gen) / d**0.5).to(device)
    w2 = (torch.randn(e, d, inter, generator=gen) / inter**0.5).to(device)
    tw, ti = sample_routing(tokens, e, topk, seed=tokens, device=device)
    routed = int(torch.unique(ti).numel())
    q1, s1 = fm.quantize_weights(w1, fm.MXFP4)
    q2, s2 = fm.quantize_weights(w2, fm.MXFP4)
    b1, b2 = w1.to(dtype), w2.to(dtype)
    refs = {q: fused_moe_reference(hidden, q1, q2, tw, ti, quant=q, w1_scale=s1, w2_scale=s2)
            for q in (fm.MXFP4, fm.MXFP4_A8)} | {"none": fused_moe_reference(hidden, b1, b2, tw, ti)}
    _, c1, c2 = moe_heuristic(max(tokens, 2 * 8 // topk + 1), d, inter, e, topk, "none",
                              capability=torch.cuda.get_device_capability() if device == "cuda" else (9, 0))
    c1, c2 = (dataclasses.replace(c, SORTED_INTER=0, TOPK_ATOMIC=0) for c in (c1, c2))
    row = {"tokens": tokens, "routed_experts": routed,
           "floor_mxfp4_us": floor_us(tokens, d, inter, topk, routed, BITS_PER_WEIGHT / 8),
           "floor_bf16_us": floor_us(tokens, d, inter, topk, routed, 2.0)}

    def run(quant: str, dot_scaled: bool, cfg1, cfg2, w1_, w2_, sc1, sc2):
        fm.MXFP4_DOT_SCALED = dot_scaled  # read at each launch: moe_stage1/2 launch through Triton's JIT
        sorting = moe_align_block_size(ti, cfg1.BLOCK_SIZE_M, e)
        kw = {"quant": quant}

        def call():
            mid = fm.moe_stage1(hidden, w1_, tw, sorting, cfg1, inter_dim=inter, w1_scale=sc1, **kw)
            return fm.moe_stage2(mid, w2_, tw, sorting, cfg2, w2_scale=sc2, **kw)

        ref = refs[quant]
        rel = float((call().float() - ref).norm() / ref.norm().clamp_min(1e-30))
        return rel, time_kernel(call, iters=iters, warmup=min(3, iters)).median_us

    replace = dataclasses.replace
    mx = lambda c: replace(c, USE_TMA=0, BLOCK_SIZE_K=max(32, c.BLOCK_SIZE_K))  # noqa: E731
    # The op's own MXFP4 choice (its rule table's MXFP4 entries), through the path the op takes by default.
    _, r1, r2 = moe_heuristic(tokens, d, inter, e, topk, fm.MXFP4, one_stage=False)
    contestants = {"bf16": ("none", False, c1, c2, b1, b2, None, None),
                   "mxfp4": (fm.MXFP4, False, mx(c1), mx(c2), q1, q2, s1, s2),
                   "mxfp4 dot_scaled": (fm.MXFP4, True, mx(c1), mx(c2), q1, q2, s1, s2),
                   "mxfp4 rule": (fm.MXFP4, fm.MXFP4_DOT_SCALED, r1, r2, q1, q2, s1, s2),
                   "mxfp4 a8": (fm.MXFP4_A8, True, mx(c1), mx(c2), q1, q2, s1, s2)}
    if sweep and tokens <= SWEEP_TOKENS and device == "cuda":
        for i, fields in enumerate(SWEEP):
            for label, ds in (("", False), (" dot_scaled", True)):
                contestants[f"mxfp4{label} sweep {i}"] = (fm.MXFP4, ds, dataclasses.replace(mx(c1), **fields),
                                                          dataclasses.replace(mx(c2), **fields), q1, q2, s1, s2)
    if sweep_warps and tokens <= SWEEP_TOKENS and device == "cuda":
        for w in sweep_warps:  # the dot_scaled path's tiles at these warp counts (the tuner prunes 8 on small tiles)
            for i, fields in enumerate(SWEEP):
                contestants[f"mxfp4 dot_scaled w{w} sweep {i}"] = (
                    fm.MXFP4, True, dataclasses.replace(mx(c1), num_warps=w, **fields),
                    dataclasses.replace(mx(c2), num_warps=w, **fields), q1, q2, s1, s2)
    if swap:  # the rule table's MXFP4 tiles with the weights as the dot's left operand, and SWAP_TILES on them
        contestants["mxfp4 swap"] = (fm.MXFP4, False, replace(r1, SWAP_AB=1), replace(r2, SWAP_AB=1), q1, q2, s1, s2)
        if device == "cuda":
            for i, fields in enumerate(SWAP_TILES if tokens <= SWEEP_TOKENS else SWAP_TILES_LARGE):
                contestants[f"mxfp4 swap {i}"] = (fm.MXFP4, False, replace(r1, SWAP_AB=1, **fields),
                                                  replace(r2, SWAP_AB=1, **fields), q1, q2, s1, s2)
    pairs_per_expert = math.ceil(tokens * topk / e)
    if fma and pairs_per_expert <= 8:
        bm = 1 << (pairs_per_expert - 1).bit_length()  # the power of two holding them
        for i, fields in enumerate(FMA_TILES):
            cfg = dataclasses.replace(fm.MoeConfig(), BLOCK_SIZE_M=bm, GROUP_SIZE_M=1, **fields)
            contestants[f"bf16 fma {i}"] = ("none", False, cfg, cfg, b1, b2, None, None)
            contestants[f"mxfp4 fma {i}"] = (fm.MXFP4, False, cfg, cfg, q1, q2, s1, s2)
    for name, (quant, dot_scaled, cfg1, cfg2, *tensors) in contestants.items():
        try:
            row[f"{name}_rel_l2"], row[f"{name}_us"] = run(quant, dot_scaled, cfg1, cfg2, *tensors)
            row[f"{name}_configs"] = [cfg1.name("stage1", quant), cfg2.name("stage2", quant)]
        except Exception as err:  # noqa: BLE001 - a config the compiler refuses is a result
            row[f"{name}_error"] = f"{type(err).__name__}: {err}"[:300]
    swept = {k[:-3]: v for k, v in row.items() if k.startswith("mxfp4") and k.endswith("_us")}
    row["mxfp4_best"] = min(swept, key=swept.get) if swept else "none"
    row["mxfp4_best_us"] = swept.get(row["mxfp4_best"], math.nan)
    bf16_fma = [v for k, v in row.items() if k.startswith("bf16 fma") and k.endswith("_us")]
    row["bf16_fma_best_us"] = min(bf16_fma) if bf16_fma else math.nan
    return row


def _warp_counts(text: str) -> tuple[int, ...]:
    """--sweep-warps: a comma list of 4, 8 or 16."""
    parts = text.split(",")
    if not all(p in ("4", "8", "16") for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: a comma list of warp counts, each 4, 8 or 16")
    return tuple(int(p) for p in parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--tiny", action="store_true", help="a tiny shape through the interpreter (no GPU)")
    ap.add_argument("--tokens", default=None, help="comma list (default: 1..4096, or 3,9 with --tiny)")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--sweep-warps", type=_warp_counts, default=(),
                    help="comma list of num_warps: the dot_scaled path's 12 sweep tiles at each, up to "
                         f"{SWEEP_TOKENS} tokens (issue 16: its K step is about 6x bf16's instructions; does a second "
                         "set of warps hide it?)")
    ap.add_argument("--sweep", action="store_true",
                    help=f"also 12 MXFP4 tile configs per path up to {SWEEP_TOKENS} tokens")
    ap.add_argument("--fma", action="store_true", help="also the stage kernels' multiply-add path (BLOCK_SIZE_M under "
                    "16) in a few tiles, bf16 and MXFP4, where an expert gets at most 8 pairs")
    ap.add_argument("--swap", action="store_true", help="also the swapped MXFP4 GEMM (the weights as the dot's left "
                    f"operand, packed PTX decode) on the rule table's tiles and {len(SWAP_TILES)} more up to "
                    f"{SWEEP_TOKENS} tokens, {len(SWAP_TILES_LARGE)} taller ones above")
    ap.add_argument("--padded-grid", action="store_true",
                    help="MoE GEMM grids over every block of the padded sort (the baseline of the tight grids)")
    args = ap.parse_args(argv)
    if args.padded_grid:
        from tritune.kernels import moe_align

        moe_align.GEMM_GRID_TIGHT = False
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    dims = TINY if args.tiny else SHAPE
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else ([3, 9] if args.tiny else list(TOKENS))
    rows = []
    for t in tokens:
        rows.append(point(t, dims, device, 1 if device == "cpu" else args.iters, args.sweep, args.fma,
                          args.sweep_warps, args.swap))
        args.out.write_text(json.dumps({"dims": dims, "device": device, "padded_grid": args.padded_grid, "rows": rows},
                                       indent=1))
    print("| tokens | floor MXFP4 µs | bf16 stages µs | bf16 multiply-add best µs | MXFP4 decode µs | "
          "MXFP4 dot_scaled µs | MXFP4 rule table µs | MXFP4 swapped (rule tiles) µs | MXFP4 fp8 A µs | MXFP4 best µs "
          "| best / floor | bf16 / MXFP4 best | best MXFP4 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        best = r["mxfp4_best_us"]
        print(f"| {r['tokens']} | {r['floor_mxfp4_us']:.1f} | {r.get('bf16_us', math.nan):.1f} | "
              f"{r['bf16_fma_best_us']:.1f} | {r.get('mxfp4_us', math.nan):.1f} | "
              f"{r.get('mxfp4 dot_scaled_us', math.nan):.1f} | {r.get('mxfp4 rule_us', math.nan):.1f} | "
              f"{r.get('mxfp4 swap_us', math.nan):.1f} | {r.get('mxfp4 a8_us', math.nan):.1f} | {best:.1f} | "
              f"{best / r['floor_mxfp4_us']:.2f} | {r.get('bf16_us', math.nan) / best:.2f} | {r['mxfp4_best']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
