"""Are the swapped MXFP4 stage-2 tiles deterministic (issue 16)? The same input through one config many times.

Stage 2 without split-K or top-k atomics adds in a fixed order, so every run of a config must give the same bits.
The tuner's correctness gate caught non-finite outputs from one swapped MXFP4 tile on the H100 (BM 64, BN 128, BK 64
on 4 warps: two 64-row wgmmas a warp group with the A operand in registers); this probe counts, per config, the runs
whose output differs from the first and the non-finite elements over all runs. `check_config` now refuses swapped
MXFP4 tiles wider than 16 × num_warps; the probe builds the configs directly, so it still runs them.

    PYTHONPATH=src python benchmarks/probe_mxfp4_swap_race.py --runs 30 --out $OUT/swap_race.json      # GPU
    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/probe_mxfp4_swap_race.py --tiny --runs 2 --out F
    ... --tma      # the packed weights through TMA, as the op's swapped tiles load them since the seventeenth session
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))

# (tokens, BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, num_warps, num_stages) on gpt-oss-120b's stage 2 (D = I = 2880).
CASES = ((4096, 64, 128, 64, 4, 3), (4096, 64, 128, 64, 4, 4), (4096, 64, 128, 64, 8, 3), (4096, 64, 64, 64, 4, 3),
         (4096, 128, 128, 64, 4, 3), (64, 16, 128, 128, 4, 3), (64, 16, 64, 128, 4, 3), (1024, 32, 128, 128, 4, 3))
TINY_CASES = ((5, 16, 32, 32, 4, 2), (9, 16, 64, 64, 4, 2))
SHAPE = (2880, 2880, 128, 4)  # model_dim, inter_dim, experts, topk
TINY = (64, 64, 4, 2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--tiny", action="store_true", help="small shapes through the interpreter (fp16)")
    ap.add_argument("--tma", action="store_true", help="the packed weights through TMA (USE_TMA 1), as the op now runs")
    args = ap.parse_args(argv)
    from tritune.kernels import fused_moe as fm
    from tritune.kernels.fused_moe import MoeConfig
    from tritune.kernels.moe_align import moe_align_block_size
    from tritune.ops.routing import sample_routing

    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float16  # the interpreter's bf16 dot is wrong
    d, inter, experts, topk = TINY if args.tiny else SHAPE
    gen = torch.Generator(device=device).manual_seed(0)
    q2, s2 = fm.quantize_weights(torch.randn(experts, d, inter, generator=gen, device=device) / inter**0.5, fm.MXFP4)
    rows = []
    for tokens, bm, bn, bk, warps, stages in (TINY_CASES if args.tiny else CASES):
        tw, ti = sample_routing(tokens, experts, topk, seed=tokens, device=device)
        a = (torch.randn(tokens * topk, inter, generator=gen, device=device) / 2).to(dtype)
        cfg = MoeConfig(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=1, num_warps=warps,
                        num_stages=stages, SWAP_AB=1, USE_TMA=int(args.tma))
        sorting = moe_align_block_size(ti, bm, experts)
        first = fm.moe_stage2(a, q2, tw, sorting, cfg, quant=fm.MXFP4, w2_scale=s2)
        differing = nonfinite = 0
        for _ in range(args.runs):
            out = fm.moe_stage2(a, q2, tw, sorting, cfg, quant=fm.MXFP4, w2_scale=s2)
            differing += int(not torch.equal(out, first))
            nonfinite += int((~torch.isfinite(out)).sum())
        row = {"tokens": tokens, "config": cfg.name("stage2", fm.MXFP4), "runs": args.runs,
               "differing_runs": differing, "nonfinite_elements": nonfinite,
               "first_nonfinite": int((~torch.isfinite(first)).sum())}
        rows.append(row)
        print(json.dumps(row), flush=True)
    pathlib.Path(args.out).write_text(json.dumps({"device": device, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
