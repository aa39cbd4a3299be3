r"""Fused-MoE stage 1 (gate-up + SiLU) with per_1x128 fp8 in Gluon (issue 14; the kernel: kernels/gluon_moe.py): the
rows gathered into the sort's order beforehand (as the op's GATHER_A plan does) so A comes through TMA like w1's gate
and up tiles; per K block two MMAs (gate, up) into fresh partials while the previous block's two are rescaled into
their sums (the schedule of `kernels/gluon_blockscale.py`, two MMA groups in flight); silu(gate) · up stored in the
sort's order through TMA (the sorted intermediate stage 2 reads). Measured beside the op's own per_1x128 call, kernel
by kernel (warm L2).

    PYTHONPATH=src python benchmarks/probe_gluon_moe_stage1.py --dims 2048,1536,64,6 --tokens 1024,4096 \
        [--variants 128:64:4:8:8] [--out F]

A variant is BM:BN:STAGES:WARPS:GROUP_M[:MODE[:P]]; BN is the gate's (and the up's) width, so a tile holds 2·BN columns
of w1; MODE 2 has the kernel copy each pair's token row itself (GATHER, cp.async) instead of reading gathered rows
through TMA (MODE 1 was a one-MMA kernel, removed after it measured slower); P 1 runs the persistent kernel
(`moe_stage1_persistent_kernel`, a program a SM), P 2 its warp-specialised form (`moe_stage1_ws_kernel`: a loader
warp group feeds the MMA warps, and with MODE 2 gathers the rows itself).
"""

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
    from tritune.kernels.gluon_moe import moe_stage1_kernel, moe_stage1_persistent_kernel, moe_stage1_ws_kernel

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from probe_gluon_moe_stage2 import checked_timing, expert_rows, op_kernels, sorted_operand  # noqa: E402


def run_variant(variant: str, d: int, inter: int, experts: int, tokens: int, ti, q1, s1) -> dict:
    """One Gluon stage-1 config on fresh gathered rows: relative error against the dequantized torch product, µs
    (warm L2)."""
    from tritune.kernels.gluon_blockscale import descriptor
    from tritune.kernels.quant import quantize_blocks

    bm, bn, stages, warps, group, mode, persistent = (int(x) for x in (variant + ":0:0").split(":")[:7])
    if mode not in (0, 2):
        raise SystemExit(f"probe_gluon_moe_stage1: variant {variant!r}: MODE is 0 (copied rows) or 2 (own gather)")
    kernel = (moe_stage1_kernel, moe_stage1_persistent_kernel, moe_stage1_ws_kernel)[persistent]
    sort, _, _ = sorted_operand(ti, bm, experts, 128, 0)
    topk = ti.shape[1]
    gen = torch.Generator(device="cuda").manual_seed(tokens + 2)
    t8, t_s = quantize_blocks(torch.randn(tokens, d, device="cuda", generator=gen), 1)  # the tokens' rows
    sid = sort.sorted_token_ids.long()
    real = sid < ti.numel()
    tok = torch.where(real, sid // topk, 0)
    a8 = torch.where(real[:, None], t8[tok].view(torch.uint8), 0).view(t8.dtype)  # gathered, as GATHER_A copies
    a_s = torch.where(real[:, None], t_s[tok], 0.0)
    rows = a8.shape[0]
    inter_out = torch.zeros(rows, inter, device="cuda", dtype=torch.bfloat16)
    max_blocks = rows // bm
    grid = (max_blocks * triton.cdiv(inter, bn),)
    gather = mode == 2
    a_op, s_op = (t8, t_s) if gather else (a8, a_s)
    head = (descriptor(a_op, [bm, 128]), descriptor(q1.reshape(experts * 2 * inter, d), [bn, 128]),
            descriptor(inter_out, [bm, bn]), s_op, s1, sort.expert_ids, sort.num_tokens_post_padded)
    values = (inter, d, max_blocks, s_op.stride(0), s_op.stride(1), s1.stride(0), s1.stride(1), s1.stride(2))
    # A's token rows and the sorted pairs (read with GATHER), their count, A's row stride
    args = head + (t8, sort.sorted_token_ids) + values + (ti.numel(), t8.stride(0))
    extra = {"GATHER": gather, "TOPK": topk}
    if persistent == 2:
        extra["maxnreg"] = ws_maxnreg(warps)
    if persistent:
        grid = (min(torch.cuda.get_device_properties(0).multi_processor_count, grid[0]),)
        args += (grid[0],)

    def fn():
        kernel[grid](*args, GROUP_M=group, STAGES=stages, WARPS=warps, num_warps=warps, **extra)
        return inter_out

    fn()
    torch.cuda.synchronize()
    _, eid, real, a_deq = expert_rows(sort, bm, ti.numel(), a8, a_s)
    ref = torch.zeros(rows, inter, device="cuda")
    for e in range(experts):
        r = real & (eid == e)
        if r.any():
            w_deq = q1[e].float() * s1[e].repeat_interleave(128, 0)[: 2 * inter].repeat_interleave(128, 1)[:, :d]
            y = a_deq[r] @ w_deq.T
            ref[r] = torch.nn.functional.silu(y[:, :inter]) * y[:, inter:]
    return checked_timing(fn, float((inter_out.float()[real] - ref[real]).norm() / ref[real].norm()))


def main(argv: list[str] | None = None) -> None:
    from tritune.kernels.fused_moe import quantize_weights
    from tritune.ops.routing import sample_routing

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", default="2048,1536,64,6", help="D,I,E,TOPK (I a multiple of 128)")
    ap.add_argument("--tokens", default="1024,4096")
    ap.add_argument("--variants", default="128:64:4:8:8")
    ap.add_argument("--out", type=pathlib.Path)
    args = ap.parse_args(argv)
    if not HAS_GLUON_HOPPER or not torch.cuda.is_available():
        sys.exit("probe_gluon_moe_stage1: needs a Hopper GPU and Triton's Gluon API")
    d, inter, experts, topk = (int(x) for x in args.dims.split(","))
    if inter % 128:
        sys.exit(f"probe_gluon_moe_stage1: I {inter} is not a multiple of 128 (the up rows' weight scales)")
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        gen = torch.Generator(device="cuda").manual_seed(tokens)
        q1, s1 = quantize_weights(torch.randn(experts, 2 * inter, d, device="cuda", generator=gen) / d ** 0.5,
                                  "per_1x128")
        q2, s2 = quantize_weights(torch.randn(experts, d, inter, device="cuda", generator=gen) / inter ** 0.5,
                                  "per_1x128")
        tw, ti = sample_routing(tokens, experts, topk, seed=tokens, device="cuda")
        row = {"dims": [d, inter, experts, topk], "tokens": tokens,
               "op_kernels": op_kernels(d, inter, experts, tw, ti, q2, s2)}
        print(tokens, "op kernels", row["op_kernels"], flush=True)
        for v in args.variants.split(","):
            row[f"gluon {v}"] = run_variant(v, d, inter, experts, tokens, ti, q1, s1)
            print(tokens, v, row[f"gluon {v}"], flush=True)
        rows.append(row)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
