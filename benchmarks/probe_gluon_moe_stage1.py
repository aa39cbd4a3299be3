r"""Fused-MoE stage 1 (gate-up + SiLU) with per_1x128 fp8 in Gluon (issue 14, prototype, not yet run on a GPU): the
rows gathered into the sort's order beforehand (as the op's GATHER_A plan does) so A comes through TMA like w1's gate
and up tiles; per K block two MMAs (gate, up) into fresh partials while the previous block's two are rescaled into
their sums (the schedule of `kernels/gluon_blockscale.py`, two MMA groups in flight); silu(gate) · up stored in the
sort's order through TMA (the sorted intermediate stage 2 reads). Measured beside the op's own per_1x128 call, kernel
by kernel (warm L2).

    PYTHONPATH=src python benchmarks/probe_gluon_moe_stage1.py --dims 2048,1536,64,6 --tokens 1024,4096 \
        [--variants 128:64:4:8:8] [--out F]

A variant is BM:BN:STAGES:WARPS:GROUP_M; BN is the gate's (and the up's) width, so a tile holds 2·BN columns of w1.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch
import triton

from tritune.kernels.gluon_blockscale import HAS_GLUON_HOPPER

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from probe_gluon_moe_stage2 import checked_timing, expert_rows, op_kernels, sorted_operand  # noqa: E402

if HAS_GLUON_HOPPER:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from tritune.kernels.gluon_blockscale import _tile_coords, _tma_load, _tma_store

    @gluon.jit
    def _load3(a_desc, w_desc, a_smem, g_smem, u_smem, ready, k, off_m, gate_row, up_row, pred,
               STAGES: gl.constexpr):
        """K block k of A's rows and w1's gate and up rows into stage k % STAGES, where `pred`."""
        s = k % STAGES
        mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + 2 * w_desc.block_type.nbytes, pred=pred)
        _tma_load(a_desc, [off_m, k * 128], ready.index(s), a_smem.index(s), pred=pred)
        _tma_load(w_desc, [gate_row, k * 128], ready.index(s), g_smem.index(s), pred=pred)
        _tma_load(w_desc, [up_row, k * 128], ready.index(s), u_smem.index(s), pred=pred)

    @gluon.jit
    def _issue2(a_smem, g_smem, u_smem, ready, regs_g, regs_u, k, STAGES: gl.constexpr):
        """Block k's gate and up MMAs from zero (into the registers of `regs_*`, unread), once the stage landed."""
        s = k % STAGES
        mbarrier.wait(ready.index(s), phase=(k // STAGES) & 1)
        pg = warpgroup_mma(a_smem.index(s), g_smem.index(s).permute((1, 0)), regs_g, use_acc=False, is_async=True)
        pu = warpgroup_mma(a_smem.index(s), u_smem.index(s).permute((1, 0)), regs_u, use_acc=False, is_async=True)
        return pg, pu

    @gluon.jit
    def moe_stage1_kernel(a_desc, w_desc, c_desc, as_ptr, ws_ptr, expert_ids_ptr, num_post_ptr, N_INTER, K, max_blocks,
                          stride_asm, stride_ask, stride_wse, stride_wsn, stride_wsk,
                          GROUP_M: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr):
        """inter[row, n] = silu(Σ_k A_k[row]·G_kᵀ · s) · (Σ_k A_k[row]·U_kᵀ · s) for the sorted rows of a block whose
        expert is e (G = w1[e, n], U = w1[e, I + n] with I = N_INTER, s = a_s[row, k] · w_s[e, n // 128, k]).
        Grid: (max_blocks · ⌈I/BN⌉,); programs past the sort's blocks return."""
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BN: gl.constexpr = w_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        gl.static_assert(BK == 128)
        gl.static_assert(BN <= 128)
        pid_m, pid_n = _tile_coords(gl.program_id(0), max_blocks, gl.cdiv(N_INTER, BN), GROUP_M)
        if pid_m * BM >= gl.load(num_post_ptr):
            return
        expert = gl.load(expert_ids_ptr + pid_m)
        off_m = pid_m * BM
        off_n = pid_n * BN
        gate_row = expert * 2 * N_INTER + off_n
        up_row = gate_row + N_INTER
        k_tiles = gl.cdiv(K, BK)

        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                              instr_shape=[16, BN, 32])
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
        g_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
        u_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
        for i in gl.static_range(STAGES):
            _load3(a_desc, w_desc, a_smem, g_smem, u_smem, ready, i, off_m, gate_row, up_row, i < k_tiles, STAGES)

        rows = off_m + gl.arange(0, BM, layout=row_layout)
        a_s_ptrs = as_ptr + rows * stride_asm
        wg_s_ptr = ws_ptr + expert * stride_wse + (off_n // 128) * stride_wsn
        wu_s_ptr = ws_ptr + expert * stride_wse + ((N_INTER + off_n) // 128) * stride_wsn
        acc_g = gl.zeros([BM, BN], gl.float32, mma_layout)
        acc_u = gl.zeros([BM, BN], gl.float32, mma_layout)
        # Two MMA groups a K block (gate, up): waiting for at most two outstanding retires the previous block's pair
        # while this block's pair runs. The partials alternate and take acc * 0 as their unread accumulators, as in
        # the dense kernel, so no register copy touches an in-flight partial.
        g0, u0 = _issue2(a_smem, g_smem, u_smem, ready, acc_g, acc_u, 0, STAGES)
        a0 = gl.load(a_s_ptrs)
        sg0 = a0 * gl.load(wg_s_ptr)
        su0 = a0 * gl.load(wu_s_ptr)
        for ki in range(1, k_tiles - 1, 2):
            g1, u1 = _issue2(a_smem, g_smem, u_smem, ready, acc_g * 0.0, acc_u * 0.0, ki, STAGES)
            a1 = gl.load(a_s_ptrs + ki * stride_ask)
            sg1 = a1 * gl.load(wg_s_ptr + ki * stride_wsk)
            su1 = a1 * gl.load(wu_s_ptr + ki * stride_wsk)
            dg, du = warpgroup_mma_wait(num_outstanding=2, deps=(g0, u0))  # block ki-1's pair
            acc_g = acc_g + dg * sg0[:, None]
            acc_u = acc_u + du * su0[:, None]
            j = ki - 1 + STAGES  # into block ki-1's stage, free now
            _load3(a_desc, w_desc, a_smem, g_smem, u_smem, ready, j, off_m, gate_row, up_row, j < k_tiles, STAGES)
            g0, u0 = _issue2(a_smem, g_smem, u_smem, ready, acc_g * 0.0, acc_u * 0.0, ki + 1, STAGES)
            a0 = gl.load(a_s_ptrs + (ki + 1) * stride_ask)
            sg0 = a0 * gl.load(wg_s_ptr + (ki + 1) * stride_wsk)
            su0 = a0 * gl.load(wu_s_ptr + (ki + 1) * stride_wsk)
            dg, du = warpgroup_mma_wait(num_outstanding=2, deps=(g1, u1))  # block ki's pair
            acc_g = acc_g + dg * sg1[:, None]
            acc_u = acc_u + du * su1[:, None]
            _load3(a_desc, w_desc, a_smem, g_smem, u_smem, ready, j + 1, off_m, gate_row, up_row, j + 1 < k_tiles,
                   STAGES)
        if k_tiles % 2 == 0:
            g1, u1 = _issue2(a_smem, g_smem, u_smem, ready, acc_g * 0.0, acc_u * 0.0, k_tiles - 1, STAGES)
            a1 = gl.load(a_s_ptrs + (k_tiles - 1) * stride_ask)
            sg1 = a1 * gl.load(wg_s_ptr + (k_tiles - 1) * stride_wsk)
            su1 = a1 * gl.load(wu_s_ptr + (k_tiles - 1) * stride_wsk)
            dg, du = warpgroup_mma_wait(num_outstanding=2, deps=(g0, u0))
            acc_g = acc_g + dg * sg0[:, None]
            acc_u = acc_u + du * su0[:, None]
            dg, du = warpgroup_mma_wait(num_outstanding=0, deps=(g1, u1))
            acc_g = acc_g + dg * sg1[:, None]
            acc_u = acc_u + du * su1[:, None]
        else:
            dg, du = warpgroup_mma_wait(num_outstanding=0, deps=(g0, u0))
            acc_g = acc_g + dg * sg0[:, None]
            acc_u = acc_u + du * su0[:, None]
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))

        h = acc_g / (1.0 + gl.exp(-acc_g)) * acc_u  # silu(gate) * up
        c_smem = gl.allocate_shared_memory(c_desc.dtype, [BM, BN], c_desc.layout)
        c_smem.store(h.to(c_desc.dtype))
        fence_async_shared()
        _tma_store(c_desc, [off_m, off_n], c_smem)
        tma.store_wait(pendings=0)


def run_variant(variant: str, d: int, inter: int, experts: int, tokens: int, ti, q1, s1) -> dict:
    """One Gluon stage-1 config on fresh gathered rows: relative error against the dequantized torch product, µs
    (warm L2)."""
    from tritune.kernels.gluon_blockscale import descriptor

    bm, bn, stages, warps, group = (int(x) for x in variant.split(":"))
    sort, a8, a_s = sorted_operand(ti, bm, experts, d, tokens + 2)  # rows gathered in the sort's order
    rows = a8.shape[0]
    inter_out = torch.zeros(rows, inter, device="cuda", dtype=torch.bfloat16)
    max_blocks = rows // bm
    grid = (max_blocks * triton.cdiv(inter, bn),)
    args = (descriptor(a8, [bm, 128]), descriptor(q1.reshape(experts * 2 * inter, d), [bn, 128]),
            descriptor(inter_out, [bm, bn]), a_s, s1, sort.expert_ids, sort.num_tokens_post_padded, inter, d,
            max_blocks, a_s.stride(0), a_s.stride(1), s1.stride(0), s1.stride(1), s1.stride(2))

    def fn():
        moe_stage1_kernel[grid](*args, GROUP_M=group, STAGES=stages, WARPS=warps, num_warps=warps)
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
