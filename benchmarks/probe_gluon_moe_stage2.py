r"""Fused-MoE stage 2 with per_1x128 fp8 in Gluon (issue 14; the kernel: kernels/gluon_moe.py): the sorted intermediate
and w2 through TMA, block k-1's rescale while block k's MMA runs (the schedule of `kernels/gluon_blockscale.py`),
each row sent back to its (token, slot) pair with its routing weight. Measured beside the op's own stage 2 (the
Triton kernel that retires the MMA every K block), both on the same sorted, quantized intermediate, warm L2 (the
op's profile convention).

    PYTHONPATH=src python benchmarks/probe_gluon_moe_stage2.py --dims 2048,1536,64,6 --tokens 1024,4096 \
        [--variants 128:128:4:8:8,64:128:4:4:8] [--out F]

A variant is BM:BN:STAGES:WARPS:GROUP_M[:P], P 1 for the persistent kernel (a program a SM), P 2 its
warp-specialised form (`moe_stage2_ws_kernel`: a loader warp group feeds the MMA warps). The op's stage 2 is
timed through `profile_moe_kernels.device_events` on the whole op (its stage-2 kernel's mean µs). """

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch
import triton

from tritune.kernels.gluon_blockscale import HAS_GLUON_HOPPER

if HAS_GLUON_HOPPER:
    from tritune.kernels.gluon_gemm_ws import ws_maxnreg
    from tritune.kernels.gluon_moe import moe_stage2_kernel, moe_stage2_persistent_kernel, moe_stage2_ws_kernel


def op_kernels(d: int, inter: int, experts: int, tw, ti, q2, s2) -> list:
    """The op's per_1x128 call on these weights, kernel by kernel (warm L2, mean µs, launch order)."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    from profile_moe_kernels import kernel_times

    from tritune.kernels.fused_moe import quantize_weights
    from tritune.ops import fused_moe

    gen = torch.Generator(device="cuda").manual_seed(7)
    q1, s1 = quantize_weights(torch.randn(experts, 2 * inter, d, device="cuda", generator=gen) / d ** 0.5,
                              "per_1x128")
    h = torch.randn(ti.shape[0], d, device="cuda", generator=gen).bfloat16()
    fn = lambda: fused_moe(h, q1, q2, tw, ti, quant="per_1x128", w1_scale=s1, w2_scale=s2)  # noqa: E731
    return [(name, round(us, 1)) for name, us in kernel_times(fn, 20)]


def sorted_operand(ti, block_m: int, experts: int, cols: int, seed: int):
    """The sort of `ti` in `block_m`-row blocks and a random fp8 operand in its row order (1x128 scales): (sort,
    fp8 rows, scales)."""
    from tritune.kernels.moe_align import moe_align_block_size
    from tritune.kernels.quant import quantize_blocks

    sort = moe_align_block_size(ti, block_m, experts)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    a8, a_s = quantize_blocks(torch.randn(sort.sorted_token_ids.numel(), cols, device="cuda", generator=gen), 1)
    return sort, a8, a_s


def expert_rows(sort, block_m: int, numel: int, a8, a_s) -> tuple:
    """For the reference: each sorted row's pair, its expert, whether it is a real pair, and the rows dequantized."""
    sid = sort.sorted_token_ids.long()
    eid = sort.expert_ids.long().repeat_interleave(block_m)[: sid.numel()]
    return sid, eid, sid < numel, a8.float() * a_s.repeat_interleave(128, 1)[:, : a8.shape[1]]


def checked_timing(fn, err: float) -> dict:
    """µs of fn (`triton.testing.do_bench`, warm L2) and the relative error it was checked with."""
    return {"us": round(triton.testing.do_bench(fn, warmup=10, rep=50) * 1000, 1), "rel_err": round(err, 5)}


def run_variant(variant: str, d: int, inter: int, experts: int, topk: int, tokens: int, tw, ti, q2, s2) -> dict:
    """One Gluon stage-2 config on a fresh sorted, quantized intermediate: relative error against the dequantized
    torch product (routing weight applied), µs (warm L2)."""
    from tritune.kernels.gluon_blockscale import descriptor

    bm, bn, stages, warps, group, persistent = (int(x) for x in (variant + ":0").split(":")[:6])
    sort, a8, a_s = sorted_operand(ti, bm, experts, inter, tokens + 1)  # the sorted intermediate
    rows = a8.shape[0]
    numel = tokens * topk
    out = torch.zeros(numel, d, device="cuda", dtype=torch.bfloat16)
    max_blocks = rows // bm
    grid = (max_blocks * triton.cdiv(d, bn),)
    programs = min(grid[0], torch.cuda.get_device_properties(0).multi_processor_count)
    flat_w = tw.reshape(-1).float().contiguous()
    args = (descriptor(a8, [bm, 128]), descriptor(q2.reshape(experts * d, inter), [bn, 128]), out, a_s, s2,
            sort.sorted_token_ids, sort.expert_ids, flat_w, sort.num_tokens_post_padded, numel, d, inter, max_blocks,
            a_s.stride(0), a_s.stride(1), s2.stride(0), s2.stride(1), s2.stride(2), out.stride(0))

    def fn():
        if persistent == 2:
            moe_stage2_ws_kernel[(programs,)](*args, programs, GROUP_M=group, STAGES=stages, WARPS=warps,
                                              num_warps=warps, maxnreg=ws_maxnreg(warps))
        elif persistent:
            moe_stage2_persistent_kernel[(programs,)](*args, programs, GROUP_M=group, STAGES=stages, WARPS=warps,
                                                      num_warps=warps)
        else:
            moe_stage2_kernel[grid](*args, GROUP_M=group, STAGES=stages, WARPS=warps, num_warps=warps)
        return out

    fn()
    torch.cuda.synchronize()
    sid, eid, real, a_deq = expert_rows(sort, bm, numel, a8, a_s)
    w_deq = q2.float() * s2.repeat_interleave(128, 1)[:, :d].repeat_interleave(128, 2)[:, :, :inter]
    ref = torch.zeros(numel, d, device="cuda")
    for e in range(experts):
        r = real & (eid == e)
        if r.any():
            ref[sid[r]] = (a_deq[r] @ w_deq[e].T) * flat_w[sid[r]][:, None]
    return checked_timing(fn, float((out.float() - ref).norm() / ref.norm()))


def run_point(d: int, inter: int, experts: int, topk: int, tokens: int, variants: list[str]) -> dict:
    from tritune.kernels.fused_moe import quantize_weights
    from tritune.ops.routing import sample_routing

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    q2, s2 = quantize_weights(torch.randn(experts, d, inter, device="cuda", generator=gen) / inter ** 0.5,
                              "per_1x128")  # fp8 [E, D, I], fp32 [E, D/128, I/128]
    tw, ti = sample_routing(tokens, experts, topk, seed=tokens, device="cuda")
    row = {"dims": [d, inter, experts, topk], "tokens": tokens,
           "op_kernels": op_kernels(d, inter, experts, tw, ti, q2, s2)}
    print(tokens, "op kernels", row["op_kernels"], flush=True)
    for v in variants:
        row[f"gluon {v}"] = run_variant(v, d, inter, experts, topk, tokens, tw, ti, q2, s2)
        print(tokens, v, row[f"gluon {v}"], flush=True)
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", default="2048,1536,64,6", help="D,I,E,TOPK")
    ap.add_argument("--tokens", default="1024,4096")
    ap.add_argument("--variants", default="128:128:4:8:8,64:128:4:4:8")
    ap.add_argument("--out", type=pathlib.Path)
    args = ap.parse_args(argv)
    if not HAS_GLUON_HOPPER or not torch.cuda.is_available():
        sys.exit("probe_gluon_moe_stage2: needs a Hopper GPU and Triton's Gluon API")
    d, inter, experts, topk = (int(x) for x in args.dims.split(","))
    rows = [run_point(d, inter, experts, topk, int(t), args.variants.split(",")) for t in args.tokens.split(",")]
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
