"""Stage 2 of the fused MoE as a persistent kernel (MoeConfig.PERSISTENT): for down projections with a short K.

Why. Stage 2's K is the intermediate size, often 384-1536 in fine-grained MoE models, so a 128x256 tile runs only
3-6 K steps. On the H100 (benchmarks/RESULTS.md, E 128 top-8 I 384 at 4096 tokens) one such tile a SM spent most of
its time on the pipeline's fill and on the epilogue's scattered store, with nothing else to overlap them: one program
a SM fits in shared memory, and its loads start only after the previous program's store. A persistent program walks
tiles start, start + programs, ... in one loop that Triton flattens with the K loop (`tl.range(..., flatten=True)`),
so the next tile's TMA loads are issued while this tile's epilogue runs.

What it runs: the sorted intermediate (SORTED_INTER 2) through its TMA descriptor, the weights through theirs
(USE_TMA), bf16/fp16 or fp8 (per-token; per_1x128 with each K step's scales), one K split; each row goes back to its
pair in the epilogue with its routing weight, as `_moe_gemm_kernel` stores it for the top-k sum (or, with
TOPK_ATOMIC, adds into the fp32 [T, D] accumulator: with GROUP_SIZE_M at least the block count the tiles go N tile by
N tile, so the accumulator columns being added into, T x BLOCK_N x 4 bytes, can stay in L2). Same arguments as
`_moe_gemm_kernel` (the launch binds either), the options it does not run pinned by static asserts; the grid is
(min(SMs, tiles),).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tritune.kernels.fused_moe import _scaled_dot, _tile_mn
from tritune.kernels.pdl import pdl_start


@triton.jit
def _moe_gemm_persistent_kernel(
    a_ptr, a_desc, a_scale_ptr, w_ptr, w_desc, w_scale_ptr, out_ptr,
    sorted_ids_ptr, expert_ids_ptr, num_post_ptr, weights_ptr, amax_ptr,
    numel, N, K, k_per_split, num_pid_m,
    stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om, stride_ok, stride_amax,
    A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, MUL_WEIGHT: tl.constexpr, QUANT: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr, KSPLIT: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr,
    AMAX_OUT: tl.constexpr = 0, A_QUANT_ON_LOAD: tl.constexpr = False, OUT_SORTED: tl.constexpr = False,
    A_SORTED: tl.constexpr = 0, ATOMIC_TOPK: tl.constexpr = 0, SWAP_AB: tl.constexpr = False,
    WARP_SPEC: tl.constexpr = False,
    OUT_K32: tl.constexpr = False,  # the stage-1 option of _moe_gemm_kernel's signature: never set here
    SCALE_TMA: tl.constexpr = False,  # _moe_gemm_kernel's swapped-MXFP4 option: never set here (check_config)
    W_SWIZZLED: tl.constexpr = False,  # _moe_gemm_kernel's prepared MXFP4 weights: never set here (QUANT <= 2)
    PDL: tl.constexpr = False,  # launched as a programmatic dependent (kernels/pdl.py)
):
    """Tiles (block of sorted rows, N tile) of the blocks the sort filled, grouped by GROUP_SIZE_M blocks per column
    of N tiles; each program takes every tl.num_programs(0)-th tile.

    Grid: (min(SMs, gemm_blocks · ⌈N/BLOCK_N⌉),) (`gemm.programs_per_wave`).
    """
    tl.static_assert(not GATED and ACT == 2 and KSPLIT == 1 and USE_TMA and A_SORTED == 2)
    tl.static_assert(not SWAP_AB and not WARP_SPEC and not A_QUANT_ON_LOAD and AMAX_OUT == 0 and not OUT_SORTED)
    tl.static_assert(QUANT <= 2)  # 16-bit, fp8 per_token, fp8 per_1x128 (BLOCK_SIZE_K dividing 128)
    pdl_start(PDL)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    blocks = tl.minimum(tl.cdiv(tl.load(num_post_ptr), BLOCK_SIZE_M), num_pid_m)
    num_tiles = blocks * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_SIZE_K)
    for tile_id in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=True):
        pid_m, pid_n = _tile_mn(tile_id, blocks, num_pid_n, GROUP_SIZE_M)
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        row0 = (pid_m * BLOCK_SIZE_M).to(tl.int32)
        w_row = (expert * N + pid_n * BLOCK_SIZE_N).to(tl.int32)
        rows = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
        offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
        acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
        for ki in range(k_tiles):
            k = ki * BLOCK_SIZE_K
            a = a_desc.load([row0, k])
            a_s = rows  # per_1x128 only: this K step's 1x128 activation scales (the weights' inside _scaled_dot)
            if QUANT == 2:
                a_s = tl.load(a_scale_ptr + rows * stride_asm + k // 128)
            acc = _scaled_dot(a, a_s, w_desc.load([w_row, k]).T, w_scale_ptr + expert * stride_wse, offs_n % N, k,
                              stride_wsn, acc, QUANT, False)
        pairs = tl.load(sorted_ids_ptr + rows)
        row_ok = pairs < numel
        if QUANT == 1:  # per-token: the sorted row's activation scale times the weight row's
            a_s = tl.load(a_scale_ptr + rows)
            w_s = tl.load(w_scale_ptr + expert * stride_wse + offs_n % N)
            acc = acc * a_s[:, None] * w_s[None, :]
        if MUL_WEIGHT:
            acc = acc * tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)[:, None]
        mask = row_ok[:, None] & (offs_n < N)[None, :]
        if ATOMIC_TOPK != 0:  # TOPK_ATOMIC: weight x row added into the fp32 [T, N] accumulator, row token = pair // k
            tokens = (pairs // ATOMIC_TOPK).to(tl.int64)
            tl.atomic_add(out_ptr + tokens[:, None] * stride_om + offs_n[None, :], acc, mask=mask, sem="relaxed")
        else:
            tl.store(out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=mask)
