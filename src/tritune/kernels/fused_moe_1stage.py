"""The 1-stage fused MoE: both GEMMs in one launch, for small token counts where the weights dominate.

Each program computes a BLOCK_N slice of the intermediate for one block of sorted pairs and adds its product
with w2 into an fp32 output with atomics, so every weight element is read once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tritune.kernels.fused_moe import (
    MoeConfig,
    _activation,
    _block_pairs,
    _gated_tile,
    _k32_columns,
    _mxfp4_swap_dot,
    _pid_mn,
    _tile_mn,
)
from tritune.kernels.mxfp4 import k32_unscale, mxfp4_tile
from tritune.kernels.pdl import pdl_start
from tritune.knobs import interpreting

# The 1-stage call's last launch (`_acc_to_out_kernel`, fp32 accumulator to the output dtype) done inside the GEMM
# kernel instead: each program counts itself on the tokens it added to, and the last contributor of a token converts
# that token's row (the GEMM split-K one-launch pattern). One launch fewer per call: the small-token path, where the
# host cost of each launch shows (issue 11). Off: correct on the H100 (its GPU test passes) but slower there, the
# counter and the last contributor's read-back cost more GPU time than the launch saves (graph time at 1 token: Mixtral
# 242-243 -> 246 µs, Qwen3-30B-A3B 41-42 -> 44 µs; eager no better; RESULTS.md 2026-11-26, fifth session).
FINAL_CAST_IN_KERNEL = False

# The swapped 1-stage kernel split along K (KSPLIT > 1) on a GPU: every split of a slice waits for the others and runs
# a share of w2's rows (COOP), instead of the last one running all of them: H100, one token, 0.76-0.89x the time of
# the last-split form and of the stage pair (RESULTS.md, twenty-first session). Never in the interpreter, which runs
# one program at a time (a waiting program would wait for ever): there the last split runs them all.
COOP_SPLIT = True
# Cooperative splits take their work by ticket (an atomic counter, in the order programs start) rather than by
# program id: the wait is then safe whatever order the GPU starts programs in. A probe's switch.
COOP_TICKET = True
# The swapped 1-stage kernel split along K, left to ptxas, holds 127 registers a thread at 8 warps: two programs an
# SM. Capped at 80 (no spills, sm90) three fit; the cap goes on only past two programs an SM, since with room for
# three the GPU packs programs three to an SM and leaves SMs idle. H100 (RESULTS.md, twenty-second session), µs
# uncapped -> capped: gpt-oss-120b 1 token split 4 (368 programs) 54.6 -> 44.3, 2 tokens split 2 (368) 83.6 -> 68.9;
# Qwen3-30B-A3B-like 4 tokens split 2 (384) 63.7 -> 52.1; DeepSeek-V2-Lite-like 1 token split 4 (264, two an SM)
# 28.5 -> 32.6. Unsplit the kernel holds about 60 registers already.
SPLIT_MAXNREG = 80
UNCAPPED_PROGRAMS_PER_SM = 2  # programs of the split kernel an SM holds as ptxas leaves it
CAPPED_PROGRAMS_PER_SM = 3  # and under SPLIT_MAXNREG
MAXNREG: int | None = None  # a probe's override of `register_cap`: 0 ptxas' choice, else the cap
# Probes only: the swapped 1-stage kernel writes each program's phase stamps (`_stamp`) to a workspace piece
# (MoeLaunch.trace_piece), TRACE_SLOTS int64 a program: %globaltimer then %clock64 at entry, after its work item and
# block of pairs are known, after stage 1's K loop, after the splits' fixup, at the end (slots 0-4); %smid and the
# program's work item (5, 6); after the wait for the previous launch (7).
TRACE = False
TRACE_SLOTS = 16
# A cooperative split that must wait for its slice's other splits first asks the L2 for w2's bytes (prepared weights:
# the slice's 4 KB chunks, one bulk prefetch each), so the w2 steps after the wait read the L2. 0 off; 1 the slice's
# first split to arrive prefetches every chunk of the slice; 2 each split that will wait prefetches its own share.
# `prefetch_w2` takes 1 from 4 splits: H100, 1 token, three rounds each, µs off -> 1 (RESULTS.md, twenty-fourth
# session): split 4 gpt-oss-120b 44.1 -> 44.2, Qwen3-30B-A3B-like 27.2 -> 26.3 (2 tokens 35.9 -> 35.1),
# DeepSeek-V2-Lite-like 28.9 -> 28.3 (2 tokens 52.3 -> 49.0); split 2 lost (DeepSeek-like 1 token 35.3 -> 36.8,
# 2 tokens 41.5 -> 41.9), and 2 was even at gpt-oss-120b's 1 and 2 tokens. A probe's override: PREFETCH_W2 0, 1 or 2.
PREFETCH_W2: int | None = None
PREFETCH_W2_MIN_SPLIT = 4
_TRACE_SLOTS = tl.constexpr(TRACE_SLOTS)  # the same for the kernel: the first half %globaltimer, the second %clock64


@triton.jit
def _moe_1stage_kernel(
    a_ptr, a_scale_ptr,  # hidden [T, D] (dtype or fp8) and its fp32 scales
    w1_ptr, w1_scale_ptr,  # [E, INTER·(2 if GATED else 1), D] and scales as in stage 1
    w2_ptr, w2_scale_ptr,  # [E, D, INTER]; per_token scales [E, D], per_1x128 [E, ⌈D/128⌉, ⌈INTER/128⌉];
    # MXFP4 (QUANT 3-5): packed [E, D, INTER/2] with e8m0 scales [E, D, INTER/32]
    out_ptr,  # fp32 [T, D], zeroed; every program adds its share atomically
    sorted_ids_ptr, expert_ids_ptr, num_post_ptr, weights_ptr,
    final_ptr,  # FINAL_CAST: [T, D] in the activation dtype (row stride D); else unused
    count_ptr,  # FINAL_CAST: fp32 [T], zeroed: contributions added to each token's row so far; else unused
    numel, INTER, D, num_pid_m,
    stride_am, stride_asm, stride_w1e, stride_w1n, stride_w1se, stride_w1sn,
    stride_w2e, stride_w2n, stride_w2se, stride_w2sn,
    TOPK: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, QUANT: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr, BLOCK_SIZE_D: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr, EVEN_K: tl.constexpr, WIDE_FP16: tl.constexpr, FINAL_CAST: tl.constexpr = False,
):
    """A BLOCK_N slice of the intermediate for one block of pairs, then its contribution to every output column.

    Each weight element is read once; the output is summed over intermediate slices with fp32 atomics, so this
    suits small token counts, where the weights dominate and the atomics are few.
    FINAL_CAST: after its adds each program counts itself on its tokens (TOPK·⌈INTER/BLOCK_N⌉ contributions each);
    the last one of a token writes that row of the fp32 sum to `final_ptr` in the activation dtype.
    Grid: (num_pid_m·⌈INTER/BLOCK_N⌉,).
    """
    pid_m, pid_n = _pid_mn(num_pid_m, tl.cdiv(INTER, BLOCK_SIZE_N), GROUP_SIZE_M)
    if pid_m * BLOCK_SIZE_M >= tl.load(num_post_ptr):
        return
    pairs, row_ok, a_rows, expert = _block_pairs(sorted_ids_ptr, expert_ids_ptr, pid_m, numel, TOPK, BLOCK_SIZE_M)
    offs_i_out = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    i_ok = offs_i_out < INTER
    offs_i = offs_i_out % INTER
    acc_g, acc_u = _gated_tile(a_ptr, a_rows, stride_am, 0, D, D, INTER, w1_ptr + expert * stride_w1e, offs_i,
                               stride_w1n, a_scale_ptr, stride_asm, w1_scale_ptr + expert * stride_w1se, stride_w1sn,
                               w1_ptr, 0, a_ptr, 0, GATED, QUANT, EVEN_K, False, BLOCK_SIZE_M, BLOCK_SIZE_N,
                               BLOCK_SIZE_K)
    inter = _activation(acc_g, ACT) * acc_u if GATED else _activation(acc_g, ACT)
    inter = inter * tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)[:, None]
    inter = tl.where(i_ok[None, :], inter, 0.0)
    # The second GEMM runs in the activation dtype: fp8 weights are widened in registers and their scales
    # applied after the dot (no per-row scale of the intermediate exists before the whole row is known); MXFP4
    # weights are decoded (BLOCK_SIZE_N a multiple of 32, so each slice holds whole scale blocks).
    if QUANT == 0:
        inter = inter.to(w2_ptr.dtype.element_ty)
    elif WIDE_FP16:
        inter = inter.to(tl.float16)
    else:
        inter = inter.to(tl.bfloat16)

    w2_base = w2_ptr + expert * stride_w2e
    w2s_base = w2_scale_ptr + expert * stride_w2se
    out_rows = out_ptr + (pairs // TOPK).to(tl.int64)[:, None] * D
    for d in range(0, D, BLOCK_SIZE_D):
        offs_d = d + tl.arange(0, BLOCK_SIZE_D)
        d_ok = offs_d < D
        w2_ptrs = w2_base + (offs_d % D)[None, :] * stride_w2n + offs_i[:, None]  # [BLOCK_N, BLOCK_D]
        if QUANT >= 3:  # MXFP4: the slice [pid_n·BLOCK_N, +BLOCK_N) of each w2 row decoded to inter's dtype
            w2 = mxfp4_tile(w2_base, w2s_base, (offs_d % D).to(tl.int64), pid_n * BLOCK_SIZE_N, stride_w2n,
                            stride_w2sn, INTER, BLOCK_SIZE_D, BLOCK_SIZE_N, tl.float32).to(inter.dtype).T
            part = tl.dot(inter, w2)
        elif QUANT == 0:
            part = tl.dot(inter, tl.load(w2_ptrs))
        else:
            part = tl.dot(inter, tl.load(w2_ptrs).to(inter.dtype))
            if QUANT == 1:
                part = part * tl.load(w2s_base + offs_d % D)[None, :]
            else:
                # BLOCK_SIZE_N divides 128, so the slice lies in one 128-wide block of INTER.
                s2 = tl.load(w2s_base + ((offs_d % D) // 128) * stride_w2sn + (pid_n * BLOCK_SIZE_N) // 128)
                part = part * s2[None, :]
        tl.atomic_add(out_rows + offs_d[None, :], part, mask=row_ok[:, None] & d_ok[None, :], sem="relaxed")
    if FINAL_CAST:
        _cast_finished_rows(out_rows, final_ptr, count_ptr, pairs // TOPK, row_ok, D,
                            TOPK * tl.cdiv(INTER, BLOCK_SIZE_N), BLOCK_SIZE_D)


@triton.jit
def _moe_1stage_swap_kernel(
    a_ptr,  # hidden [T, D] 16-bit: in the K32 order for standard bytes (the sort's first launch copies it so:
    # kernels/mxfp4.py), in K order for prepared weights (W_SWIZZLED: kernels/mxfp4_swizzle.py)
    w1_ptr, w1_desc, w1_scale_ptr,  # MXFP4 w1 [E, INTER·(2 if GATED else 1), D/2] (or prepared), its TMA view, and
    # its codes [E, ·, D/32] (pointers) or the records' TMA view (SCALE_TMA)
    w2_ptr, w2_desc, w2_scale_ptr,  # the same for w2 [E, D, INTER/2]
    out_ptr,  # fp32 [T, D], zeroed; every program adds its share atomically
    sorted_ids_ptr, expert_ids_ptr, num_post_ptr, weights_ptr,
    part_ptr,  # KSPLIT > 1: fp32 [KSPLIT, numel, INTER·(2 if GATED else 1)] stage 1's partial sums; else unused
    count_ptr,  # KSPLIT > 1: fp32 [num_pid_m·⌈INTER/BLOCK_N⌉ (+ 1 with COOP: the ticket counter)], zeroed: the splits
    # of each slice done; else unused
    trace_ptr,  # TRACE: fp32 [programs·2·TRACE_SLOTS] seen as int64 [programs, TRACE_SLOTS]; else unused
    numel, INTER, D, num_pid_m, k_per_split,
    stride_am, stride_w1e, stride_w1n, stride_w1se, stride_w1sn, stride_w2e, stride_w2n, stride_w2se, stride_w2sn,
    TOPK: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, QUANT: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr, BLOCK_SIZE_D: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr, SCALE_TMA: tl.constexpr,
    W_SWIZZLED: tl.constexpr, KSPLIT: tl.constexpr = 1, PDL: tl.constexpr = False, COOP: tl.constexpr = False,
    TICKET: tl.constexpr = True, TRACE: tl.constexpr = False, PREFETCH_W2: tl.constexpr = 0,
):
    """`_moe_1stage_kernel` for MXFP4 weights on the swapped GEMM (SWAP_AB: the decoded weight tile is the wgmma's
    register operand, its 64 rows from the weight): the decode's whole call in one GEMM launch.

    Why: at 1 token the stage pair's two GEMM launches, each with its own fill and drain, plus the split-K finish
    and the top-k sum between and after them, cost about as much as the weight bytes themselves (RESULTS.md,
    twentieth session: the two reads alone 33.6 µs of the op's 51.5 on gpt-oss-120b). Here a program computes
    the BLOCK_N slice of the intermediate of one block of pairs (stage 1's swapped K loop over D), applies the
    activation and the routing weight, puts the slice in the K32 order in registers and multiplies it with the
    matching BLOCK_N-wide K slice of w2, BLOCK_D output rows a step (a second swapped K loop, each step one w2 tile),
    adding each step's [pairs, BLOCK_D] into the fp32 output. Every weight byte is read once.

    w2's K step is BLOCK_N (64 or 128, within one tile-major chunk); with SCALE_TMA (BLOCK_N 128) its codes come from
    one record a step.

    KSPLIT > 1 (for a handful of pairs, where blocks × slices leave SMs idle): stage 1's K loop is split over KSPLIT
    programs, each storing its partial sums and counting itself done (an fp32 counter the sort's first launch
    zeroes). COOP (on a GPU): every split waits for the count, adds the partials up and runs its share of w2's rows;
    otherwise the last split runs them all, as the GEMM's split-K fixup does.
    TRACE (probes): each program writes its phase stamps (`_stamp`) to trace_ptr.
    Grid: (num_pid_m·⌈INTER/BLOCK_N⌉·KSPLIT,) with COOP, else (num_pid_m·⌈INTER/BLOCK_N⌉, KSPLIT).
    """
    trace = (trace_ptr.to(tl.pointer_type(tl.int64))
             + (tl.program_id(0) + tl.program_id(1) * tl.num_programs(0)) * _TRACE_SLOTS)
    _stamp(trace, 0, TRACE)
    pdl_start(PDL)
    _stamp(trace, 7, TRACE)
    n_slices = tl.cdiv(INTER, BLOCK_SIZE_N)
    if COOP and not TICKET:  # a slice's splits are neighbours in launch order
        tile, split = tl.program_id(0) // KSPLIT, tl.program_id(0) % KSPLIT
    elif COOP:
        # Work by ticket, in the order programs start: the programs holding the first t tickets are all running, so
        # every slice among them but the last is whole and finishes, and none waits for a split that cannot start.
        ticket = tl.atomic_add(count_ptr + num_pid_m * n_slices, 1.0, sem="relaxed", scope="gpu").to(tl.int32)
        tile, split = ticket // KSPLIT, ticket % KSPLIT
    else:
        tile, split = tl.program_id(0), tl.program_id(1)
    pid_m, pid_n = _tile_mn(tile, num_pid_m, n_slices, GROUP_SIZE_M)
    if pid_m * BLOCK_SIZE_M >= tl.load(num_post_ptr):
        return
    pairs, row_ok, a_rows, expert = _block_pairs(sorted_ids_ptr, expert_ids_ptr, pid_m, numel, TOPK, BLOCK_SIZE_M)
    _stamp(trace, 1, TRACE)
    i0 = pid_n * BLOCK_SIZE_N
    offs_i_out = i0 + tl.arange(0, BLOCK_SIZE_N)
    offs_i = offs_i_out % INTER
    # Stage 1, as the swapped stage-1 kernel computes its tile (fused_moe._moe_gemm_kernel).
    if SCALE_TMA:
        ws1, s1_row = w1_scale_ptr, (expert * stride_w1se + pid_n * (BLOCK_SIZE_N // 64)).to(tl.int32)
    else:
        ws1, s1_row = w1_scale_ptr + expert * stride_w1se, stride_w1sn
    rows1 = 2 * INTER if GATED else INTER
    if W_SWIZZLED:  # prepared weights keep whole 64-row chunks
        rows1 = tl.cdiv(rows1, 64) * 64
    k_start = split * k_per_split
    acc_g, acc_u = _gated_tile(a_ptr, a_rows, stride_am, k_start, tl.minimum(k_start + k_per_split, D), D, INTER,
                               w1_ptr + expert * stride_w1e, offs_i, stride_w1n, a_ptr, 0, ws1, s1_row, w1_desc,
                               (expert * rows1 + i0).to(tl.int32), a_ptr, 0, GATED, QUANT, EVEN_K, USE_TMA,
                               BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, SWAP_AB=True, SCALE_TMA=SCALE_TMA,
                               W_SWIZZLED=W_SWIZZLED)
    _stamp(trace, 2, TRACE)
    last = True
    d_start, d_end = 0, D
    if KSPLIT > 1:
        d_per = tl.cdiv(tl.cdiv(D, KSPLIT), BLOCK_SIZE_D) * BLOCK_SIZE_D
        # W2's chunks of this slice's K step (prepared weights: [E, ⌈D/64⌉, ⌈INTER/128⌉, 64, 64] bytes)
        pf_steps = tl.cdiv(INTER, 128)
        pf_base = w2_ptr + expert * stride_w2e + (i0 // 128) * 4096
        acc_g, acc_u, last = _split_fixup(acc_g, acc_u, part_ptr, count_ptr + pid_m * n_slices + pid_n, split,
                                          pairs, row_ok, offs_i_out, numel, INTER, GATED, KSPLIT, BLOCK_SIZE_M,
                                          BLOCK_SIZE_N, COOP, pf_base, pf_steps * 4096, tl.cdiv(D, 64),
                                          (split * d_per) // 64, tl.cdiv(tl.minimum(split * d_per + d_per, D), 64),
                                          PREFETCH_W2 if W_SWIZZLED else 0)
        if COOP:  # every split takes its share of w2's rows
            d_start = split * d_per
            d_end = tl.minimum(d_start + d_per, D)
    _stamp(trace, 3, TRACE)
    if last:
        _swap_1stage_down(acc_g, acc_u, pairs, row_ok, offs_i_out, expert, i0, out_ptr, weights_ptr, w2_ptr, w2_desc,
                          w2_scale_ptr, INTER, D, d_start, d_end, stride_w2e, stride_w2n, stride_w2se, stride_w2sn,
                          TOPK, GATED, ACT, BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_D, USE_TMA, SCALE_TMA, W_SWIZZLED,
                          a_ptr)
    _stamp(trace, 4, TRACE)
    if TRACE:
        smid = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        tl.store(trace + 5, smid.to(tl.int64))
        tl.store(trace + 6, (tile * KSPLIT + split).to(tl.int64))


@triton.jit
def _stamp(trace, slot: tl.constexpr, TRACE: tl.constexpr):
    """TRACE: this moment's %globaltimer (ns, one clock for every SM) at trace[slot], %clock64 in the slots' second
    half."""
    if TRACE:
        ns = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
        cycles = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
        tl.store(trace + slot, ns)
        tl.store(trace + _TRACE_SLOTS // 2 + slot, cycles)


@triton.jit
def _split_fixup(acc_g, acc_u, part_ptr, count_ptr, split, pairs, row_ok, offs_i_out, numel, INTER,
                 GATED: tl.constexpr, KSPLIT: tl.constexpr, BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr,
                 COOP: tl.constexpr = False, pf_base=None, pf_stride=0, pf_blocks=0, pf_lo=0, pf_hi=0,
                 PREFETCH: tl.constexpr = 0):
    """Store this split's (gate, up) partial sums [BLOCK_M, BLOCK_N] of its pairs; count the split done; the last one
    of the slice gets them all back summed, in split order: (acc_g, acc_u, whether this program is that one).
    COOP: every split waits until the slice's count is full and gets the sums (each then runs a share of w2).
    PREFETCH (COOP, PREFETCH_W2): before waiting, L2 prefetches of 4 KB chunks at pf_base + b·pf_stride: 1 every b
    below pf_blocks by the slice's first arrival, 2 b in [pf_lo, pf_hi) by each split that will wait."""
    n_w = 2 * INTER if GATED else INTER
    part = part_ptr + pairs.to(tl.int64)[:, None] * n_w + offs_i_out[None, :]
    ok = row_ok[:, None] & (offs_i_out < INTER)[None, :]
    tl.store(part + split * numel * n_w, acc_g, mask=ok)
    if GATED:
        tl.store(part + split * numel * n_w + INTER, acc_u, mask=ok)
    tl.debug_barrier()  # every thread's partial is stored before the release below publishes them
    done = tl.atomic_add(count_ptr, 1.0, sem="acq_rel", scope="gpu")
    acc_g = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    last = done == KSPLIT - 1
    if COOP:  # the slice's splits hold neighbouring tickets, so they all run: wait for the others
        seen = done + 1.0
        if PREFETCH == 1:
            _prefetch_chunks(pf_base, pf_stride, 0, pf_blocks, done == 0)
        elif PREFETCH == 2:
            _prefetch_chunks(pf_base, pf_stride, pf_lo, pf_hi, seen < KSPLIT)
        while seen < KSPLIT:
            seen = tl.atomic_add(count_ptr, 0.0, sem="acquire", scope="gpu")
        last = seen >= KSPLIT
    if last:
        for s in tl.static_range(KSPLIT):  # L2 loads (.cg): other SMs wrote them
            acc_g += tl.load(part + s * numel * n_w, mask=ok, other=0.0, cache_modifier=".cg")
            if GATED:
                acc_u += tl.load(part + s * numel * n_w + INTER, mask=ok, other=0.0, cache_modifier=".cg")
    return acc_g, acc_u, last


@triton.jit
def _prefetch_chunks(base, stride, lo, hi, pred):
    """One `cp.async.bulk.prefetch.L2` of 4096 bytes at base + b·stride for each b in [lo, hi) (at most 256) where
    `pred` holds: a hint to the L2, nothing waits for it."""
    b = lo + tl.arange(0, 256)
    ok = ((b < hi) & pred).to(tl.int32)
    addr = (base + b.to(tl.int64) * stride).to(tl.int64, bitcast=True)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], 4096; mov.b32 $0, 0; }",
        "=r,l,r", [addr, ok], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _swap_1stage_down(acc_g, acc_u, pairs, row_ok, offs_i_out, expert, i0, out_ptr, weights_ptr, w2_ptr, w2_desc,
                      w2_scale_ptr, INTER, D, d_start, d_end, stride_w2e, stride_w2n, stride_w2se, stride_w2sn,
                      TOPK: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, BLOCK_SIZE_M: tl.constexpr,
                      BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_D: tl.constexpr, USE_TMA: tl.constexpr,
                      SCALE_TMA: tl.constexpr, W_SWIZZLED: tl.constexpr, a_ptr):
    """The swapped 1-stage kernel's second half: the activation and routing weight on the slice's (gate, up) sums,
    then its product with w2's K slice [i0, i0 + BLOCK_N), BLOCK_D output columns a step over [d_start, d_end),
    added into `out_ptr`. `a_ptr` (hidden) gives the dtype the intermediate is rounded to for the MMA."""
    if SCALE_TMA:
        ws2 = w2_scale_ptr
    else:
        ws2 = w2_scale_ptr + expert * stride_w2se
    rows2 = D
    if W_SWIZZLED:  # prepared weights keep whole 64-row chunks
        rows2 = tl.cdiv(rows2, 64) * 64
    inter = _activation(acc_g, ACT) * acc_u if GATED else _activation(acc_g, ACT)
    inter = inter * tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)[:, None]
    inter = tl.where((offs_i_out < INTER)[None, :], inter, 0.0)
    # w2's K slice [i0, i0 + BLOCK_N) decodes in the K32 order from standard bytes, so the intermediate's columns go
    # in that order too; prepared weights decode in K order (kernels/mxfp4_swizzle.py).
    if not W_SWIZZLED:
        inter = _k32_columns(inter, BLOCK_SIZE_M, BLOCK_SIZE_N)
    inter_t = tl.trans(inter.to(a_ptr.dtype.element_ty))
    unscale = k32_unscale(a_ptr.dtype.element_ty)
    out_rows = out_ptr + (pairs // TOPK).to(tl.int64)[:, None] * D
    w2_base = w2_ptr + expert * stride_w2e
    for d in tl.range(d_start, d_end, BLOCK_SIZE_D):
        offs_d = d + tl.arange(0, BLOCK_SIZE_D)
        s2_row = stride_w2sn
        if SCALE_TMA:  # this step's records: block d / 64 of this expert's
            s2_row = (expert * stride_w2se + d // 64).to(tl.int32)
        acc = tl.zeros((BLOCK_SIZE_D, BLOCK_SIZE_M), dtype=tl.float32)
        acc = _mxfp4_swap_dot(inter_t, w2_base, ws2, offs_d % D, i0, stride_w2n, s2_row, INTER, acc, w2_desc,
                              (expert * rows2 + d).to(tl.int32), USE_TMA, BLOCK_SIZE_D, BLOCK_SIZE_N, SCALE_TMA,
                              W_SWIZZLED)
        tl.atomic_add(out_rows + offs_d[None, :], tl.trans(acc) * unscale,
                      mask=row_ok[:, None] & (offs_d < D)[None, :], sem="relaxed")


@triton.jit
def _cast_finished_rows(acc_rows, final_ptr, count_ptr, tokens, row_ok, D, contributions, BLOCK_SIZE_D: tl.constexpr):
    """Count this program's contribution to each of its tokens; where it was the last one, write the token's fp32 sum
    (`acc_rows`) to its row of `final_ptr` in that dtype. Every add of every program is published by the release of
    its count (after a barrier: all of this program's threads have added), and the last one's acquire and L2 loads
    (.cg: other SMs added) see them all."""
    tl.debug_barrier()
    done = tl.atomic_add(count_ptr + tokens, 1.0, mask=row_ok, sem="acq_rel", scope="gpu")
    last = row_ok & (done == contributions - 1)
    final_rows = final_ptr + tokens.to(tl.int64)[:, None] * D
    for d in range(0, D, BLOCK_SIZE_D):
        offs_d = d + tl.arange(0, BLOCK_SIZE_D)
        mask = last[:, None] & (offs_d < D)[None, :]
        total = tl.load(acc_rows + offs_d[None, :], mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(final_rows + offs_d[None, :], total.to(final_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n"])
def _acc_to_out_kernel(
    acc_ptr,  # fp32 [n]
    out_ptr,  # [n] in the activation dtype
    n, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):
    """out = acc in out's dtype (the 1-stage kernel sums into fp32 with atomics).

    Grid: (⌈n/BLOCK⌉,).
    """
    pdl_start(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(acc_ptr + offs, mask=offs < n).to(out_ptr.dtype.element_ty), mask=offs < n)


def fused_moe_1stage(hidden: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, config: MoeConfig, *, activation: str = "silu", quant: str = "none",
                     w1_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                     doweight_stage1: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """The whole MoE in one GEMM launch (plus sort, quantize, zero and cast), for small token counts.

    Same arguments and result as `fused_moe_2stage`. The routing weight is applied to the intermediate whichever
    way doweight_stage1 says, since both GEMMs are in one kernel and the result is the same.
    """
    from tritune.kernels.fused_moe import stage_scales
    from tritune.kernels.fused_moe_launch import MoeLaunch

    w1_scale, w2_scale = stage_scales(w1_scale, config.SCALE_TMA), stage_scales(w2_scale, config.SCALE_TMA)
    launch = MoeLaunch(hidden, w1, w2, topk_weights, topk_ids, w1_scale, w2_scale, stage1=config, stage2=None,
                       activation=activation, quant=quant, doweight_stage1=doweight_stage1)
    if out is None:
        out = torch.empty((hidden.shape[0], w2.shape[1]), device=hidden.device, dtype=hidden.dtype)
    return launch(hidden, w1, w2, topk_weights, topk_ids, w1_scale, w2_scale, out)



def prefetch_w2(cfg: MoeConfig) -> int:
    """PREFETCH_W2 for the swapped 1-stage kernel with `cfg` (its kernel applies it to cooperative splits of prepared
    weights only): the probe's override, else 1 from PREFETCH_W2_MIN_SPLIT splits."""
    if PREFETCH_W2 is not None:
        return PREFETCH_W2
    return 1 if cfg.KSPLIT >= PREFETCH_W2_MIN_SPLIT else 0


def coop_split(cfg: MoeConfig) -> bool:
    """Whether the swapped 1-stage kernel with `cfg` runs its splits cooperatively (COOP_SPLIT, on a GPU)."""
    return bool(cfg.SWAP_AB) and cfg.KSPLIT > 1 and COOP_SPLIT and not interpreting()


def register_cap(cfg: MoeConfig, pairs: int, experts: int, inter_dim: int, sm_count: int | None) -> int | None:
    """ptxas' register cap a thread (`maxnreg`) for the swapped 1-stage kernel with `cfg` on `pairs` routed pairs
    (None: ptxas' choice): SPLIT_MAXNREG for a split whose programs (a block an expert, at most `pairs`) pass two an
    SM of `sm_count`."""
    if MAXNREG is not None:
        return MAXNREG or None
    if not (cfg.SWAP_AB and cfg.KSPLIT > 1) or sm_count is None or interpreting():
        return None
    programs = one_stage_programs(pairs, experts, inter_dim, cfg.BLOCK_SIZE_N) * cfg.KSPLIT
    return SPLIT_MAXNREG if programs > UNCAPPED_PROGRAMS_PER_SM * sm_count else None


def one_stage_programs(pairs: int, experts: int, inter_dim: int, block_n: int) -> int:
    """The 1-stage kernel's working programs unsplit at a handful of pairs an expert: a 16-row block an expert routed
    (at most `pairs` of the `experts`) × the intermediate's BLOCK_N-wide slices."""
    return min(pairs, experts) * triton.cdiv(inter_dim, block_n)
